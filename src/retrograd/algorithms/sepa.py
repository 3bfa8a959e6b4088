"""SEPA's schedule: how strongly to pool execution-token uncertainty at each step (lambda in [0, 1]).

The pooling itself is a token transform (transforms.py, `gtpo_sepa*`, and the delight variants
use the same lambda); this module only decides lambda, as retrain's SEPAController does:

  linear  lambda = clip((step - delay_steps) / steps, 0, 1)  (0 when steps <= 0)
  auto    lambda = max(1 - min(var_ema / var_0 / 0.2, 1), linear): pooling grows as the variance
          of execution-token uncertainty falls below 20% of its warm-up level
  gate    lambda = 0 until one step's correct rate reaches correct_rate_gate; then open for good

The loop calls `lambda_for(step)` before a step's advantages and `observe(...)` once after them.
"""
from __future__ import annotations

import math

import torch

SCHEDULES = ("linear", "auto")


class SepaController:
    """Lambda per step, with the auto schedule's variance EMA and the sticky correctness gate.

    The auto schedule takes ONE variance observation per step: the population variance of all the
    step's execution-token uncertainties together. Its warm-up (`warmup`, 50) therefore counts
    steps. This is intended and differs from retrain, whose trainer feeds one observation per
    completion, so its "warm-up of 50 steps" is really 50 sequences (less than one default step).
    """

    def __init__(self, steps: int = 500, schedule: str = "linear", delay_steps: int = 50,
                 correct_rate_gate: float = 0.1, *, ema_decay: float = 0.99, var_threshold: float = 0.2,
                 warmup: int = 50, eps: float = 1e-8):
        if steps < 0 or delay_steps < 0:
            raise ValueError(f"sepa steps ({steps}) and delay_steps ({delay_steps}) must be >= 0")
        if schedule not in SCHEDULES:
            raise ValueError(f"sepa schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not 0.0 <= correct_rate_gate <= 1.0:
            raise ValueError(f"sepa correct_rate_gate must be in [0, 1], got {correct_rate_gate}")
        if not 0.0 <= ema_decay <= 1.0 or var_threshold <= 0 or warmup < 1 or eps <= 0:
            raise ValueError("sepa needs ema_decay in [0, 1], var_threshold > 0, warmup >= 1, eps > 0")
        self.steps, self.schedule, self.delay_steps = steps, schedule, delay_steps
        self.correct_rate_gate = correct_rate_gate
        self.ema_decay, self.var_threshold, self.warmup, self.eps = ema_decay, var_threshold, warmup, eps
        self.var_ema: float | None = None
        self.var_0: float | None = None  # the variance level after warm-up, the reference for "auto"
        self.warmup_seen = 0
        self.gate_open = correct_rate_gate <= 0.0

    def _linear(self, step: float) -> float:
        if self.steps <= 0 or step - self.delay_steps <= 0:
            return 0.0
        return min((step - self.delay_steps) / self.steps, 1.0)

    def _auto(self) -> float:
        if self.schedule != "auto" or self.var_ema is None or self.var_0 is None:
            return 0.0
        ratio = max(0.0, self.var_ema / max(self.var_0, self.eps))
        return 1.0 - min(ratio / max(self.var_threshold, self.eps), 1.0)

    def lambda_for(self, step: int) -> float:
        """Lambda for 0-based `step`; 0 while the correctness gate is closed."""
        if not self.gate_open:
            return 0.0
        linear = self._linear(float(step))
        return max(self._auto(), linear) if self.schedule == "auto" else linear

    def observe(self, exec_uncertainties, correct_rate: float | None) -> None:
        """After a step's advantages: feed the step's execution-token uncertainties (one flat list
        or tensor, e.g. `execution_surprisals(...)`) to the auto schedule, and the step's correct
        rate to the gate (it takes effect from the next step)."""
        if (not self.gate_open and correct_rate is not None and math.isfinite(correct_rate)
                and correct_rate >= self.correct_rate_gate):
            self.gate_open = True
        if self.schedule != "auto":
            return
        values = torch.as_tensor(exec_uncertainties, dtype=torch.float64).reshape(-1)
        # one bad value (inf from a -inf log-prob) must not poison the EMA: drop it, as retrain does
        values = values[torch.isfinite(values) & (values >= 0)]
        if values.numel() == 0:
            return
        var = float(((values - values.mean()) ** 2).mean())
        if not math.isfinite(var):
            return
        self.var_ema = var if self.var_ema is None else self.ema_decay * self.var_ema + (1 - self.ema_decay) * var
        if self.var_0 is None:
            self.warmup_seen += 1
            if self.warmup_seen >= self.warmup:
                self.var_0 = max(self.var_ema, self.eps)

    def state_dict(self) -> dict:
        """JSON-serialisable: the settings (for a check on resume) and the running state."""
        return {"steps": self.steps, "schedule": self.schedule, "delay_steps": self.delay_steps,
                "correct_rate_gate": self.correct_rate_gate, "ema_decay": self.ema_decay,
                "var_threshold": self.var_threshold, "warmup": self.warmup, "eps": self.eps,
                "var_ema": self.var_ema, "var_0": self.var_0, "warmup_seen": self.warmup_seen,
                "gate_open": self.gate_open}

    def load_state_dict(self, state: dict) -> None:
        """Restore the running state; the settings stay those of the current config."""
        for key in ("var_ema", "var_0"):
            value = state.get(key)
            if value is not None and not math.isfinite(float(value)):
                raise ValueError(f"SEPA state {key!r} must be finite or null, got {value!r}")
        self.var_ema = None if state.get("var_ema") is None else float(state["var_ema"])
        self.var_0 = None if state.get("var_0") is None else float(state["var_0"])
        self.warmup_seen = int(state.get("warmup_seen", 0))
        if self.warmup_seen < 0:
            raise ValueError(f"SEPA state 'warmup_seen' must be >= 0, got {self.warmup_seen}")
        gate = state.get("gate_open", self.gate_open)
        if not isinstance(gate, bool):
            raise ValueError(f"SEPA state 'gate_open' must be true or false, got {gate!r}")
        self.gate_open = gate


def execution_surprisals(logprobs: torch.Tensor, mask: torch.Tensor,
                         planning: torch.Tensor | None = None) -> torch.Tensor:
    """-log p of the sampled execution tokens (sampled and not planning), flat [n] float64: what
    retrain feeds the auto schedule (unclipped; observe() drops non-finite values)."""
    keep = mask.bool() if planning is None else mask.bool() & ~planning.bool()
    return -logprobs.double()[keep]
