"""What a run.toml can name, for `retrograd plugins`: every registry of the RL maths (policy losses,
advantage modes, token transforms, uncertainty kinds, recipes) and the reward types, each with its
parameters, plus the user functions (`module:function`) a given run.toml plugs in.

A plugin is an ordinary function with the registry's signature, named by dotted path in the TOML
(its folder is on sys.path while it is imported), e.g.

    [grpo]
    advantage_mode = "my_advantages:rank_based"      # def rank_based(rewards [P, G], params) -> [P, G]
    [grpo.advantage_params]
    temperature = 0.5
"""
from __future__ import annotations

from pathlib import Path


def registries() -> dict:
    """kind -> (Registry, the config key that picks from it)."""
    from retrograd.algorithms.advantages import EPISODE_ADVANTAGES
    from retrograd.algorithms.policy_losses import POLICY_LOSSES
    from retrograd.algorithms.transforms import TOKEN_TRANSFORMS, UNCERTAINTY
    return {"policy losses": (POLICY_LOSSES, "grpo.policy_loss"),
            "advantage modes": (EPISODE_ADVANTAGES, "grpo.advantage_mode"),
            "token transforms": (TOKEN_TRANSFORMS, "grpo.transform_mode"),
            "uncertainty kinds": (UNCERTAINTY, "grpo.uncertainty_kind")}


def catalog(cfg=None) -> dict:
    """Everything registered, and (with a loaded config) the plugins it names."""
    from retrograd.algorithms.pipeline import ALGORITHM_MODES
    from retrograd.rl.rewards import REWARD_TYPES
    out = {}
    for kind, (registry, key) in registries().items():
        out[kind] = {"key": key, "signature": registry.signature, "entries": registry.describe()}
    out["recipes"] = {"key": "grpo.algorithm_mode", "signature": "",
                      "entries": [{"name": n, "help": f"advantage_mode = {a!r}, transform_mode = {t!r}",
                                   "defaults": {}, "tables": [], "aliases": []}
                                  for n, (a, t) in ALGORITHM_MODES.items()]}
    out["reward types"] = {"key": "[[grpo.rewards]] type", "signature": "fn(prompts, completions, **columns) -> list[float]",
                           "entries": [{"name": n, "help": h, "defaults": {}, "tables": [], "aliases": []}
                                       for n, h in REWARD_TYPES.items()]}
    if cfg is not None and cfg.grpo is not None:
        g, base = cfg.grpo, Path(cfg.source).parent
        used = []
        for kind, (registry, key) in registries().items():
            name = getattr(g, key.split(".")[1])
            if name and name not in registry:
                entry = registry.entry(name, base)
                used.append({"kind": kind, "key": key, "name": name, "help": entry.help})
        for r in g.rewards:
            if isinstance(r, dict) and r.get("type") == "python":
                used.append({"kind": "reward types", "key": "[[grpo.rewards]] function", "name": r.get("function"),
                             "help": "a python reward"})
        out["this run"] = used
    return out


def format_catalog(c: dict) -> str:
    lines = []
    for kind, block in c.items():
        if kind == "this run":
            continue
        lines.append(f"{kind} ({block['key']}){': ' + block['signature'] if block['signature'] else ''}")
        for e in block["entries"]:
            extra = []
            if e["aliases"]:
                extra.append("aliases " + ", ".join(e["aliases"]))
            if e["tables"]:
                extra.append("reads " + ", ".join(f"[grpo.{t}]" for t in e["tables"]))
            if e["defaults"]:
                extra.append(", ".join(f"{k} = {v!r}" for k, v in e["defaults"].items()))
            lines.append(f"  {e['name']:<22s} {e['help']}" + (f"  ({'; '.join(extra)})" if extra else ""))
        lines.append("")
    if "this run" in c:
        lines.append("plugins this run uses:" if c["this run"] else "this run uses built-ins only")
        for u in c["this run"]:
            lines.append(f"  {u['key']} = {u['name']!r}: {u['help'] or '(no docstring)'}")
    lines.append("Your own: name a function 'module:function' in the key (the TOML's folder is on the import path); "
                 "it must have the signature above.")
    return "\n".join(lines)
