"""The composition of the advantage maths for one step, as retrain composes it:

  rewards [P, G] -> episode advantages (advantage_mode) -> token advantages (transform_mode,
  with uncertainty_kind) -> batch normalisation (REINFORCE++, optional) -> cap (adv_clip_max)

One function, `token_advantages`, resolving names through the registries (built-ins, aliases or
a user's `module:function`). It owns no state: the SEPA lambda arrives in the context and the
delight EMA in `state`, both kept by the training loop. `ALGORITHM_MODES` are retrain's named
recipes (advantage_mode, transform_mode).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from retrograd.algorithms.advantages import EPISODE_ADVANTAGES, batch_advantage_norm, clip_token_advantages
from retrograd.algorithms.registry import PluginError, merged_params
from retrograd.algorithms.transforms import (TABLE_DEFAULTS, TOKEN_TRANSFORMS, UNCERTAINTY, TokenContext,
                                             check_context, fill_tables)

ALGORITHM_MODES: dict[str, tuple[str, str]] = {
    "grpo_none": ("grpo", "none"),
    "maxrl_none": ("maxrl", "none"),
    "maxrl_gtpo": ("maxrl", "gtpo"),
    "maxrl_gtpo_hicra": ("maxrl", "gtpo_hicra"),
    "maxrl_gtpo_sepa": ("maxrl", "gtpo_sepa"),
    "reinforce_pp_none": ("reinforce_pp", "none"),
    "reinforce_pp_gtpo": ("reinforce_pp", "gtpo"),
    "reinforce_pp_gtpo_sepa": ("reinforce_pp", "gtpo_sepa"),
    "reinforce_pp_delight": ("reinforce_pp", "delight"),
    "reinforce_pp_delight_sepa": ("reinforce_pp", "delight_sepa"),
    "discover_entropic": ("discover_entropic", "none"),
    "ttt_discover_entropic": ("discover_entropic", "none"),
}


def token_advantages(rewards: torch.Tensor, ctx_base: TokenContext, *, advantage_mode: str, transform_mode: str,
                     uncertainty_kind: str, tables: dict, advantage_params: dict, transform_params: dict,
                     batch_norm: bool, adv_clip_max: float, state: dict,
                     search_path: Path | str | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(token advantages [N, T] float64, exactly 0 outside the mask; episode advantages [N]
    float64; metrics). rewards [P, G]; ctx_base's rows are the P * G completions group by group
    (its `advantages` field is ignored). `tables` holds the user's [grpo.<table>] values; the
    transform gets those it reads filled with defaults (a plugin transform gets all of them),
    plus "transform_params" (free-form, for plugins), "uncertainty_kind" and "state" (mutable,
    kept by the loop across steps and saved in checkpoints)."""
    rewards = rewards.double()
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G], got {tuple(rewards.shape)}")
    n_groups, group_size = rewards.shape
    mask = ctx_base.mask.bool()  # [N, T]
    if mask.shape[0] != n_groups * group_size:
        raise ValueError(f"{n_groups} groups of {group_size} rewards but {mask.shape[0]} completions in the context")
    expected_group = torch.arange(n_groups).repeat_interleave(group_size)
    if not torch.equal(ctx_base.group.long().cpu(), expected_group):
        raise ValueError("TokenContext.group must number the rows group by group (0 * G, then 1 * G, ...) "
                         "in the order of the rewards' rows")

    adv_entry = EPISODE_ADVANTAGES.entry(advantage_mode, search_path)
    adv_params = merged_params(adv_entry, advantage_params, f"advantage_params of {advantage_mode!r}")
    episode = adv_entry.fn(rewards, adv_params)
    if not isinstance(episode, torch.Tensor) or tuple(episode.shape) != (n_groups, group_size):
        got = tuple(episode.shape) if isinstance(episode, torch.Tensor) else type(episode).__name__
        raise ValueError(f"advantage_mode {advantage_mode!r} returned {got}, expected a tensor [{n_groups}, {group_size}]")
    episode = episode.double().reshape(-1)  # [N]

    tx_entry = TOKEN_TRANSFORMS.entry(transform_mode, search_path)
    if tx_entry.builtin and transform_params:
        raise PluginError(f"transform_params {sorted(transform_params)} are for plugin transforms; the built-in "
                          f"{transform_mode!r} reads the tables {list(tx_entry.tables) or 'none'}")
    UNCERTAINTY.entry(uncertainty_kind, search_path)  # fails early on a bad name; imports a plugin once
    params = fill_tables(tx_entry.tables if tx_entry.builtin else TABLE_DEFAULTS, tables)
    params.update(transform_params=dict(transform_params or {}), uncertainty_kind=uncertainty_kind, state=state)

    ctx = dataclasses.replace(ctx_base, advantages=episode, mask=mask)
    check_context(ctx)
    token_adv, metrics = tx_entry.fn(ctx, params)
    if not isinstance(token_adv, torch.Tensor) or token_adv.shape != mask.shape:
        got = tuple(token_adv.shape) if isinstance(token_adv, torch.Tensor) else type(token_adv).__name__
        raise ValueError(f"transform_mode {transform_mode!r} returned token advantages {got}, "
                         f"expected a tensor {tuple(mask.shape)}")
    if not isinstance(metrics, dict):
        raise ValueError(f"transform_mode {transform_mode!r} must return (token_advantages, metrics dict)")
    metrics = {k: float(v) for k, v in metrics.items()}
    token_adv = torch.where(mask, token_adv.double(), torch.zeros((), dtype=torch.float64))

    if batch_norm:
        token_adv, norm_metrics = batch_advantage_norm(token_adv, mask)
        metrics.update(norm_metrics)
    token_adv, cap_metrics = clip_token_advantages(token_adv, mask, adv_clip_max)
    metrics.update(cap_metrics)
    return token_adv, episode, metrics
