"""Learning-rate schedules as pure functions of the step, so resuming needs only the step."""
from __future__ import annotations

import math


def lr_at(step: int, total_steps: int, peak_lr: float, kind: str, warmup_steps: int) -> float:
    """LR for optimizer step `step` (0-based: the update that produces step `step + 1`).

    Linear warm-up from 0 over `warmup_steps` (the first update already gets peak/warmup), then
    constant, or linear / cosine decay reaching 0 after the last step, as in HF's schedulers.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return peak_lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "linear":
        return peak_lr * (1.0 - progress)
    if kind == "cosine":
        return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler {kind!r}")
