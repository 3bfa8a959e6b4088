"""Resolve an RL table's credit assignment and policy loss (today [grpo]; [ppo] later): recipes,
retrograd-rs / TRL synonyms, registry names (built-in or a user's `module:function`), their
sub-tables and parameters. Everything a chosen mode does not read is an error naming the key.

After this, the table holds the resolved names (advantage_mode, transform_mode, uncertainty_kind,
policy_loss) and every sub-table it reads as a dict with all keys filled, so the checkpoint
fingerprint records exactly what ran.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from retrograd.algorithms.advantages import EPISODE_ADVANTAGES
from retrograd.algorithms.policy_losses import POLICY_LOSSES
from retrograd.algorithms.pipeline import ALGORITHM_MODES
from retrograd.algorithms.registry import PluginError, merged_params
from retrograd.algorithms.transforms import TABLE_DEFAULTS, TOKEN_TRANSFORMS, UNCERTAINTY, fill_tables
from retrograd.errors import ConfigError

# sub-tables of the token transforms, in the order the docs list them
CREDIT_TABLES = tuple(TABLE_DEFAULTS)


def _entry(registry, name: str, key: str, src: Path, base: Path):
    try:
        return registry.entry(name, base)
    except PluginError as e:
        raise ConfigError(f"{src}: {key}: {e}") from None


def _fill_table(table: str, raw, src: Path, where: str) -> dict:
    """One transform sub-table with every key filled (unknown keys refused); values typed as the defaults."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: [{where}.{table}] must be a table, got {raw!r}")
    unknown = sorted(set(raw) - set(TABLE_DEFAULTS[table]))
    if unknown:
        raise ConfigError(f"{src}: unknown key {unknown[0]!r} in [{where}.{table}]; valid keys: "
                          f"{', '.join(TABLE_DEFAULTS[table])}")
    out = fill_tables([table], {table: raw})[table]
    for k, v in raw.items():
        d = TABLE_DEFAULTS[table][k]
        number = isinstance(d, (int, float)) and not isinstance(d, bool)
        ok = (d is None or (isinstance(d, bool) and isinstance(v, bool))
              or (number and isinstance(v, (int, float)) and not isinstance(v, bool))
              or (isinstance(d, (str, list)) and isinstance(v, type(d))))
        if not ok:
            raise ConfigError(f"{src}: {where}.{table}.{k}: expected {type(d).__name__}, got {v!r}")
        out[k] = float(v) if isinstance(d, float) else v
    return out


def resolve_credit(g, src: Path, base: Path, where: str = "grpo"):
    """algorithm_mode / baseline / scale_rewards -> advantage_mode and transform_mode; the transform's
    sub-tables filled; advantage and uncertainty names checked."""
    adv, tx = g.advantage_mode, g.transform_mode
    if g.algorithm_mode is not None:
        if g.algorithm_mode not in ALGORITHM_MODES:
            raise ConfigError(f"{src}: {where}.algorithm_mode {g.algorithm_mode!r} is not a recipe; recipes: "
                              f"{', '.join(ALGORITHM_MODES)} (or set advantage_mode and transform_mode)")
        if adv is not None or tx is not None:
            raise ConfigError(f"{src}: {where}.algorithm_mode sets advantage_mode and transform_mode; give either "
                              "the recipe or the two modes, not both")
        adv, tx = ALGORITHM_MODES[g.algorithm_mode]
    # retrograd-rs's baseline and TRL's scale_rewards are names for two advantage modes
    synonym = {"rloo": "rloo", "leave_one_out": "rloo"}.get(g.baseline)
    if g.scale_rewards == "std":
        if synonym:
            raise ConfigError(f"{src}: {where}.baseline = {g.baseline!r} and scale_rewards = 'std' are two advantage "
                              "modes; choose one (advantage_mode = 'rloo' or 'grpo_std')")
        synonym = "grpo_std"
    if synonym:
        if adv not in (None, "grpo", synonym):
            raise ConfigError(f"{src}: {where}.{'baseline' if synonym == 'rloo' else 'scale_rewards'} applies to "
                              f"advantage_mode = 'grpo' only, not {adv!r}; remove it")
        adv = synonym
    adv, tx = adv or "grpo", tx or "none"
    adv_entry = _entry(EPISODE_ADVANTAGES, adv, f"{where}.advantage_mode", src, base)
    tx_entry = _entry(TOKEN_TRANSFORMS, tx, f"{where}.transform_mode", src, base)
    try:
        advantage_params = merged_params(adv_entry, g.advantage_params, f"{where}.advantage_params")
    except PluginError as e:
        raise ConfigError(f"{src}: {e}") from None
    if g.transform_params and tx_entry.builtin:
        raise ConfigError(f"{src}: [{where}.transform_params] is read by plugin transforms only; the built-in "
                          f"{tx!r} reads {', '.join(f'[{where}.{t}]' for t in tx_entry.tables) or 'no table'}")
    tables = {}
    for table in CREDIT_TABLES:
        raw = getattr(g, table)
        if raw is not None and table not in tx_entry.tables:
            raise ConfigError(f"{src}: [{where}.{table}] is not read by transform_mode = {tx!r}"
                              + (f" (it reads {', '.join(f'[{where}.{t}]' for t in tx_entry.tables)})"
                                 if tx_entry.tables else "") + "; remove it")
        tables[table] = _fill_table(table, raw or {}, src, where) if table in tx_entry.tables else None
    uses_uncertainty = "gtpo" in tx_entry.tables or not tx_entry.builtin
    if g.uncertainty_kind is not None and not uses_uncertainty:
        raise ConfigError(f"{src}: {where}.uncertainty_kind is not read by transform_mode = {tx!r} (only the GTPO "
                          "family and entropy_mask weigh tokens by uncertainty); remove it")
    kind = None  # left unset when the transform weighs no token by uncertainty (so it round-trips)
    if uses_uncertainty:
        kind = UNCERTAINTY.canonical(g.uncertainty_kind or "surprisal")
        _entry(UNCERTAINTY, kind, f"{where}.uncertainty_kind", src, base)
    return dataclasses.replace(g, advantage_mode=adv, transform_mode=tx, uncertainty_kind=kind,
                               advantage_params=advantage_params, **tables)


def resolve_policy_loss(g, src: Path, base: Path, where: str = "grpo"):
    """policy_loss (importance_sampling_level = "sequence" is GSPO), its parameters, the dual-clip."""
    loss = POLICY_LOSSES.canonical(g.policy_loss)
    if g.importance_sampling_level == "sequence":
        if loss not in ("clip", "gspo"):
            raise ConfigError(f"{src}: {where}.importance_sampling_level = 'sequence' is GSPO's ratio; it does not "
                              f"apply to policy_loss = {g.policy_loss!r}")
        loss = "gspo"
    entry = _entry(POLICY_LOSSES, loss, f"{where}.policy_loss", src, base)
    try:
        params = merged_params(entry, g.policy_loss_params, f"{where}.policy_loss_params")
    except PluginError as e:
        raise ConfigError(f"{src}: {e}") from None
    if 0 < g.clip_ratio_c <= 1:
        raise ConfigError(f"{src}: {where}.clip_ratio_c = {g.clip_ratio_c} must be > 1 (or 0 to turn dual-clip off)")
    lo, hi = g.importance_correction_min, g.importance_correction_max
    if lo is not None and g.importance_correction == "none":
        raise ConfigError(f"{src}: {where}.importance_correction_min is not read when importance_correction = 'none'")
    if lo is not None and lo >= hi:
        raise ConfigError(f"{src}: {where}.importance_correction_min = {lo} must be below importance_correction_max = {hi}")
    return dataclasses.replace(g, policy_loss=entry.name, policy_loss_params=params)
