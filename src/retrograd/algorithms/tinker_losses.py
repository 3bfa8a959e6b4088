"""The Tinker API's built-in losses, as pure functions of one datum's tensors: names, required inputs,
config validation and Tinker's conventions. The policy losses themselves are computed by the shared
registry (algorithms/policy_losses.py), so training and the service run one implementation.

Every loss is a SUM over the datum's tokens (Tinker has no mean and no mask: callers normalise through
`weights` or the advantages). Notation: `lp` = the learner's log-probability of each target token
(with gradient), `q` = `loss_fn_inputs["logprobs"]` (the sampler's), `A` = advantages,
`r = exp(lp - q)`.

  cross_entropy        -(lp * weights).sum()             targets [N] or [N, K] (soft targets)
  importance_sampling  -(r * A).sum()                                 POLICY_LOSSES importance_sampling
  ppo                  -min(r A, clip(r, lo, hi) A).sum()             clip, clip_low = 1 - lo,
                       lo/hi are ratio bounds (0.8 / 1.2)             clip_high = hi - 1, no dual clip
  cispo                -(sg(clip(r, lo, hi)) * lp * A).sum()  (0.0 / 4.0)    cispo, bounds likewise
  dro                  -(lp A - beta/2 (lp - q)^2).sum()      beta (0.05)    dro
  gspo                 PPO's min/clip on r_t = sg(s) exp(lp - sg(lp)), s = exp(mean_M(sg(lp) - q)),
                       M = sequence_ratio_mask (all tokens when absent)      gspo, mask = M
  stable_reinforce     -(sg(min(r, c)) * lp * A).sum() + kl_coeff/2 (lp - q)^2  (c = clip_high_threshold 2.0,
                       kl_coeff 0): truncated importance-sampling REINFORCE, q being the log-probs the server
                       recorded when it sampled the tokens (record_stability_info), never the client's.
                       Tinker has not published its formula; this is retrograd's, stated here.
"""
from __future__ import annotations

import torch

from retrograd.algorithms.policy_losses import COMMON_DEFAULTS, POLICY_LOSSES

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
# loss -> the loss_fn_inputs it needs besides target_tokens
REQUIRED_INPUTS = {
    "cross_entropy": (), "importance_sampling": ("logprobs", "advantages"), "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"), "dro": ("logprobs", "advantages"), "gspo": ("logprobs", "advantages"),
    "stable_reinforce": ("advantages",),  # q comes from the server's records, through provenance spans
}
# loss -> loss_fn_config keys it reads, with defaults
CONFIG_DEFAULTS = {
    "cross_entropy": {}, "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "stable_reinforce": {"clip_high_threshold": 2.0, "kl_coeff": 0.0},
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


# Tinker's policy losses -> the shared registry's names
REGISTRY_NAMES = {"importance_sampling": "importance_sampling", "ppo": "clip", "cispo": "cispo", "dro": "dro",
                  "gspo": "gspo", "stable_reinforce": "cispo"}


def registry_params(loss_fn: str, config: dict) -> dict:
    """Tinker's absolute ratio bounds [lo, hi] as the registry's offsets from 1; Tinker's ppo has no
    dual clip."""
    params = {**COMMON_DEFAULTS, "clip_ratio_c": 0.0}
    if loss_fn == "stable_reinforce":  # truncation only: the weight is min(r, c), never raised from below
        params["clip_low"], params["clip_high"] = 1.0, config["clip_high_threshold"] - 1.0
    elif "clip_low_threshold" in config:
        params["clip_low"] = 1.0 - config["clip_low_threshold"]
        params["clip_high"] = config["clip_high_threshold"] - 1.0
    if loss_fn == "dro":
        params["beta"] = config["beta"]
    return params


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The summed loss of one datum. `lp`: [N] (or [N, K] for soft cross-entropy targets)."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        if weights is None:
            weights = torch.ones_like(lp)
        return -(lp * weights.to(lp.dtype)).sum()
    q, adv = inputs["logprobs"].to(lp.dtype), inputs["advantages"].to(lp.dtype)
    if loss_fn == "stable_reinforce":  # positions with no recorded sample (prompt runs): ratio 1
        q = torch.where(torch.isnan(q), lp.detach(), q)
    # only gspo reads a mask (for its sequence ratio); Tinker sums every position whatever the mask
    mask = inputs.get("sequence_ratio_mask") if loss_fn == "gspo" else None
    mask = torch.ones_like(lp) if mask is None else mask.to(lp.dtype)
    fn = POLICY_LOSSES.get(REGISTRY_NAMES[loss_fn])
    per_token, _ = fn(lp[None], q[None], adv[None], mask[None], registry_params(loss_fn, config))  # [1, N]
    if loss_fn == "stable_reinforce" and config["kl_coeff"]:
        per_token = per_token + 0.5 * config["kl_coeff"] * (lp - q)[None] ** 2
    return per_token.sum()
