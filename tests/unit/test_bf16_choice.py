"""bf16 is never the slow path by default: `auto` sampling picks float32 for a bf16 model on a CPU
without native bf16, and asking for bf16 there warns with the slowdown measured on this machine."""
from __future__ import annotations

import torch

from retrograd import device


def test_auto_sampling_dtype_follows_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: False)
    assert device.auto_sampling_dtype(torch.bfloat16, cpu) == torch.float32
    assert device.auto_sampling_dtype(torch.float32, cpu) is None  # an fp32 model samples in fp32 anyway
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: True)
    assert device.auto_sampling_dtype(torch.bfloat16, cpu) is None  # the model's own bf16
    # flags unreadable (not Linux): decided by timing
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: None)
    monkeypatch.setattr(device, "bf16_matmul_slowdown", lambda: 3.8)
    assert device.auto_sampling_dtype(torch.bfloat16, cpu) == torch.float32
    monkeypatch.setattr(device, "bf16_matmul_slowdown", lambda: 0.6)
    assert device.auto_sampling_dtype(torch.bfloat16, cpu) is None
    assert not device.bf16_slow_here(torch.device("cuda"))


def test_the_warning_names_the_key_and_the_measured_slowdown(monkeypatch):
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: False)
    monkeypatch.setattr(device, "bf16_matmul_slowdown", lambda: 3.8)
    text = device.bf16_warning(torch.device("cpu"), "model.dtype")
    assert "model.dtype = 'bfloat16'" in text and "3.8x slower than float32" in text
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: True)
    assert device.bf16_warning(torch.device("cpu"), "model.dtype") is None


def test_the_slowdown_is_measured_and_the_flags_read():
    ratio = device.bf16_matmul_slowdown.__wrapped__(n=64, reps=2)
    assert 0.01 < ratio < 100
    info = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    expected = any(f in info.split() for f in device.BF16_CPU_FLAGS) if info else None
    assert device.cpu_bf16_native.__wrapped__() == expected
