"""`retrograd judge eval run.toml --fixtures F.jsonl`: how far to trust a run's judge before training
with it. Each fixture row is a prompt, its completions and human (or reference) labels:

    {"prompt": "text" | [messages], "completions": ["...", "..."], "labels": [3, 1], "rubric": "optional"}

The judge of the run's [grpo.judge] / [ppo.judge] table scores every row as one group, twice (the
cache is not read: a second pass is a real second opinion; listwise and pairwise orders differ
between passes). Reported: agreement with the labels (Kendall's tau-b and Spearman's rho, per row
and averaged over rows whose labels are not all equal, and pooled over every completion) and
self-consistency (the same statistics between the two passes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from retrograd.data.jsonl import read_jsonl
from retrograd.errors import ConfigError, DataError
from retrograd.rl.judge import DEFAULT_RUBRIC, judge_from_config


def average_ranks(x: list[float]) -> list[float]:
    """Ranks 1..n, ties given the mean of the ranks they span."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman_rho(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation of the average ranks; None when either side is constant."""
    rx, ry = average_ranks(x), average_ranks(y)
    n = len(x)
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def kendall_tau_b(x: list[float], y: list[float]) -> float | None:
    """(concordant - discordant) / sqrt((n0 - ties_x)(n0 - ties_y)); None when either side is constant."""
    conc = disc = tie_x = tie_y = 0
    n0 = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            n0 += 1
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0:
                tie_x += 1
            if dy == 0:
                tie_y += 1
            if dx * dy > 0:
                conc += 1
            elif dx * dy < 0:
                disc += 1
    denom = math.sqrt((n0 - tie_x) * (n0 - tie_y))
    return (conc - disc) / denom if denom > 0 else None


@dataclass
class Fixture:
    prompt: str
    completions: list[str]
    labels: list[float]
    rubric: str | None
    where: str


def load_fixtures(path: str | Path) -> list[Fixture]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--fixtures {path}: no such file")
    out = []
    for n, row in read_jsonl(p):
        where = f"{p}:{n}"
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # messages: the judge reads the last user turn, as in training
            users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
            prompt = users[-1] if users else None
        comps, labels = row.get("completions"), row.get("labels")
        if not isinstance(prompt, str):
            raise DataError(f"{where}: 'prompt' must be a string or a list of messages with a user turn")
        if not isinstance(comps, list) or len(comps) < 2 or not all(isinstance(c, str) for c in comps):
            raise DataError(f"{where}: 'completions' must be a list of at least 2 strings")
        if (not isinstance(labels, list) or len(labels) != len(comps)
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in labels)):
            raise DataError(f"{where}: 'labels' must be {len(comps)} numbers, one per completion")
        rubric = row.get("rubric")
        out.append(Fixture(prompt, comps, [float(v) for v in labels], rubric if isinstance(rubric, str) else None,
                           where))
    if not out:
        raise DataError(f"--fixtures {path}: no rows")
    return out


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def evaluate_judge(judge, fixtures: list[Fixture]) -> dict:
    """Two passes of the judge over the fixtures; agreement with the labels and between passes."""
    passes: list[list[list[float] | None]] = [[], []]
    errors = []
    for k in range(2):
        for r, fx in enumerate(fixtures):
            rubric = fx.rubric or judge.cfg.rubric or DEFAULT_RUBRIC
            v, replies, _ = judge.group_scores(fx.prompt, rubric, fx.completions,
                                               salt=k * 1_000_003 + r, use_cache=False)
            passes[k].append(v)
            if v is None:
                errors.append(f"{fx.where} (pass {k + 1}): " + next(x.error for x in replies if x.text is None))
    both = [r for r in range(len(fixtures)) if passes[0][r] is not None and passes[1][r] is not None]
    first = [r for r in range(len(fixtures)) if passes[0][r] is not None]
    flat_labels = [x for r in first for x in fixtures[r].labels]
    flat_scores = [x for r in first for x in passes[0][r]]
    return {
        "rows": len(fixtures), "failed_rows": len(fixtures) - len(both), "errors": errors[:5],
        "kendall_tau": _mean([kendall_tau_b(passes[0][r], fixtures[r].labels) for r in first]),
        "spearman_rho": _mean([spearman_rho(passes[0][r], fixtures[r].labels) for r in first]),
        "pooled_kendall_tau": kendall_tau_b(flat_scores, flat_labels) if len(flat_scores) > 1 else None,
        "pooled_spearman_rho": spearman_rho(flat_scores, flat_labels) if len(flat_scores) > 1 else None,
        "self_kendall_tau": _mean([kendall_tau_b(passes[0][r], passes[1][r]) for r in both]),
        "self_spearman_rho": _mean([spearman_rho(passes[0][r], passes[1][r]) for r in both]),
        "self_exact_agreement": _mean([float(passes[0][r] == passes[1][r]) for r in both]),
    }


def run_judge_eval(cfg, fixtures_path: str, as_json: bool) -> int:
    import json
    table = cfg.grpo or cfg.ppo
    if table is None or table.judge is None:
        raise ConfigError(f"{cfg.source}: judge eval reads the run's [grpo.judge] or [ppo.judge] table; it has none")
    judge = judge_from_config(table, seed=cfg.training.seed)
    out = {"fixtures": str(fixtures_path), "mode": judge.cfg.mode, "model": judge.cfg.model,
           **evaluate_judge(judge, load_fixtures(fixtures_path))}
    if as_json:
        print(json.dumps(out, indent=2))
        return 0 if out["failed_rows"] < out["rows"] else 1

    def f(v):
        return "n/a" if v is None else f"{v:+.3f}"
    print(f"judge {out['model']} ({out['mode']}) on {out['rows']} fixture rows of {out['fixtures']}"
          + (f", {out['failed_rows']} failed" if out["failed_rows"] else ""))
    print(f"{'':22s}{'Kendall tau':>12s}{'Spearman rho':>14s}")
    print(f"{'vs labels (per row)':22s}{f(out['kendall_tau']):>12s}{f(out['spearman_rho']):>14s}")
    print(f"{'vs labels (pooled)':22s}{f(out['pooled_kendall_tau']):>12s}{f(out['pooled_spearman_rho']):>14s}")
    print(f"{'pass 1 vs pass 2':22s}{f(out['self_kendall_tau']):>12s}{f(out['self_spearman_rho']):>14s}")
    for e in out["errors"]:
        print(f"  failed: {e}")
    return 0 if out["failed_rows"] < out["rows"] else 1
