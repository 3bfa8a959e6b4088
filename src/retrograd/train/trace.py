"""`retrograd trace run.toml`: run the configured credit assignment on synthetic groups and show, per
token, what it did (uncertainty, planning mask, SEPA λ, final advantage) -- before spending a
GPU-day on a transform. No model is loaded: completions are short texts split into words, their
log-probabilities drawn from a seeded generator, rewards 1 for the right answer and 0 otherwise.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from retrograd.algorithms.pipeline import token_advantages
from retrograd.algorithms.planning import regex_planning_mask
from retrograd.algorithms.sepa import SepaController
from retrograd.algorithms.transforms import TokenContext, token_uncertainty

# (completion, reward): right answers with and without planning phrases, and wrong ones
SYNTHETIC = [
    ("Let me think . 17 + 25 = 42 . Wait let me check : 17 + 25 is 42 . Answer : 42", 1.0),
    ("17 + 25 = 32 . Answer : 32", 0.0),
    ("Notice that 25 + 17 = 42 . The key is to add tens first . Answer : 42", 1.0),
    ("17 plus 25 makes 43 . Answer : 43", 0.0),
    ("Let me verify : 10 + 20 = 30 and 7 + 5 = 12 , so 42 . Answer : 42", 1.0),
    ("Try another approach : 17 + 25 = 41 . Answer : 41", 0.0),
    ("42", 1.0),
    ("Double check : 17 + 25 = 42 . Answer : 42", 1.0),
]


def synthetic_groups(groups: int, group_size: int, seed: int):
    """(completions as word lists [N], rewards [P, G], log-probs [N, T], entropies [N, T], mask [N, T])."""
    gen = torch.Generator().manual_seed(seed)
    words, rewards = [], []
    for p in range(groups):
        row = []
        for i in range(group_size):
            text, r = SYNTHETIC[(p * 3 + i) % len(SYNTHETIC)]
            words.append(text.split())
            row.append(r)
        rewards.append(row)
    width = max(len(w) for w in words)
    mask = torch.tensor([[t < len(w) for t in range(width)] for w in words])
    surprisal = -torch.log(torch.rand(len(words), width, generator=gen).clamp(min=1e-6))  # Exp(1) draws
    logprobs = torch.where(mask, -surprisal, torch.zeros(()))
    entropy = torch.where(mask, surprisal + torch.rand(len(words), width, generator=gen), torch.zeros(()))
    return words, torch.tensor(rewards, dtype=torch.float64), logprobs, entropy, mask


def trace(cfg, step: int | None = None, groups: int = 2, seed: int = 0) -> dict:
    """The pipeline of cfg's RL table on synthetic groups at `step` (default: the SEPA ramp's middle,
    gate open), as a dict: per completion its reward, episode advantage and per-token rows."""
    g = cfg.grpo
    group_size = min(g.group_size, 4)
    words, rewards, logprobs, entropy, mask = synthetic_groups(groups, group_size, seed)
    planning = torch.zeros_like(mask)
    for i, w in enumerate(words):
        row = regex_planning_mask(w, (g.planning or {}).get("strategic_grams") or None)
        planning[i, :len(row)] = torch.tensor(row)
    lam, sepa = 0.0, None
    if g.sepa is not None:
        sepa = SepaController(**g.sepa)
        if step is None:
            step = int(g.sepa["delay_steps"] + g.sepa["steps"] // 2)
        sepa.observe(torch.tensor([1.0]), 1.0)  # a correct step: the gate opens, as it would in a run
        lam = sepa.lambda_for(step)
    step = step or 0
    ctx = TokenContext(advantages=torch.zeros(len(words), dtype=torch.float64), logprobs=logprobs, mask=mask,
                       group=torch.arange(len(words)) // group_size, planning=planning, entropy=entropy,
                       sepa_lambda=lam, step=step)
    tables = {t: getattr(g, t) for t in ("gtpo", "hicra", "planning", "sepa", "delight", "entropy_mask")
              if getattr(g, t) is not None}
    token_adv, episode, metrics = token_advantages(
        rewards, ctx, advantage_mode=g.advantage_mode, transform_mode=g.transform_mode,
        uncertainty_kind=g.uncertainty_kind or "surprisal", tables=tables, advantage_params=g.advantage_params,
        transform_params=g.transform_params, batch_norm=g.batch_advantage_norm, adv_clip_max=g.adv_clip_max,
        state={}, search_path=Path(cfg.source).parent)
    u = token_uncertainty(dataclasses.replace(ctx, advantages=episode), g.uncertainty_kind or "surprisal")
    completions = []
    for i, w in enumerate(words):
        completions.append({
            "group": i // group_size, "reward": float(rewards.view(-1)[i]), "episode_advantage": float(episode[i]),
            "tokens": [{"token": w[t], "uncertainty": float(u[i, t]), "planning": bool(planning[i, t]),
                        "advantage": float(token_adv[i, t])} for t in range(len(w))]})
    return {"advantage_mode": g.advantage_mode, "transform_mode": g.transform_mode,
            "uncertainty_kind": g.uncertainty_kind or "surprisal", "batch_advantage_norm": g.batch_advantage_norm,
            "adv_clip_max": g.adv_clip_max, "step": step, "sepa_lambda": lam, "metrics": metrics,
            "completions": completions}


def format_trace(t: dict) -> str:
    lines = [f"advantage_mode {t['advantage_mode']}, transform_mode {t['transform_mode']}, uncertainty "
             f"{t['uncertainty_kind']}, batch_advantage_norm {t['batch_advantage_norm']}, adv_clip_max "
             f"{t['adv_clip_max']}; step {t['step']}, SEPA lambda {t['sepa_lambda']:.3f}", ""]
    for i, c in enumerate(t["completions"]):
        lines.append(f"completion {i} (group {c['group']}): reward {c['reward']:g}, episode advantage "
                     f"{c['episode_advantage']:+.4f}")
        lines.append(f"  {'token':<14s}{'uncertainty':>12s}{'plan':>6s}{'advantage':>12s}")
        for tk in c["tokens"]:
            lines.append(f"  {tk['token'][:14]:<14s}{tk['uncertainty']:12.4f}{'*' if tk['planning'] else '':>6s}"
                         f"{tk['advantage']:+12.4f}")
        lines.append("")
    if t["metrics"]:
        lines.append("metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(t["metrics"].items())))
    return "\n".join(lines)
