"""Back pressure ([backpressure], opt-in): choose GRPO's prompts per update from a Universal Scalability
Law fit of measured throughput against concurrency (retrain's USLBackPressure, its documented maths).

Each update is one observation: concurrency p = prompts x group size (completions in flight) and
throughput X = trained tokens / step seconds (smoothed: X̄ <- decay X̄ + (1 - decay) X). Over a sliding
window the linearised USL, p / X = A + B p + C p², is fitted by least squares (once three distinct p
are seen); since X(p) = λ p / (1 + σ (p - 1) + κ p (p - 1)):

  λ = 1 / (A + B + C),  σ = clip((B + C) / (A + B + C), 0, 1),  κ = max(0, C / (A + B + C)),
  p* = sqrt((1 - σ) / κ)   (the concurrency of peak throughput; unbounded when κ = 0)

Decision per update, after `warmup_steps` updates that sweep the batch sizes 1, 2, 4, ... max:
  target p_t = clip(throttle_margin x p*, min, max concurrency); "throttle" when p > p_t (past the
  peak, more concurrency lowers throughput: the retrograde regime); "increase" when p < increase_margin
  x p_t; else "hold". New prompts per update = clip(floor(p_t / group size), min, max batch size).

Limits, stated: the fit needs throughput to depend on concurrency alone, which the length of the
completions also moves (longer answers, lower tokens/s at any p); the smoothing and the window damp
this but do not remove it. On a CPU the peak is usually the largest batch that fits in memory, so the
controller mostly holds max_batch_size. retrain's extra regime test against peak GFLOP/s compares a
unitless curve with FLOP/s and is left out. The batch sizes depend on measured times, so two runs of
one config are no longer identical; a resumed run continues the controller from its saved state (its
window, smoothed throughput and batch size are in the checkpoint).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


KAPPA_ZERO = 1e-9


@dataclass
class UslFit:
    lam: float
    sigma: float
    kappa: float
    p_star: float


def fit_usl(points: list[tuple[float, float]]) -> UslFit | None:
    """Least squares of p / X = A + B p + C p² over (p, X) points; None with fewer than 3 distinct p or
    a singular system."""
    pts = [(p, x) for p, x in points if p > 0 and x > 0 and math.isfinite(x)]
    if len({p for p, _ in pts}) < 3:
        return None
    s = [sum(p ** k for p, _ in pts) for k in range(5)]  # Σ p^0 .. Σ p^4
    t = [sum(p ** k * (p / x) for p, x in pts) for k in range(3)]  # Σ p^k y
    m = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]

    def det(a):
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))
    d = det(m)
    if abs(d) < 1e-12 * max(1.0, abs(s[4]) ** 1.5):
        return None
    coef = []
    for col in range(3):  # Cramer's rule
        mc = [row[:] for row in m]
        for r in range(3):
            mc[r][col] = t[r]
        coef.append(det(mc) / d)
    a, b, c = coef
    total = a + b + c
    if total <= 0:
        return None
    sigma = min(1.0, max(0.0, (b + c) / total))
    kappa = c / total if c / total > KAPPA_ZERO else 0.0  # rounding noise of a linear curve is not a peak
    p_star = math.sqrt((1 - sigma) / kappa) if kappa > 0 and sigma < 1 else math.inf
    return UslFit(1.0 / total, sigma, kappa, p_star)


@dataclass
class BackPressure:
    group_size: int
    warmup_steps: int = 10
    ema_decay: float = 0.9
    throttle_margin: float = 0.85
    increase_margin: float = 0.5
    min_batch_size: int = 1
    max_batch_size: int = 64
    window: int = 100
    points: list = field(default_factory=list)
    ema: float | None = None
    batch_size: int = 1
    step: int = 0

    def warmup_size(self, step: int) -> int:
        """1, 2, 4, ... max_batch_size, cycled over the warm-up updates."""
        sizes, k = [], self.min_batch_size
        while k < self.max_batch_size:
            sizes.append(k)
            k *= 2
        sizes.append(self.max_batch_size)
        return sizes[step % len(sizes)]

    def next_batch_size(self) -> int:
        return self.warmup_size(self.step) if self.step < self.warmup_steps else self.batch_size

    def observe(self, batch_size: int, tokens: float, seconds: float) -> dict:
        """Record one update; returns the backpressure/ metrics and sets the next batch size."""
        p = batch_size * self.group_size
        x = tokens / seconds if seconds > 0 else 0.0
        self.ema = x if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * x
        self.points = (self.points + [(p, self.ema)])[-self.window:]
        self.step += 1
        fit = fit_usl(self.points)
        m = {"backpressure/concurrency": p, "backpressure/throughput": self.ema, "backpressure/batch_size": batch_size}
        action = "warmup"
        if fit is not None:
            lo, hi = self.min_batch_size * self.group_size, self.max_batch_size * self.group_size
            target = min(hi, max(lo, self.throttle_margin * fit.p_star)) if math.isfinite(fit.p_star) else hi
            if self.step >= self.warmup_steps:
                action = "throttle" if p > target else "increase" if p < self.increase_margin * target else "hold"
            self.batch_size = int(min(self.max_batch_size, max(self.min_batch_size, target // self.group_size)))
            m.update({"backpressure/p_star": fit.p_star if math.isfinite(fit.p_star) else -1.0,
                      "backpressure/sigma": fit.sigma, "backpressure/kappa": fit.kappa,
                      "backpressure/lambda": fit.lam,
                      "backpressure/utilization": self.ema / (fit.lam * _usl(fit, min(target, hi)))})
        else:
            self.batch_size = max(self.batch_size, batch_size)
        m["backpressure/action"] = {"warmup": 0, "hold": 1, "increase": 2, "throttle": 3}[action]
        m["backpressure/fitted"] = float(fit is not None)  # 0: too few or too noisy points for a USL curve yet
        return m

    def state_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "ema": self.ema, "batch_size": self.batch_size,
                "step": self.step}

    def load_state_dict(self, d: dict) -> None:
        if d:
            self.points = [tuple(p) for p in d.get("points", [])]
            self.ema, self.batch_size, self.step = d.get("ema"), d.get("batch_size", 1), d.get("step", 0)


def _usl(fit: UslFit, p: float) -> float:
    """X(p) / λ: the throughput curve without its scale."""
    return p / (1 + fit.sigma * (p - 1) + fit.kappa * p * (p - 1))


def backpressure_from_config(table, group_size: int) -> BackPressure | None:
    """The controller of a [backpressure] table, or None when absent or not enabled."""
    if table is None or not table.enabled:
        return None
    return BackPressure(group_size, table.warmup_steps, table.ema_decay, table.throttle_margin, table.increase_margin,
                        table.min_batch_size, table.max_batch_size, batch_size=table.max_batch_size)
