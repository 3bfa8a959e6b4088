"""Token-level transforms: spread each completion's episode advantage over its tokens.

Owns the `UNCERTAINTY` registry (`uncertainty_kind`: how uncertain the sampler was at a token),
the `TOKEN_TRANSFORMS` registry (`transform_mode`) and the defaults of the config sub-tables the
transforms read (`TABLE_DEFAULTS`, `[grpo.gtpo]` etc.). Follows teilomillet/retrain
(advantages/credit.py, pipeline.py); the delight gates live in delight.py, the SEPA schedule in
sepa.py, the planning detectors in planning.py. Shapes: N completions, T positions.

Order inside the GTPO family, per completion:
  u (uncertainty, <= 50) -> SEPA on u (gtpo_sepa*) -> GTPO weights -> HICRA -> entropy mask
  GTPO     w_t = max(0, 1 + beta (u_t / (mean_t u + 1e-8) - 1)); a_t = A w_t
           (a_t = A when beta = 0 or mean u < 1e-7)
  SEPA     execution tokens (not planning) pulled toward their mean mu: lam mu + (1 - lam) u
           (pool), or pushed away: (1 + lam) u - lam mu (amp; amp_c floors it at 0)
  HICRA    a_t + alpha |a_t| on planning tokens (signs kept)
  mask     per group, keep the tokens whose raw u is in the top rho fraction (rho <= 0: off)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from retrograd.algorithms.advantages import average_metrics, group_slices, signal_slices
from retrograd.algorithms.delight import (MAX_SURPRISAL, delight_advantages, hard_delight_advantages,
                                          surprisals)
from retrograd.algorithms.registry import PluginError, Registry

TABLE_DEFAULTS: dict[str, dict] = {
    "gtpo": {"beta": 0.1},
    "hicra": {"alpha": 0.2},
    "planning": {"detector": "regex", "strategic_grams": [], "model": "all-MiniLM-L6-v2", "threshold": 0.02},
    "sepa": {"steps": 500, "schedule": "linear", "delay_steps": 50, "correct_rate_gate": 0.1},
    "delight": {"eta": 1.0, "eta_mode": "fixed", "norm_mode": None, "lambda": None, "k_frac": 0.2,
                "eta_min": 0.05, "eta_max": 5.0, "eta_target_neutral_frac": 0.5,
                "eta_target_ordering_gap": None, "eta_ema_decay": None},
    "entropy_mask": {"rho": 0.0},
}

TABLE_HELP: dict[str, dict[str, str]] = {
    "gtpo": {"beta": "strength of the uncertainty weighting; 0 gives every token the episode advantage"},
    "hicra": {"alpha": "planning tokens get a + alpha * |a|"},
    "planning": {
        "detector": "'regex' (strategic grams) or 'semantic' (sentence-transformers windows)",
        "strategic_grams": "phrases that mark planning tokens for the regex detector; [] = the 18 built-in ones",
        "model": "sentence-transformers model of the semantic detector",
        "threshold": "semantic: cosine margin by which a window must be closer to planning than to execution"},
    "sepa": {
        "steps": "steps over which the linear schedule ramps lambda from 0 to 1 (0: never)",
        "schedule": "'linear', or 'auto' (also follows the fall of execution-token uncertainty variance)",
        "delay_steps": "steps before the linear ramp starts",
        "correct_rate_gate": "lambda stays 0 until one step's correct rate reaches this (then stays open)"},
    "delight": {
        "eta": "gate temperature: gate = sigmoid(A * s / eta) (the fixed value, and the fallback of 'adaptive')",
        "eta_mode": "'fixed' or 'adaptive' (eta from each group's |A * s| quantile)",
        "norm_mode": "surprisal scaling per rollout: 'none', 'scale', 'mad_scale'; unset = the transform's "
                     "default (none for delight, scale for delight_sepa)",
        "lambda": "blend weight of the gate (delight_sepa, hard_delight); unset = the SEPA schedule's lambda",
        "k_frac": "hard_delight: fraction of each rollout's tokens kept",
        "eta_min": "adaptive: lower bound of eta",
        "eta_max": "adaptive: upper bound of eta",
        "eta_target_neutral_frac": "adaptive: quantile of |A * s| that lands on gate 0.6",
        "eta_target_ordering_gap": "adaptive: shrink eta while the mean high-vs-low gate gap is below this; unset = off",
        "eta_ema_decay": "adaptive: EMA weight of the previous step's eta, in [0, 1); unset = no smoothing"},
    "entropy_mask": {"rho": "fraction of each group's tokens (highest uncertainty) that keep their advantage; 0 = off"},
}


def fill_tables(names, given: dict | None) -> dict[str, dict]:
    """The named sub-tables with every key filled from TABLE_DEFAULTS; unknown keys refused."""
    given = given or {}
    out = {}
    for name in names:
        values = dict(given.get(name) or {})
        unknown = sorted(set(values) - set(TABLE_DEFAULTS[name]))
        if unknown:
            raise PluginError(f"[grpo.{name}]: unknown keys {unknown} (known: {', '.join(TABLE_DEFAULTS[name])})")
        out[name] = {**copy.deepcopy(TABLE_DEFAULTS[name]), **values}
    return out


@dataclass
class TokenContext:
    """What a token transform sees. Rows are completions, grouped contiguously by prompt."""
    advantages: torch.Tensor  # [N] float64, the episode advantage of each completion
    logprobs: torch.Tensor  # [N, T] the sampler's log p of the sampled tokens, 0 beyond the mask
    mask: torch.Tensor  # [N, T] bool, sampled tokens
    group: torch.Tensor  # [N] long, group index of each row
    planning: torch.Tensor | None = None  # [N, T] bool, planning tokens
    entropy: torch.Tensor | None = None  # [N, T] Shannon entropy of the sampling distribution
    sepa_lambda: float = 0.0
    step: int = 0


def check_context(ctx: TokenContext) -> None:
    """Shapes agree; raises ValueError saying which field is off."""
    if ctx.mask.dim() != 2 or ctx.logprobs.shape != ctx.mask.shape:
        raise ValueError(f"TokenContext: logprobs {tuple(ctx.logprobs.shape)} and mask {tuple(ctx.mask.shape)} "
                         "must both be [N, T]")
    n = ctx.mask.shape[0]
    for name in ("advantages", "group"):
        if tuple(getattr(ctx, name).shape) != (n,):
            raise ValueError(f"TokenContext.{name} must be [{n}], got {tuple(getattr(ctx, name).shape)}")
    for name in ("planning", "entropy"):
        value = getattr(ctx, name)
        if value is not None and value.shape != ctx.mask.shape:
            raise ValueError(f"TokenContext.{name} must be {tuple(ctx.mask.shape)}, got {tuple(value.shape)}")


# -- uncertainty ------------------------------------------------------------------------------

UNCERTAINTY = Registry("uncertainty_kind", "fn(ctx: TokenContext) -> u [N, T]")


@UNCERTAINTY.register("surprisal", help="-log p of the sampled token, capped at 50",
                      aliases=("token_surprisal", "neg_logprob", "negative_logprob", "nll"))
def surprisal(ctx: TokenContext) -> torch.Tensor:
    return (-ctx.logprobs.double()).clamp(max=MAX_SURPRISAL)


@UNCERTAINTY.register("predictive_variance", help="p (1 - p) of the sampled token (Bernoulli variance)",
                      aliases=("pred_var", "bernoulli_variance"))
def predictive_variance(ctx: TokenContext) -> torch.Tensor:
    p = torch.exp(ctx.logprobs.double().clamp(min=-MAX_SURPRISAL)).clamp(0.0, 1.0)
    return p * (1 - p)


@UNCERTAINTY.register("shannon_entropy", help="entropy of the whole sampling distribution, capped at 50",
                      aliases=("shannon", "entropy", "token_entropy"))
def shannon_entropy(ctx: TokenContext) -> torch.Tensor:
    if ctx.entropy is None:
        raise ValueError("uncertainty_kind 'shannon_entropy' needs the entropy of the sampling distribution at "
                         "each position (TokenContext.entropy is None): the sampler must compute entropies, "
                         "or use uncertainty_kind = 'surprisal'")
    return ctx.entropy.double().clamp(max=MAX_SURPRISAL)


def token_uncertainty(ctx: TokenContext, kind: str) -> torch.Tensor:
    """u [N, T] float64 from the named kind (built-in, alias or plugin), 0 outside the mask. A
    plugin is looked up without a search path: the pipeline has already imported it from the
    TOML's folder, so it is in sys.modules."""
    u = UNCERTAINTY.get(kind)(ctx)
    if not isinstance(u, torch.Tensor) or u.shape != ctx.mask.shape:
        got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"uncertainty_kind {kind!r} returned {got}, expected a tensor {tuple(ctx.mask.shape)}")
    return torch.where(ctx.mask, u.double(), torch.zeros((), dtype=torch.float64))


# -- building blocks ----------------------------------------------------------------------------

def split_stats(u: torch.Tensor, mask: torch.Tensor, planning: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Mean and population variance of u (capped at 50) over execution and planning tokens of the
    whole batch: {prefix}exec_surprisal_mean/var, {prefix}plan_surprisal_mean/var (retrain's
    names, kept whatever the uncertainty kind). 0 where a set is empty."""
    out = {}
    for name, sel in (("exec", mask & ~planning), ("plan", mask & planning)):
        values = u.clamp(max=MAX_SURPRISAL)[sel]
        empty = values.numel() == 0
        out[f"{prefix}{name}_surprisal_mean"] = 0.0 if empty else float(values.mean())
        out[f"{prefix}{name}_surprisal_var"] = 0.0 if empty else float(values.var(correction=0))
    return out


def gtpo_weights(u: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """GTPO's per-sequence token weights [N, T] (1 everywhere on a row when beta = 0 or its mean u
    is < 1e-7); they average to 1 on each row when none is clamped at 0."""
    if beta == 0:
        return mask.double()
    u = u.clamp(max=MAX_SURPRISAL)
    n = mask.sum(1)
    mean = (u * mask).sum(1) / n.clamp(min=1)  # [N]
    w = (1 + beta * (u / (mean + 1e-8)[:, None] - 1)).clamp(min=0)
    w = torch.where((mean < 1e-7)[:, None], torch.ones_like(w), w)
    return torch.where(mask, w, torch.zeros_like(w))


def sepa_transform(u: torch.Tensor, execution: torch.Tensor, lam: float, variant: str) -> torch.Tensor:
    """SEPA on u [N, T]: variant 'pool', 'amp' or 'amp_c', lam clipped to [0, 1], using each
    row's execution-token mean; rows without execution tokens are left as they are."""
    lam = min(max(float(lam), 0.0), 1.0)
    if lam == 0:
        return u
    u = u.clamp(max=MAX_SURPRISAL)
    n_exec = execution.sum(1)
    mu = ((u * execution).sum(1) / n_exec.clamp(min=1))[:, None]  # [N, 1]
    if variant == "pool":
        moved = lam * mu + (1 - lam) * u
    else:
        moved = (1 + lam) * u - lam * mu
        if variant == "amp_c":
            moved = moved.clamp(min=0)
    return torch.where(execution & (n_exec > 0)[:, None], moved, u)


def entropy_mask(token_adv: torch.Tensor, u: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                 adv: torch.Tensor, rho: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per group, zero the advantage of tokens whose raw u is below the group's top-rho threshold
    (sorted[max(1, floor(n rho)) - 1], descending). rho <= 0 disables it (retrain's default 0.0
    means off), rho >= 1 keeps everything. entropy_mask_threshold: mean over groups (with
    rho >= 1, the smallest u, the threshold that keeps all); entropy_mask_fraction: share masked."""
    if rho <= 0:
        return token_adv, {}
    keep = torch.zeros_like(mask)
    per_group = {}
    for sl in group_slices(group):
        values = u[sl][mask[sl]]
        if values.numel() == 0:
            per_group[sl.start] = {"entropy_mask_threshold": 0.0, "entropy_mask_fraction": 0.0}
            continue
        ordered = values.sort(descending=True).values
        threshold = ordered[-1] if rho >= 1 else ordered[max(1, int(values.numel() * rho)) - 1]
        keep[sl] = mask[sl] & (u[sl] >= threshold)
        per_group[sl.start] = {"entropy_mask_threshold": float(threshold),
                               "entropy_mask_fraction": float((values < threshold).sum()) / values.numel()}
    metrics = average_metrics([per_group[sl.start] for sl in signal_slices(adv, group_slices(group))])
    return torch.where(keep, token_adv, torch.zeros_like(token_adv)), metrics


# -- the registry -----------------------------------------------------------------------------

TOKEN_TRANSFORMS = Registry(
    "transform_mode", "fn(ctx: TokenContext, params: dict) -> (token_advantages [N, T] float64, metrics: dict[str, float])")


def _planning(ctx: TokenContext, name: str, required: bool) -> torch.Tensor:
    if ctx.planning is None:
        if required:
            raise ValueError(f"transform_mode {name!r} needs the planning-token mask (TokenContext.planning): "
                             "run the [grpo.planning] detector on the completions")
        return torch.zeros_like(ctx.mask)
    return ctx.planning.bool() & ctx.mask


def _gtpo_family(ctx: TokenContext, params: dict, name: str, *, sepa: str | None = None,
                 hicra: bool = False, mask_rho: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    planning = _planning(ctx, name, required=sepa is not None or hicra)
    u = token_uncertainty(ctx, params.get("uncertainty_kind", "surprisal"))
    metrics = split_stats(u, ctx.mask, planning)
    shaped = u if sepa is None else sepa_transform(u, ctx.mask & ~planning, ctx.sepa_lambda, sepa)
    metrics.update(split_stats(shaped, ctx.mask, planning, prefix="post_"))
    token_adv = ctx.advantages.double()[:, None] * gtpo_weights(shaped, ctx.mask, params["gtpo"]["beta"])
    if hicra:
        token_adv = token_adv + params["hicra"]["alpha"] * token_adv.abs() * planning
    if mask_rho is not None:
        token_adv, extra = entropy_mask(token_adv, u, ctx.mask, ctx.group, ctx.advantages, mask_rho)
        metrics.update(extra)
    return torch.where(ctx.mask, token_adv, torch.zeros_like(token_adv)), metrics


@TOKEN_TRANSFORMS.register("none", help="every token gets the episode advantage")
def none(ctx: TokenContext, params: dict) -> tuple[torch.Tensor, dict[str, float]]:
    token_adv = torch.where(ctx.mask, ctx.advantages.double()[:, None], torch.zeros((), dtype=torch.float64))
    # observational surprisal stats, so runs compare across transforms (as retrain logs them)
    return token_adv, split_stats(surprisals(ctx.logprobs, ctx.mask), ctx.mask, _planning(ctx, "none", False))


@TOKEN_TRANSFORMS.register("gtpo", tables=("gtpo",), help="uncertainty-weighted tokens (GTPO)")
def gtpo(ctx, params):
    return _gtpo_family(ctx, params, "gtpo")


@TOKEN_TRANSFORMS.register("gtpo_hicra", tables=("gtpo", "hicra", "planning"),
                           help="GTPO, then planning tokens amplified (HICRA)")
def gtpo_hicra(ctx, params):
    return _gtpo_family(ctx, params, "gtpo_hicra", hicra=True)


@TOKEN_TRANSFORMS.register("gtpo_sepa", tables=("gtpo", "planning", "sepa"),
                           help="execution-token uncertainty pooled toward its mean (SEPA), then GTPO")
def gtpo_sepa(ctx, params):
    return _gtpo_family(ctx, params, "gtpo_sepa", sepa="pool")


@TOKEN_TRANSFORMS.register("gtpo_sepa_amp", tables=("gtpo", "planning", "sepa"),
                           help="execution-token uncertainty pushed away from its mean, then GTPO")
def gtpo_sepa_amp(ctx, params):
    return _gtpo_family(ctx, params, "gtpo_sepa_amp", sepa="amp")


@TOKEN_TRANSFORMS.register("gtpo_sepa_amp_c", tables=("gtpo", "planning", "sepa"),
                           help="gtpo_sepa_amp with the pushed uncertainty floored at 0")
def gtpo_sepa_amp_c(ctx, params):
    return _gtpo_family(ctx, params, "gtpo_sepa_amp_c", sepa="amp_c")


@TOKEN_TRANSFORMS.register("entropy_mask", tables=("gtpo", "entropy_mask"),
                           help="GTPO, then only each group's top-rho most uncertain tokens keep their advantage")
def entropy_mask_transform(ctx, params):
    return _gtpo_family(ctx, params, "entropy_mask", mask_rho=float(params["entropy_mask"]["rho"]))


def _delight_stats(ctx: TokenContext) -> dict[str, float]:
    return split_stats(surprisals(ctx.logprobs, ctx.mask), ctx.mask, _planning(ctx, "delight", False))


@TOKEN_TRANSFORMS.register("delight", tables=("delight",), help="A * sigmoid(A * s / eta) per token (delight gating)")
def delight(ctx, params):
    token_adv, metrics = delight_advantages(ctx.advantages.double(), ctx.logprobs, ctx.mask, ctx.group,
                                            params["delight"], params.get("state", {}), None, "none")
    return token_adv, {**_delight_stats(ctx), **metrics}


@TOKEN_TRANSFORMS.register("delight_sepa", tables=("delight", "sepa"),
                           help="A * ((1 - lam) + lam * gate): plain policy gradient to delight along lam")
def delight_sepa(ctx, params):
    cfg = params["delight"]
    lam = ctx.sepa_lambda if cfg["lambda"] is None else float(cfg["lambda"])
    token_adv, metrics = delight_advantages(ctx.advantages.double(), ctx.logprobs, ctx.mask, ctx.group,
                                            cfg, params.get("state", {}), lam, "scale")
    return token_adv, {**_delight_stats(ctx), **metrics}


@TOKEN_TRANSFORMS.register("hard_delight", tables=("delight", "sepa"),
                           help="keep the top (A > 0) or bottom (A < 0) k_frac of tokens by surprisal, blended by lam")
def hard_delight(ctx, params):
    cfg = params["delight"]
    lam = ctx.sepa_lambda if cfg["lambda"] is None else float(cfg["lambda"])
    token_adv, metrics = hard_delight_advantages(ctx.advantages.double(), ctx.logprobs, ctx.mask, ctx.group,
                                                 float(cfg["k_frac"]), lam)
    return token_adv, {**_delight_stats(ctx), **metrics}
