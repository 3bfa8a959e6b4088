"""Device-specific choices, in one place: torch threads, which device a run uses, the attention
kernel for short bf16 passes on CPU, whether this CPU computes bf16 natively (and what the `auto`
choices make of it), and memory readings. Loops, the sampler and the service ask here instead of
testing the device themselves. (Which library runs a float32 product, MKL or oneDNN, is models/cpu_gemm.py's:
the layers that multiply ask it per call.)"""
from __future__ import annotations

import functools
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch


def configure_torch(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    # CPU kernels are deterministic for a fixed thread count, which is what bit-exact resume needs.
    # torch.use_deterministic_algorithms is deliberately not set: on CPU it steers attention away
    # from the fused SDPA kernel and cost ~8% of SFT throughput, with no effect on exactness.


def pick_device(name: str) -> torch.device:
    if name in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            from retrograd.errors import ConfigError
            raise ConfigError(f"model.device = {name!r} but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "auto" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


EAGER_ATTENTION_MAX_KEYS = 256


@contextmanager
def attention_for_length(model, longest: int):
    """Within: eager attention instead of SDPA for a bf16 model on CPU whose sequences are at most
    EAGER_ATTENTION_MAX_KEYS long. There SDPA's flash kernel is the slow one (forward + backward,
    9 heads: 2.4-3.4x slower at 47-79 keys, equal at 256, 1.7x faster at 512; float32 does not gain),
    and eager's [B, H, S, S] probabilities are still small. Same values either way. A Llama's scoring
    passes run packed either way (models/packed.py), whose matmul attention is the eager form and is
    used for bf16 on a CPU up to 512 keys whatever this says; this switch matters for the models that
    run transformers' own forward."""
    cfg = getattr(model, "config", None)
    param = next(model.parameters())
    if (cfg is None or param.device.type != "cpu" or param.dtype != torch.bfloat16
            or longest > EAGER_ATTENTION_MAX_KEYS or getattr(cfg, "_attn_implementation", None) != "sdpa"):
        yield
        return
    cfg._attn_implementation = "eager"
    try:
        yield
    finally:
        cfg._attn_implementation = "sdpa"


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def memory_metrics(device) -> dict:
    """The memory numbers every step logs: the process's peak RSS, and on CUDA the allocator's current
    and peak bytes (system/gpu_memory_allocated_mb, system/gpu_memory_peak_mb)."""
    out = {"system/peak_rss_mb": peak_rss_mb()}
    if getattr(device, "type", None) == "cuda":
        out["system/gpu_memory_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
        out["system/gpu_memory_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


# ---- bf16 on CPU ---------------------------------------------------------------------------------
# Without AVX512-BF16 / AMX the bf16 kernels convert and compute in fp32 and come out several times
# slower than plain fp32 (GRPO measured 29.9 s per update in bf16 against 7.9 s in fp32 on a 2-core
# Intel Xeon); with them bf16 is the faster one (an AMD EPYC: 411 against 188 GFLOP/s).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict[str, str] | None:
    """The first processor's fields in /proc/cpuinfo ("vendor_id", "model name", "flags", ...), None where
    the file cannot be read (not Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in info.splitlines():
        if not line.strip():
            break  # the end of the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.lru_cache(maxsize=1)
def cpu_bf16_native() -> bool | None:
    """True when the CPU advertises native bf16 arithmetic, False when it does not, None when the
    flags cannot be read (not Linux)."""
    info = cpu_info()
    if info is None:
        return None
    return any(f in info.get("flags", "").split() for f in BF16_CPU_FLAGS)


@functools.lru_cache(maxsize=1)
def bf16_matmul_slowdown(n: int = 384, reps: int = 4) -> float:
    """How many times slower a bf16 matmul is than an fp32 one on this CPU (best of `reps`, ~50 ms)."""
    def best(dtype) -> float:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)
    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


def bf16_slow_here(device) -> bool:
    """bf16 is the slow path on this device: a CPU without native bf16 (unknown flags: measured)."""
    if getattr(device, "type", device) != "cpu":
        return False
    native = cpu_bf16_native()
    return (not native) if native is not None else bf16_matmul_slowdown() > 1.3


def auto_sampling_dtype(model_dtype: torch.dtype, device) -> torch.dtype | None:
    """sampling.dtype = "auto": the model's own precision (None), except a bf16 model on a CPU where
    bf16 is the slow path: its rollouts sample in float32."""
    return torch.float32 if model_dtype == torch.bfloat16 and bf16_slow_here(device) else None


def bf16_warning(device, what: str, value: str = "bfloat16") -> str | None:
    """A warning for a user who asked for bf16 (`what`: the key) where it is the slow path, with the
    slowdown measured here; None where bf16 is fine."""
    if not bf16_slow_here(device):
        return None
    return (f"warning: {what} = {value!r}, but this CPU has no native bf16 ({' / '.join(BF16_CPU_FLAGS)}): a bf16 "
            f"matmul measured {bf16_matmul_slowdown():.1f}x slower than float32 here. Use float32 on this machine "
            "(bf16 pays off on CPUs with those flags and on GPUs)")
