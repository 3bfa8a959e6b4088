"""Device-specific choices, in one place: torch threads, which device a run uses, the attention
kernel for short bf16 passes on CPU, and memory readings. Loops, the sampler and the service ask
here instead of testing the device themselves."""
from __future__ import annotations

import resource
import sys
from contextlib import contextmanager

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
    and eager's [B, H, S, S] probabilities are still small. Same values either way."""
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
