"""The Tinker API's built-in losses, as pure functions of one datum's tensors.

Every loss is a SUM over the datum's tokens (Tinker has no mean: callers normalise through
`weights` or the advantages). Notation: `lp` = the learner's log-probability of each target token
(with gradient), `q` = `loss_fn_inputs["logprobs"]` (the sampler's), `A` = advantages,
`r = exp(lp - q)`.

  cross_entropy        -(lp * weights).sum()             targets [N] or [N, K] (soft targets)
  importance_sampling  -(r * A).sum()
  ppo                  -min(r A, clip(r, lo, hi) A).sum()           lo/hi are ratio bounds (0.8 / 1.2)
  cispo                -(sg(clip(r, lo, hi)) * lp * A).sum()         (0.0 / 4.0)
  dro                  -(lp A - beta/2 (lp - q)^2).sum()             beta (0.05)
  gspo                 PPO's min/clip on r_t = sg(s) exp(lp - sg(lp)), s = exp(mean_M(sg(lp) - q)),
                       M = sequence_ratio_mask (all tokens when absent)
"""
from __future__ import annotations

import torch

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
# loss -> the loss_fn_inputs it needs besides target_tokens
REQUIRED_INPUTS = {
    "cross_entropy": (), "importance_sampling": ("logprobs", "advantages"), "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"), "dro": ("logprobs", "advantages"), "gspo": ("logprobs", "advantages"),
}
# loss -> loss_fn_config keys it reads, with defaults
CONFIG_DEFAULTS = {
    "cross_entropy": {}, "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


class LossInputError(ValueError):
    """A loss was called with inputs it cannot use (a client error, reported as such)."""


def resolve_config(loss_fn: str, config: dict | None) -> dict:
    if loss_fn not in LOSSES:
        raise LossInputError(f"loss_fn {loss_fn!r} is not supported here; use one of {', '.join(LOSSES)} "
                             "(or forward_backward_custom)")
    defaults = CONFIG_DEFAULTS[loss_fn]
    unknown = sorted(set(config or {}) - set(defaults))
    if unknown:
        raise LossInputError(f"loss_fn_config keys {unknown} are not read by {loss_fn}"
                             + (f" (it reads {', '.join(defaults)})" if defaults else " (it takes none)"))
    out = dict(defaults)
    for k, v in (config or {}).items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            raise LossInputError(f"loss_fn_config.{k} must be a number, got {v!r}") from None
    return out


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The summed loss of one datum. `lp`: [N] (or [N, K] for soft cross-entropy targets)."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        if weights is None:
            weights = torch.ones_like(lp)
        return -(lp * weights.to(lp.dtype)).sum()
    q, adv = inputs["logprobs"].to(lp.dtype), inputs["advantages"].to(lp.dtype)
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum()
    if loss_fn == "gspo":
        mask = inputs.get("sequence_ratio_mask")
        mask = torch.ones_like(lp) if mask is None else mask.to(lp.dtype)
        log_s = ((lp.detach() - q) * mask).sum() / mask.sum().clamp(min=1.0)
        ratio = torch.exp(log_s) * torch.exp(lp - lp.detach())
    else:
        ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    if loss_fn == "cispo":
        return -(ratio.clamp(lo, hi).detach() * lp * adv).sum()
    return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv).sum()  # ppo, gspo
