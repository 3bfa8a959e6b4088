"""`retrograd plot RUN_OR_CAMPAIGN... [--metric M ...] [--out curves.png]`: line plots of logged metrics
against step, several runs overlaid; a campaign folder's conditions drawn as the mean over seeds with a
band from the lowest to the highest seed. Also writes an HTML report beside the PNG (the plot and each
run's resolved config). matplotlib is the optional extra `retrograd[plot]`.

Default metrics: the headline ones the runs logged (train loss, evaluation loss / mean reward /
teacher KL, mean reward).
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from retrograd.cli.status import HEADLINE, _num, find_runs, read_rows
from retrograd.errors import ConfigError, RetrogradError


def _series(run: Path, metric: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), _num(r.get(metric))) for r in read_rows(run / "metrics.jsonl") if metric in r]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def _groups(targets: list[str]) -> list[tuple[str, list[Path]]]:
    """(label, runs): a campaign folder gives one group per condition (its runs_dir/<label>_s<seed>)."""
    out = []
    for t in targets:
        p = Path(t)
        if not p.exists():
            raise ConfigError(f"retrograd plot: {t}: no such folder")
        manifest = p / "manifest.json"
        if manifest.is_file():
            try:
                m = json.loads(manifest.read_text())
            except ValueError:
                m = {}
            by_cond: dict[str, list[Path]] = {}
            for r in m.get("runs", []):
                if isinstance(r, dict) and r.get("folder"):
                    by_cond.setdefault(r.get("condition", "?"), []).append(p / r["folder"])
            out += [(label, runs) for label, runs in by_cond.items()]
            continue
        runs = find_runs(p)
        if not runs:
            raise ConfigError(f"retrograd plot: {t}: no run folders (metrics.jsonl) under it")
        out += [(r.name if len(runs) > 1 or len(targets) > 1 else p.name, [r]) for r in runs]
    return out


def plot(targets: list[str], metrics: list[str] | None, out: str) -> dict:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RetrogradError("retrograd plot needs matplotlib: pip install 'retrograd[plot]'") from None
    groups = _groups(targets)
    logged = {k for _, runs in groups for r in runs for row in read_rows(r / "metrics.jsonl") for k in row}
    metrics = metrics or [m for m in HEADLINE if m in logged][:4]
    unknown = [m for m in metrics if m not in logged]
    if unknown:
        raise ConfigError(f"retrograd plot: --metric {unknown[0]!r} was not logged by these runs; they logged e.g. "
                          + ", ".join(sorted(k for k in logged if "/" in k)[:12]))
    if not metrics:
        raise ConfigError("retrograd plot: these runs logged no metric yet")
    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 3 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        for label, runs in groups:
            series = [_series(r, metric) for r in runs]
            series = [s for s in series if s[0]]
            if not series:
                continue
            if len(series) == 1:
                ax.plot(series[0][0], series[0][1], label=label, marker="." if len(series[0][0]) < 30 else None)
                continue
            steps = sorted(set.intersection(*(set(s) for s, _ in series)))
            vals = [[dict(zip(s, v))[t] for s, v in series] for t in steps]
            mean = [sum(v) / len(v) for v in vals]
            line, = ax.plot(steps, mean, label=f"{label} (mean of {len(series)})")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2, color=line.get_color())
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    report = out_path.with_suffix(".html")
    png = base64.b64encode(out_path.read_bytes()).decode()
    configs = "".join(f"<h3>{html.escape(label)}: {html.escape(str(r))}</h3><pre>"
                      f"{html.escape((r / 'config.toml').read_text() if (r / 'config.toml').exists() else '(no config.toml)')}"
                      "</pre>" for label, runs in groups for r in runs)
    report.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>retrograd plot</title></head><body>"
                      f"<h1>{html.escape(', '.join(metrics))}</h1><img src='data:image/png;base64,{png}'>"
                      f"<h2>configs</h2>{configs}</body></html>", encoding="utf-8")
    return {"png": str(out_path), "html": str(report), "metrics": metrics, "groups": [g for g, _ in groups]}


def run_plot(targets: list[str], metrics: list[str] | None, out: str, as_json: bool) -> int:
    r = plot(targets, metrics, out)
    print(json.dumps(r, indent=2) if as_json else f"wrote {r['png']} and {r['html']} ({', '.join(r['metrics'])})")
    return 0
