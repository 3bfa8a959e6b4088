"""Episode-level advantages: one number per completion, computed within its prompt group.

Owns the `EPISODE_ADVANTAGES` registry (`advantage_mode` in the config) and the batch-level
post-processing that runs on token advantages after the token transform: REINFORCE++'s batch
normalisation and the advantage cap. Token-level shaping lives in transforms.py, the composition
in pipeline.py. The maths follows teilomillet/retrain (advantages/episode.py, discover.py).

Shapes: P prompt groups of G completions; rewards [P, G] float64; token advantages [N, T] with
N = P * G rows (group-contiguous) and `mask` [N, T] true on sampled tokens.

  grpo               A_i = r_i - mean(r)                         (no std division)
  rloo               A_i = G/(G-1) * (r_i - mean(r)) = r_i - mean of the others
  grpo_std           (r_i - mean(r)) / std(r), unbiased std, 0 where std = 0 (TRL's original)
  maxrl              A_i = (r_i - m) / (m + 1e-6), m = mean(r); all 0 when m <= 1e-6
  reinforce_pp       grpo's centring; the "++" is batch_advantage_norm, run by the pipeline
  discover_entropic  p = softmax(beta * r), A_i = G * p_i - 1; beta fixed or the largest one
                     with KL(p || uniform) <= target_kl (bisection)
"""
from __future__ import annotations

import math

import torch

from retrograd.algorithms.registry import Registry

EPISODE_ADVANTAGES = Registry(
    "advantage_mode", "fn(rewards [P, G] float64 tensor, params: dict) -> advantages [P, G]")

MAXRL_EPS = 1e-6  # both the "no success" cut-off and the denominator's guard, as in retrain
BATCH_NORM_EPS = 1e-8


@EPISODE_ADVANTAGES.register("grpo", help="r - mean(r) within the group (Dr. GRPO, no std division)")
def grpo(rewards: torch.Tensor, params: dict) -> torch.Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)


@EPISODE_ADVANTAGES.register("rloo", help="r_i minus the mean of the group's other rewards (leave-one-out)")
def rloo(rewards: torch.Tensor, params: dict) -> torch.Tensor:
    group_size = rewards.shape[1]
    if group_size < 2:  # no "others" to compare with: no signal
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)


@EPISODE_ADVANTAGES.register("grpo_std", help="(r - mean) / std with the unbiased std, 0 where std = 0 (original GRPO)")
def grpo_std(rewards: torch.Tensor, params: dict) -> torch.Tensor:
    # identical to policy.group_advantages(scale="std"): a one-completion group has std NaN and
    # falls in the "std = 0" branch
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # [P, 1]
    return torch.where(std > 0, centred / std.clamp(min=1e-12), torch.zeros_like(centred))


@EPISODE_ADVANTAGES.register("maxrl", help="(r - m) / (m + 1e-6), m = mean(r); 0 when m <= 1e-6 (inverse success rate)")
def maxrl(rewards: torch.Tensor, params: dict) -> torch.Tensor:
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    scaled = (rewards - mean) / (mean + MAXRL_EPS)
    return torch.where(mean <= MAXRL_EPS, torch.zeros_like(scaled), scaled)


@EPISODE_ADVANTAGES.register("reinforce_pp", help="r - mean(r); pair with batch_advantage_norm for REINFORCE++")
def reinforce_pp(rewards: torch.Tensor, params: dict) -> torch.Tensor:
    return grpo(rewards, params)


# -- discover_entropic (TTT-Discover's entropic objective) -----------------------------------

DISCOVER_DEFAULTS = {"beta": None, "target_kl": 0.2, "beta_max": 50.0, "search_steps": 24}


def _boltzmann(rewards: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """softmax(beta * r) per group; the exponent is floored at -700 as retrain does, so no
    probability is exactly 0."""
    z = (beta[:, None] * (rewards - rewards.max(dim=1, keepdim=True).values)).clamp(min=-700.0)
    e = torch.exp(z)
    return e / e.sum(dim=1, keepdim=True)


def _kl_to_uniform(probs: torch.Tensor) -> torch.Tensor:
    """KL(p || uniform) per group, [P]."""
    log_g = math.log(probs.shape[1])
    terms = torch.where(probs > 0, probs * (probs.log() + log_g), torch.zeros_like(probs))
    return terms.sum(dim=1)


def entropic_beta(rewards: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse temperature of each group and its KL to uniform, ([P], [P]).

    A fixed `beta` is used as given (floored at 0). Otherwise, the largest beta in [0, beta_max]
    with KL <= target_kl: beta_max itself when it qualifies, else `search_steps` bisection steps
    keeping the last qualifying midpoint (0 if none). Constant rewards and one-completion groups
    get beta = 0."""
    params = {**DISCOVER_DEFAULTS, **params}
    n_groups, group_size = rewards.shape
    constant = (rewards.max(dim=1).values - rewards.min(dim=1).values) <= 1e-12
    zeros = torch.zeros(n_groups, dtype=rewards.dtype)
    if group_size <= 1:
        return zeros, zeros
    if params["beta"] is not None:
        beta = torch.full((n_groups,), max(0.0, float(params["beta"])), dtype=rewards.dtype)
    else:
        target, beta_max = max(0.0, float(params["target_kl"])), max(0.0, float(params["beta_max"]))
        if target == 0.0 or beta_max == 0.0:
            return zeros, zeros
        top = torch.full((n_groups,), beta_max, dtype=rewards.dtype)
        top_fits = _kl_to_uniform(_boltzmann(rewards, top)) <= target
        lo, hi, best = zeros.clone(), top.clone(), zeros.clone()
        for _ in range(max(int(params["search_steps"]), 1)):
            mid = (lo + hi) / 2
            fits = _kl_to_uniform(_boltzmann(rewards, mid)) <= target
            best = torch.where(fits, mid, best)
            lo = torch.where(fits, mid, lo)
            hi = torch.where(fits, hi, mid)
        beta = torch.where(top_fits, top, best)
    beta = torch.where(constant, zeros, beta)
    return beta, _kl_to_uniform(_boltzmann(rewards, beta))


@EPISODE_ADVANTAGES.register("discover_entropic", defaults=DISCOVER_DEFAULTS,
                             help="G * softmax(beta * r) - 1, beta from a target KL to uniform (TTT-Discover)")
def discover_entropic(rewards: torch.Tensor, params: dict) -> torch.Tensor:
    beta, _ = entropic_beta(rewards, params)
    adv = rewards.shape[1] * _boltzmann(rewards, beta) - 1.0
    # constant groups: exactly 0 (G * (1/G) - 1 can round to -1e-16), since 0 means "no signal"
    constant = (rewards.max(dim=1).values - rewards.min(dim=1).values) <= 1e-12
    return torch.where(constant[:, None], torch.zeros_like(adv), adv)


# -- after the token transform ---------------------------------------------------------------

def batch_advantage_norm(token_adv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE++'s batch normalisation over the non-zero token advantages of the whole batch.

    a <- (a - mu) / (sigma + 1e-8) with mu, sigma the mean and population std of the sampled
    tokens' non-zero advantages (token-weighted: long completions weigh more); a <- a - mu when
    sigma < 1e-8. Zeros stay zero: 0 marks a group with no signal, as in retrain."""
    live = mask.bool() & (token_adv != 0)  # [N, T]
    values = token_adv[live]
    metrics = {"batch_adv_mean": 0.0, "batch_adv_std": 0.0, "batch_adv_count": float(values.numel())}
    if values.numel() == 0:
        return token_adv, metrics
    mu = values.mean()
    sigma = ((values - mu) ** 2).mean().sqrt()
    metrics["batch_adv_mean"], metrics["batch_adv_std"] = float(mu), float(sigma)
    normed = token_adv - mu if sigma < BATCH_NORM_EPS else (token_adv - mu) / (sigma + BATCH_NORM_EPS)
    return torch.where(live, normed, torch.zeros_like(token_adv)), metrics


def clip_token_advantages(token_adv: torch.Tensor, mask: torch.Tensor,
                          max_abs: float) -> tuple[torch.Tensor, dict[str, float]]:
    """retrain's adv_clip_max: clamp every non-zero token advantage to [-C, C]; C <= 0 disables.

    adv_cap_fraction: capped tokens / non-zero sampled tokens.
    adv_cap_magnitude: mean |a| of the capped tokens before capping (0 when none was capped), i.e.
    how far beyond C the capped advantages were."""
    if max_abs <= 0:
        return token_adv, {"adv_cap_fraction": 0.0, "adv_cap_magnitude": 0.0}
    live = mask.bool() & (token_adv != 0)  # [N, T]
    capped = live & (token_adv.abs() > max_abs)
    n_capped = int(capped.sum())
    metrics = {"adv_cap_fraction": n_capped / max(int(live.sum()), 1),
               "adv_cap_magnitude": float(token_adv[capped].abs().mean()) if n_capped else 0.0}
    return torch.where(live, token_adv.clamp(-max_abs, max_abs), token_adv), metrics


# -- group bookkeeping ------------------------------------------------------------------------

def group_slices(group: torch.Tensor) -> list[slice]:
    """The row range of each group, in order; `group` [N] holds each row's group index and the
    rows of a group are contiguous."""
    _, counts = torch.unique_consecutive(group, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return [slice(end - count, end) for end, count in zip(ends, counts.tolist())]


def signal_slices(adv: torch.Tensor, slices: list[slice]) -> list[slice]:
    """The groups with some non-zero episode advantage, or all groups when none has one.
    Per-group metrics are averaged over these: retrain's loop drops no-signal groups before
    computing advantages, so its logged averages never include them."""
    live = [sl for sl in slices if bool((adv[sl] != 0).any())]
    return live or slices


def average_metrics(per_group: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the groups that report it (how retrain logs per-group metrics)."""
    keys = dict.fromkeys(k for d in per_group for k in d)
    return {k: sum(d[k] for d in per_group if k in d) / sum(1 for d in per_group if k in d) for k in keys}


# -- reward bookkeeping (moved from policy.py) -----------------------------------------------

def zero_signal_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P] bool: groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, max_penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then linear to -max_penalty."""
    excess = (lengths.double() - (max_new_tokens - buffer_tokens)) / buffer_tokens
    return -max_penalty * excess.clamp(min=0, max=1)
