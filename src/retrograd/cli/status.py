"""`retrograd status [DIR] [--watch] [--json]` and `retrograd diff RUN_A RUN_B`: what is running and how two
runs differ, read from run folders alone (no model, no torch import).

A run folder holds config.toml (the resolved config), metrics.jsonl and status.json (written by the
metrics logger: state, pid, host, total steps). Every read is tolerant: a half-written last line, NaN
(logged as null), a missing or truncated status.json never crash the view; what cannot be read shows
as "?". States: running (its process is alive), stale (alive but no new step for STALE_S), failed (the
process is gone without closing the run), finished / stopped / early_stopped / stalled (as the loop
closed it), unknown (no status.json: a run of an older retrograd).
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

STALE_S = 600
SPARK = "▁▂▃▄▅▆▇█"
# metrics where lower is better (the rest: higher is better); unknown names get no winner mark
LOWER_BETTER = ("loss", "kl", "perplexity", "seconds", "_s", "rss", "entropy")
HIGHER_BETTER = ("reward", "accuracy", "agreement", "correct", "match", "tokens_per_second", "explained_variance")
HEADLINE = ("train/loss", "eval/loss", "eval/mean_reward", "eval/reward/match", "eval/teacher_kl",
            "eval/preference_loss", "reward/mean", "distill/teacher_kl_mean")


def read_rows(path: Path) -> list[dict]:
    rows = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return rows
    for line in text.split("\n"):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue  # a line cut by a kill mid-write
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def run_summary(folder: Path, now: float | None = None) -> dict:
    now = now or time.time()
    st = _json(folder / "status.json")
    rows = read_rows(folder / "metrics.jsonl")
    step = max((int(r["step"]) for r in rows), default=0)
    total = st.get("total_steps") if isinstance(st.get("total_steps"), int) else None
    last_time = max((t for r in rows if (t := _num(r.get("time"))) is not None), default=None)
    state = st.get("state") if isinstance(st.get("state"), str) else "unknown"
    if state == "running":
        local = st.get("host") == socket.gethostname()
        if local and not _alive(st.get("pid")):
            state = "failed"
        elif last_time is not None and now - last_time > STALE_S:
            state = "stale"
    eta = None
    timed = [(int(r["step"]), t) for r in rows if (t := _num(r.get("time"))) is not None and "train/loss" in r]
    if state in ("running", "stale") and total and len(timed) >= 2 and timed[-1][0] > timed[0][0]:
        rate = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
        eta = max(0.0, rate * (total - step))
    last = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "time") and _num(v) is not None:
                last[k] = _num(v)
    return {"run": str(folder), "name": st.get("run") or folder.name, "state": state, "step": step, "total": total,
            "eta_s": eta, "updated": last_time, "last": {k: last[k] for k in HEADLINE if k in last}, "all_last": last}


def find_runs(root: Path) -> list[Path]:
    """Run folders under `root` (itself included): folders with metrics.jsonl or status.json."""
    if not root.exists():
        return []
    found = set()
    for name in ("metrics.jsonl", "status.json"):
        for p in root.rglob(name):
            if not any(part.startswith(".") for part in p.relative_to(root).parts[:-1]):
                found.add(p.parent)
    return sorted(found)


def _fmt(v, digits=4) -> str:
    return "?" if v is None else (f"{v:.{digits}g}" if isinstance(v, float) else str(v))


def _duration(s) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def status_table(runs: list[dict]):
    from rich.table import Table
    t = Table(show_header=True, header_style="bold")
    for col in ("run", "state", "step", "eta", "last metrics"):
        t.add_column(col)
    color = {"running": "green", "finished": "blue", "failed": "red", "stale": "yellow"}
    for r in runs:
        step = f"{r['step']}/{r['total']}" if r["total"] else str(r["step"])
        metrics = "  ".join(f"{k} {_fmt(v)}" for k, v in r["last"].items())
        t.add_row(r["name"], f"[{color.get(r['state'], 'white')}]{r['state']}[/]", step, _duration(r["eta_s"]), metrics)
    return t


def run_status(folder: str, watch: bool, as_json: bool, interval: float = 5.0) -> int:
    from rich.console import Console
    root = Path(folder)
    if not root.exists():
        from retrograd.errors import ConfigError
        raise ConfigError(f"retrograd status: {folder}: no such folder")
    console = Console()
    while True:
        runs = [run_summary(p) for p in find_runs(root)]
        if as_json:
            print(json.dumps([{k: v for k, v in r.items() if k != "all_last"} for r in runs], indent=2))
            return 0
        if watch:
            console.clear()
        if runs:
            console.print(status_table(runs))
        else:
            console.print(f"no runs under {root} (a run folder holds metrics.jsonl)")
        if not watch:
            return 0
        time.sleep(interval)


# ---- diff ------------------------------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _config(folder: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return _flatten(tomllib.loads((folder / "config.toml").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def sparkline(values: list[float], width: int = 24) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return ""
    if len(vals) > width:  # evenly spaced samples
        vals = [vals[round(i * (len(vals) - 1) / (width - 1))] for i in range(width)]
    lo, hi = min(vals), max(vals)
    return "".join(SPARK[0 if hi == lo else int((v - lo) / (hi - lo) * (len(SPARK) - 1))] for v in vals)


def better(metric: str, a: float, b: float) -> str | None:
    """"a", "b" or None (equal, or no direction known for this metric)."""
    if a == b:
        return None
    name = metric.lower()
    if any(t in name for t in HIGHER_BETTER):
        return "a" if a > b else "b"
    if any(t in name for t in LOWER_BETTER):
        return "a" if a < b else "b"
    return None


def diff_runs(a: Path, b: Path) -> dict:
    ca, cb = _config(a), _config(b)
    config = {k: (ca.get(k), cb.get(k)) for k in sorted(set(ca) | set(cb))
              if ca.get(k) != cb.get(k) and not k.startswith(("run.name", "run.directory"))}
    ra, rb = read_rows(a / "metrics.jsonl"), read_rows(b / "metrics.jsonl")
    sa, sb = run_summary(a), run_summary(b)
    metrics = {}
    for k in sorted(set(sa["all_last"]) & set(sb["all_last"])):
        if k.startswith(("system/", "time/")) and k not in ("system/tokens_per_second",):
            continue
        va, vb = sa["all_last"][k], sb["all_last"][k]
        metrics[k] = {"a": va, "b": vb, "winner": better(k, va, vb),
                      "spark_a": sparkline([_num(r.get(k)) for r in ra if k in r]),
                      "spark_b": sparkline([_num(r.get(k)) for r in rb if k in r])}
    return {"a": str(a), "b": str(b), "config": config, "metrics": metrics,
            "steps": (sa["step"], sb["step"]), "states": (sa["state"], sb["state"])}


def _resolve(arg: str, campaign: Path | None) -> Path:
    from retrograd.errors import ConfigError
    p = Path(arg)
    if campaign is not None:
        hits = sorted(campaign.glob(f"runs/{arg}*")) or sorted(campaign.glob(f"runs/{arg}_s*"))
        if hits:
            return hits[0]
    if not (p / "metrics.jsonl").exists() and not (p / "config.toml").exists():
        raise ConfigError(f"retrograd diff: {arg} is not a run folder (no metrics.jsonl or config.toml)")
    return p


def run_diff(first: str, second: str, third: str | None, as_json: bool) -> int:
    """diff RUN_A RUN_B, or diff CAMPAIGN COND_A COND_B (the first seed's run of each condition)."""
    campaign = Path(first) if third else None
    a, b = (_resolve(second, campaign), _resolve(third, campaign)) if third else (_resolve(first, None),
                                                                                  _resolve(second, None))
    d = diff_runs(a, b)
    if as_json:
        print(json.dumps(d, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table
    console = Console()
    console.print(f"[bold]A[/] {a}  ({d['states'][0]}, step {d['steps'][0]})\n[bold]B[/] {b}  "
                  f"({d['states'][1]}, step {d['steps'][1]})")
    t = Table(title="config differences", show_header=True, header_style="bold")
    for col in ("key", "A", "B"):
        t.add_column(col)
    for k, (va, vb) in d["config"].items():
        t.add_row(k, _fmt(va) if va is not None else "(unset)", _fmt(vb) if vb is not None else "(unset)")
    console.print(t if d["config"] else "config: no differences")
    t = Table(title="last values", show_header=True, header_style="bold")
    for col in ("metric", "A", "B", "", "A curve", "B curve"):
        t.add_column(col)
    for k, m in d["metrics"].items():
        mark = {"a": "◀ A", "b": "B ▶"}.get(m["winner"], "")
        t.add_row(k, _fmt(m["a"]), _fmt(m["b"]), mark, m["spark_a"], m["spark_b"])
    console.print(t)
    return 0
