"""Importance weights for rollouts sampled by another engine or an older policy (truncated / masked
importance sampling, as TRL 1.16's vLLM correction). Owns the weights only: the caller multiplies
each token's policy loss by them, outside the loss's min/clip (algorithms/policy_losses.py).

Convention: `behaviour_logp` (q) are the log-probabilities of the distribution the tokens were
actually drawn from, temperature and top-p / top-k applied. `old_logp` are the trainer's (T = 1,
full vocabulary). So sampling at T != 1 gives rho != 1 even fully on-policy; that is the correction
working, not a bug (pass `mode="none"` to train on the tempered samples as if they were the policy's).

  delta_t     (old_t - q_t) * M_t, NaN -> 0 (tokens the engine could not score get no correction),
              clamped to [-20, 20]
  token_*     rho_t = exp(delta_t)
  sequence_*  rho_i = exp(sum_t delta_t) on every token of sequence i: the product of the token
              ratios, as TRL (not the geometric mean), its exponent clamped to [-20, 20] too.
              It grows with length, so long completions reach clip_max sooner (trl#4772).
  *_truncate  w = clamp(rho, clip_min or 0, clip_max)                      (TIS)
  *_mask      w = rho inside [clip_min or 0, clip_max], 0 outside          (MIS / IcePop)
  none        w = 1

Weights are detached and 1 outside the mask. TRL's defaults: mode sequence_mask, clip_max 3.0,
clip_min None. Stats: the raw ratios (per token, or per sequence for sequence_*) before truncation
or masking (is_ratio_mean / max / min), the mean applied weight per token (is_weight_mean), and the
fraction of trained tokens masked (is_masked_fraction) or truncated (is_truncated_fraction).
"""
from __future__ import annotations

import torch

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DEFAULT_MODE = "sequence_mask"
DEFAULT_CLIP_MAX = 3.0
LOG_CLAMP = 20.0


def importance_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_max: float, clip_min: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(weights [N, T] detached, stats) correcting from the behaviour policy q to the old policy."""
    if mode not in MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; use one of {', '.join(MODES)}")
    lo = 0.0 if clip_min is None else float(clip_min)
    if not 0 <= lo <= clip_max:
        raise ValueError(f"need 0 <= clip_min <= clip_max, got clip_min={clip_min}, clip_max={clip_max}")
    with torch.no_grad():
        mask = mask.to(old_logp.dtype)
        valid = mask > 0
        delta = torch.where(valid, old_logp - behaviour_logp.to(old_logp.dtype), torch.zeros_like(old_logp))
        delta = delta.nan_to_num(nan=0.0).clamp(-LOG_CLAMP, LOG_CLAMP)  # [N, T]
        if mode.startswith("sequence"):
            seq = torch.exp(delta.sum(1).clamp(-LOG_CLAMP, LOG_CLAMP))  # [N]
            rho = seq[:, None].expand_as(delta)  # [N, T]
            raw = seq[mask.sum(1) > 0]  # one ratio per non-empty sequence
        else:
            rho = torch.exp(delta)  # [N, T]
            raw = rho[valid]
        outside = (rho < lo) | (rho > clip_max)
        if mode == "none":
            weights = torch.ones_like(rho)
        elif mode.endswith("truncate"):
            weights = rho.clamp(lo, clip_max)
        else:
            weights = torch.where(outside, torch.zeros_like(rho), rho)
        weights = torch.where(valid, weights, torch.ones_like(weights))
        n = mask.sum().clamp(min=1)
        hit = (outside & valid).to(mask.dtype).sum() / n if mode != "none" else torch.zeros_like(n)
        empty = raw.numel() == 0
        stats = {"is_ratio_mean": raw.mean() if not empty else torch.ones_like(n),
                 "is_ratio_max": raw.max() if not empty else torch.ones_like(n),
                 "is_ratio_min": raw.min() if not empty else torch.ones_like(n),
                 "is_weight_mean": (weights * mask).sum() / n,
                 "is_masked_fraction": hit if mode.endswith("mask") else torch.zeros_like(n),
                 "is_truncated_fraction": hit if mode.endswith("truncate") else torch.zeros_like(n)}
    return weights, stats
