"""RL policy losses, one implementation each, picked by name: GRPO training and the Tinker service
(algorithms/tinker_losses.py) both call `POLICY_LOSSES`. Also the k3 KL term and `aggregate`, the
three normalisations. Not here: advantages, off-policy correction weights (off_policy.py), the loop.

Every loss is `fn(logp, old_logp, advantages, mask, params) -> (per_token [N, T], stats)`:
`logp` [N, T] with gradient, `old_logp` [N, T] detached, `advantages` [N, T] (an [N] is broadcast),
`mask` [N, T] 1 on trained tokens. `per_token` is neither masked nor normalised: the caller multiplies
by the mask (and any importance weights) and calls `aggregate`. Outside the mask the log-ratio is
taken as 0, so padding never overflows. `stats` are detached scalars over the mask: clip_fraction,
ratio_mean / max / min, tokens, plus the loss's own. `params` holds COMMON_DEFAULTS (clip_low /
clip_high: offsets from 1, Clip-Higher; clip_ratio_c: dual-clip, 0 = off) and the loss's defaults;
`resolve(name, params, common=...)` builds it (and imports a user's `module:function`).

Notation: d = lp - old, r = exp(d), sg = detach, M = mask, L_i = valid tokens of sequence i,
clip(r) = clamp(r, 1 - clip_low, 1 + clip_high), c = clip_ratio_c.

  clip (ppo, vanilla)  -min(rA, clip(r)A); if A < 0 and c > 1: min(that, -A c)     (verl vanilla)
  gspo                 the clip (no dual clip) on s_t = sg[s] exp(lp - sg[lp]),
                       s = exp(sum_M(d) / L_i)  (GSPO-token: token advantages work; verl, Tinker)
  cispo                -sg[clip(r)] A lp: verl's two-sided weight. TRL's is upper-only, min(r, cap)
                       with cap = epsilon_high: set clip_low = 1.0, clip_high = cap - 1. Tinker's
                       absolute [lo, hi] are clip_low = 1 - lo, clip_high = hi - 1.
  sapo                 -A sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos if A > 0 else tau_neg
  gmpo (geo_mean)      d' = sgn(A) min(sgn(A) d, sgn(A) clamp(d, -clip_low, clip_high)) (verl reads
                       the clip offsets as log-ratio bounds); per sequence -mean_M(A) exp(mean_M(d')).
                       A per-sequence objective: its value is put on EVERY valid token of the
                       sequence, so aggregate(.., "sequence") is verl's plain mean over sequences.
  kl_cov               -A r; the top k = max(1, floor(kl_cov_ratio * N_valid)) valid tokens by
                       Cov_t = (A_t - mean A)(lp_t - mean lp) add kl_cov_coef |d|
  clip_cov             the clip (no dual clip); among valid unclipped tokens with lb < Cov_t < ub,
                       k = max(1, floor(clip_cov_ratio * N_valid)) picked at random (seeded) get 0
  importance_sampling  -r A                                                          (Tinker)
  dro                  -(lp A - beta/2 (lp - old)^2)                                 (Tinker)

  k3 KL                exp(ref - lp) - (ref - lp) - 1
  aggregate            token     sum(M l) / sum(M)              (DAPO; TRL bnpo / verl token-mean)
                       constant  sum(M l) / (N max_new_tokens)  (Dr. GRPO)
                       sequence  mean_i(sum_t(M l) / L_i)       (GRPO; verl seq-mean-token-mean)
                       `denominator` replaces the divisor (the whole update's count when a batch is
                       split into passes; for "sequence", the number of sequences).

Conventions where TRL 1.16 / verl 0.9 / Tinker differ:
- Log-ratio clamps follow verl: d in [-20, 20] for clip, cispo, sapo; log s_t <= 10 for gspo; none
  for gmpo, kl_cov, clip_cov (verl's) nor importance_sampling (Tinker's).
- Defaults: clip 0.2 / 0.28 (DAPO's Clip-Higher; verl 0.2 / 0.2, TRL epsilon 0.2), c = 3.0 (verl);
  tau_pos / tau_neg 1.0 / 1.05 (both); kl_cov_ratio, clip_cov_* as verl's PolicyLossConfig;
  kl_cov_coef 0.1 is verl's config value (its ppo_kl_coef; verl's docstring and Cui et al.'s recipe
  say 1.0); dro beta 0.05 (Tinker's docs).
- The normalisation is the caller's choice; verl always aggregates gspo and sapo per sequence
  ("sequence" here), TRL uses whichever its loss_type implies.
- kl_cov and clip_cov take their covariance means, N_valid and k over the tensors passed in (one
  pass when an update is split, as verl does per micro-batch). clip_cov draws from its own
  torch.Generator seeded by `seed` (verl uses the global RNG).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from retrograd.algorithms.registry import PluginError, Registry, merged_params

POLICY_LOSSES = Registry("policy_loss",
                         "fn(logp, old_logp, advantages, mask, params) -> (per_token_loss [N, T], stats)")
COMMON_DEFAULTS = {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0}
NORMALISATIONS = ("token", "constant", "sequence")
LOG_RATIO_CLAMP = 20.0  # verl's: exp(20) ~ 5e8 is already no ratio a clip could use


def resolve(name: str, params: dict | None = None, *, common: dict | None = None,
            search_path: Path | str | None = None, where: str = "policy_loss") -> tuple[Callable, dict]:
    """(fn, params) for a configured loss: COMMON_DEFAULTS overlaid with `common`, plus the loss's
    own defaults overlaid with `params` (keys the loss does not read are refused)."""
    entry = POLICY_LOSSES.entry(name, search_path)
    unknown = sorted(set(common or {}) - set(COMMON_DEFAULTS))
    if unknown:
        raise PluginError(f"{where}: {unknown} are not common policy-loss settings ({', '.join(COMMON_DEFAULTS)})")
    return entry.fn, {**COMMON_DEFAULTS, **(common or {}), **merged_params(entry, params, where)}


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalisation: str, *, max_new_tokens: int | None = None,
              denominator: float | None = None) -> torch.Tensor:
    """Scalar loss from per-token losses [N, T], multiplied by the mask again (a no-op for a loss the
    caller already masked, a guard for one it did not)."""
    mask = mask.to(per_token.dtype)
    per_token = per_token * mask
    if normalisation == "token":
        return per_token.sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    if normalisation == "constant":
        if max_new_tokens is None:
            raise ValueError("normalisation 'constant' needs max_new_tokens")
        return per_token.sum() / (denominator if denominator is not None else mask.shape[0] * max_new_tokens)
    if normalisation == "sequence":
        per_seq = per_token.sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / (denominator if denominator is not None else mask.shape[0])
    raise ValueError(f"unknown normalisation {normalisation!r}; use one of {', '.join(NORMALISATIONS)}")


# ---- shared pieces ----------------------------------------------------------------------------

def _prepare(logp, advantages, mask):
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:  # one advantage per sequence
        adv = adv[:, None].expand_as(logp)
    return adv, mask


def _log_ratio(logp, old_logp, mask, clamp: float | None = LOG_RATIO_CLAMP):
    """d = lp - old on trained tokens, 0 elsewhere (a where, not a product: padding may hold anything)."""
    d = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))  # [N, T]
    return d.clamp(-clamp, clamp) if clamp is not None else d


def _surrogate(ratio, adv, low, high):
    """PPO's pessimistic clipped surrogate, per token (-min(rA, clip(r)A) = max(-rA, -clip(r)A))."""
    return -torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)


def _clip_active(ratio, adv, low, high):
    """Where the clipped side of the min is the one taken (and so carries no gradient)."""
    return ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - low) & (adv < 0))


def _covariance(adv, logp, mask):
    """Cov_t = (A_t - mean A)(lp_t - mean lp), means over the valid tokens of the whole batch."""
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        lp = torch.where(mask > 0, logp, torch.zeros_like(logp))
        return (adv - (adv * mask).sum() / n) * (lp - (lp * mask).sum() / n)  # [N, T]


def _stats(ratio, mask, clipped=None, **extra) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        r = ratio.detach()
        frac = (clipped.to(mask.dtype) * mask).sum() / n if clipped is not None else torch.zeros_like(n)
        out = {"clip_fraction": frac,
               "ratio_mean": (r * mask).sum() / n,
               "ratio_max": r.masked_fill(mask == 0, float("-inf")).max(),
               "ratio_min": r.masked_fill(mask == 0, float("inf")).min(),
               "tokens": mask.sum()}
        out.update({k: v.detach() for k, v in extra.items()})
    return out


def _fraction(flags, mask):
    return (flags.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)


def _ratio_param(params, key):
    v = float(params[key])
    if not 0 < v <= 1:
        raise ValueError(f"{key} must be in (0, 1], got {v}")
    return v


# ---- the losses -------------------------------------------------------------------------------

@POLICY_LOSSES.register("clip", aliases=("ppo", "vanilla"),
                        help="PPO / DAPO clipped surrogate on token ratios, dual-clip for A < 0 (clip_ratio_c)")
def clip(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    low, high, c = params["clip_low"], params["clip_high"], float(params["clip_ratio_c"])
    if c != 0 and c <= 1:
        raise ValueError(f"clip_ratio_c must be 0 (dual-clip off) or > 1, got {c}")
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))  # [N, T]
    per_token = _surrogate(ratio, adv, low, high)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if c:  # for A < 0 the surrogate grows without bound in r: cap it at -A c (Ye et al. 2020)
        dual = (adv < 0) & (per_token > -adv * c)
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * c), per_token)
    return per_token, _stats(ratio, mask, _clip_active(ratio, adv, low, high),
                             dual_clip_fraction=_fraction(dual, mask))


@POLICY_LOSSES.register("gspo", help="GSPO-token: the clip on the sequence ratio exp(mean log-ratio), no dual clip")
def gspo(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    low, high = params["clip_low"], params["clip_high"]
    n = mask.sum(1, keepdim=True).clamp(min=1)
    log_s = _log_ratio(logp.detach(), old_logp, mask, clamp=None).sum(1, keepdim=True) / n  # [N, 1]
    # value s on every token, gradient that of p_t / sg[p_t]; the clamp at 10 is verl's
    ratio = torch.exp((log_s + (logp - logp.detach())).clamp(max=10.0))  # [N, T]
    per_token = _surrogate(ratio, adv, low, high)
    return per_token, _stats(ratio, mask, _clip_active(ratio, adv, low, high))


@POLICY_LOSSES.register("cispo", help="CISPO: -sg[clip(r)] A lp, the clipped ratio as a detached weight")
def cispo(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))  # [N, T]
    weight = ratio.clamp(1 - params["clip_low"], 1 + params["clip_high"]).detach()
    # unlike PPO every token keeps its gradient, only its size is capped
    per_token = -weight * adv * logp
    return per_token, _stats(ratio, mask, ratio.detach() != weight)


@POLICY_LOSSES.register("sapo", defaults={"tau_pos": 1.0, "tau_neg": 1.05},
                        help="SAPO: soft sigmoid gate instead of a hard clip, tau_pos for A > 0, tau_neg otherwise")
def sapo(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))  # [N, T]
    tau = torch.where(adv > 0, torch.full_like(adv, params["tau_pos"]), torch.full_like(adv, params["tau_neg"]))
    # 4/tau makes the gate's slope 1 at r = 1: the plain policy gradient on-policy
    per_token = -adv * torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return per_token, _stats(ratio, mask)


@POLICY_LOSSES.register("gmpo", aliases=("geo_mean",),
                        help="GMPO (verl geo_mean): geometric mean of sign-aware clipped token ratios, per sequence")
def gmpo(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    d = _log_ratio(logp, old_logp, mask, clamp=None)  # [N, T]
    sgn = torch.sign(adv)
    d_clip = sgn * torch.minimum(sgn * d, sgn * d.clamp(-params["clip_low"], params["clip_high"]))
    n = mask.sum(1).clamp(min=1)  # [N]; verl adds 1e-8 instead (same for non-empty sequences)
    seq_ratio = torch.exp((d_clip * mask).sum(1) / n)  # [N]
    per_seq = -(adv * mask).sum(1) / n * seq_ratio  # [N]
    per_token = per_seq[:, None] * mask  # [N, T]: the sequence's value on each of its tokens
    with torch.no_grad():
        has = mask.sum(1) > 0
        seq_mean = seq_ratio[has].mean() if bool(has.any()) else logp.new_ones(())
    return per_token, _stats(torch.exp(d), mask, d_clip.detach() != d.detach(), seq_ratio_mean=seq_mean)


@POLICY_LOSSES.register("kl_cov", defaults={"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1},
                        help="KL-Cov: unclipped -A r, the top-covariance tokens add kl_cov_coef |lp - old|")
def kl_cov(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    frac, coef = _ratio_param(params, "kl_cov_ratio"), float(params["kl_cov_coef"])
    d = _log_ratio(logp, old_logp, mask, clamp=None)  # [N, T]
    ratio = torch.exp(d)
    valid = (mask > 0).reshape(-1)
    picked = torch.zeros_like(valid)
    n = int(valid.sum())
    if n:
        k = min(n, max(1, int(n * frac)))
        idx = valid.nonzero()[:, 0]  # flat positions of the valid tokens
        top = torch.topk(_covariance(adv, logp, mask).reshape(-1)[idx], k).indices
        picked[idx[top]] = True
    picked = picked.view_as(mask)
    # the tokens whose log-prob moves most with the advantage are held back towards the old policy
    per_token = torch.where(picked, -adv * ratio + coef * d.abs(), -adv * ratio)
    return per_token, _stats(ratio, mask, cov_fraction=_fraction(picked, mask))


@POLICY_LOSSES.register("clip_cov",
                        defaults={"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "seed": 0},
                        help="Clip-Cov: the clip (no dual clip); random tokens with lb < Cov < ub lose their gradient")
def clip_cov(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    frac, lb, ub = _ratio_param(params, "clip_cov_ratio"), float(params["clip_cov_lb"]), float(params["clip_cov_ub"])
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, clamp=None))  # [N, T]
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - params["clip_low"], 1 + params["clip_high"])
    valid = mask > 0
    clipped = (pg2 > pg1) & valid
    cov = _covariance(adv, logp, mask)
    eligible = (valid & ~clipped & (cov > lb) & (cov < ub)).reshape(-1)
    zeroed = torch.zeros_like(eligible)
    idx = eligible.nonzero()[:, 0]
    n = int(valid.sum())
    if n and idx.numel():
        k = min(idx.numel(), max(1, int(n * frac)))
        # a private generator: the same seed picks the same tokens (a resumed run repeats a step
        # exactly) and the global RNG stream is left alone; vary the seed per step for fresh picks
        gen = torch.Generator().manual_seed(int(params["seed"]))
        zeroed[idx[torch.randperm(idx.numel(), generator=gen)[:k].to(idx.device)]] = True
    zeroed = zeroed.view_as(mask)
    per_token = torch.where(zeroed, torch.zeros_like(pg1), torch.maximum(pg1, pg2))
    return per_token, _stats(ratio, mask, clipped, cov_fraction=_fraction(zeroed, mask))


@POLICY_LOSSES.register("importance_sampling", help="Tinker's importance_sampling: -r A, no clip")
def importance_sampling(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, clamp=None))  # [N, T]
    return -ratio * adv, _stats(ratio, mask)


@POLICY_LOSSES.register("dro", defaults={"beta": 0.05},
                        help="Tinker's dro: -(lp A - beta/2 (lp - old)^2), a quadratic pull towards the old policy")
def dro(logp, old_logp, advantages, mask, params):
    adv, mask = _prepare(logp, advantages, mask)
    per_token = -(logp * adv - 0.5 * params["beta"] * (logp - old_logp) ** 2)  # [N, T]
    ratio = torch.exp(_log_ratio(logp.detach(), old_logp, mask, clamp=None))
    return per_token, _stats(ratio, mask)

