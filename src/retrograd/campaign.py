"""`retrograd campaign campaign.toml [--resume]`: conditions x seeds from one file, each run in its own folder.

campaign.toml is a run config plus:

    [campaign]
    seeds = [42, 43]
    max_steps = 40                   # optional: training.max_steps (and the updates of GRPO / PPO / distill)
    parallel = true                  # run several at once (subprocesses), the CPU threads divided between them
    max_workers = 2                  # default: as many as there are cores, at most the number of runs
    stagger_seconds = 0              # pause between launches
    metrics = ["eval/mean_reward"]   # summary columns (default: the headline metrics the runs logged)
    directory = "campaigns/NAME"     # default: campaigns/<file stem> beside the file
    [[campaign.conditions]]
    label = "maxrl"
    set = { "grpo.advantage_mode" = "maxrl" }   # overrides of any key, as --set
    [squeeze]                        # optional: LoRA-Squeeze the first finished run's adapter
    target_ranks = [1, 2, 4, 8]
    min_retention = 0.95

Every run gets its own folder runs/<label>_s<seed>/ holding its resolved run.toml (absolute paths, so it
can be rerun alone), metrics, checkpoints and output: no path is shared between runs (retrain's campaigns
wrote every run's adapter to one path). manifest.json (replaced atomically after every change) records
each run's state; `--resume` finishes what is unfinished: runs with checkpoints continue from them, the
others start. At the end: a table of each condition's mean +- std over seeds of the chosen metrics'
final values, written to summary.csv too.
"""
from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from retrograd.errors import ConfigError

CAMPAIGN_KEYS = {"seeds", "max_steps", "parallel", "max_workers", "stagger_seconds", "metrics", "directory",
                 "conditions"}
SQUEEZE_KEYS = {"target_ranks", "min_retention"}


@dataclass
class Plan:
    source: Path
    folder: Path
    runs: list[dict]  # name, condition, seed, folder, overrides
    parallel: bool
    workers: int
    stagger: float
    metrics: list[str] | None
    squeeze: dict | None
    max_steps: int | None


def _toml(path: Path) -> dict:
    from retrograd.config.load import _parse_toml
    return _parse_toml(path)


def _dump_value(v) -> str:
    from retrograd.config.load import _toml_value
    return _toml_value(v)


def plan(path: str) -> Plan:
    src = Path(path).resolve()
    raw = _toml(src)
    camp = raw.get("campaign")
    if not isinstance(camp, dict):
        raise ConfigError(f"{src}: a campaign file needs a [campaign] table (seeds, [[campaign.conditions]])")
    unknown = set(camp) - CAMPAIGN_KEYS
    if unknown:
        raise ConfigError(f"{src}: unknown key campaign.{sorted(unknown)[0]}; valid: {', '.join(sorted(CAMPAIGN_KEYS))}")
    seeds = camp.get("seeds", [42])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"{src}: campaign.seeds must be a non-empty list of integers")
    conds = camp.get("conditions")
    if not isinstance(conds, list) or not conds:
        raise ConfigError(f"{src}: add at least one [[campaign.conditions]] table (label and set)")
    labels = set()
    for i, c in enumerate(conds):
        where = f"{src}: campaign.conditions[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("label"), str) or not c["label"].strip():
            raise ConfigError(f"{where} needs a label")
        if set(c) - {"label", "set"}:
            raise ConfigError(f"{where}: unknown key {sorted(set(c) - {'label', 'set'})[0]!r} (label, set)")
        if not isinstance(c.get("set", {}), dict):
            raise ConfigError(f"{where}.set must be a table of key = value overrides")
        if c["label"] in labels or not all(ch.isalnum() or ch in "-_.+" for ch in c["label"]):
            raise ConfigError(f"{where}: label {c['label']!r} must be unique and use letters, digits, - _ . +")
        labels.add(c["label"])
    squeeze = raw.get("squeeze")
    if squeeze is not None and (not isinstance(squeeze, dict) or set(squeeze) - SQUEEZE_KEYS):
        raise ConfigError(f"{src}: [squeeze] takes {', '.join(sorted(SQUEEZE_KEYS))}")
    folder = Path(camp.get("directory") or f"campaigns/{src.stem}")
    folder = folder if folder.is_absolute() else src.parent / folder
    runs = [{"name": f"{c['label']}_s{seed}", "condition": c["label"], "seed": seed,
             "folder": f"runs/{c['label']}_s{seed}", "overrides": dict(c.get("set", {}))}
            for seed in seeds for c in conds]  # seed-major: a partial campaign has every condition once
    workers = int(camp.get("max_workers") or (os.cpu_count() or 1))
    return Plan(src, folder.resolve(), runs, bool(camp.get("parallel", False)), max(1, min(workers, len(runs))),
                float(camp.get("stagger_seconds", 0)), camp.get("metrics"), squeeze, camp.get("max_steps"))


def write_run_config(p: Plan, run: dict, threads: int) -> Path:
    """The run's resolved config (absolute paths, its own folders) in its folder; checked now, not later."""
    from retrograd.config.load import dump_toml, load_config
    raw = {k: v for k, v in _toml(p.source).items() if k not in ("campaign", "squeeze")}
    algo = raw.get("run", {}).get("algorithm")
    rdir = p.folder / run["folder"]
    sets = dict(run["overrides"])
    sets["training.seed"] = run["seed"]
    if algo in ("grpo", "ppo") or (algo == "distill" and raw.get("distill", {}).get("mode", "on_policy") == "on_policy"):
        sets[f"{algo}.sampling.seed"] = run["seed"]
    if p.max_steps:
        sets["training.max_steps"] = p.max_steps
        if algo in ("grpo", "ppo", "distill") and "updates" in raw.get(algo, {}):
            sets[f"{algo}.updates"] = p.max_steps
    out = str(raw.get("output", {}).get("path", "output"))
    sets.update({"run.name": run["name"], "run.directory": str(rdir),
                 "output.path": str(rdir / ("output.gguf" if out.endswith(".gguf") else "output")),
                 "training.threads": threads})
    if "checkpoint" in raw:
        sets["checkpoint.directory"] = str(rdir / "checkpoints")
    metrics = raw.get("metrics", {})
    if metrics.get("tensorboard_dir"):
        sets["metrics.tensorboard_dir"] = str(p.folder / "tensorboard")
    if metrics.get("wandb_export_dir"):
        sets["metrics.wandb_export_dir"] = str(rdir / "wandb")
    tmp = p.source.parent / f".campaign-{os.getpid()}-{run['name']}.toml"  # relative paths resolve as in the file
    try:
        tmp.write_text("\n".join(f"[{t}]\n" + "\n".join(f"{json.dumps(k)} = {_dump_value(v)}" for k, v in body.items())
                                 if isinstance(body, dict) else "" for t, body in raw.items()) + "\n", encoding="utf-8")
        cfg = load_config(tmp, [f"{k}={json.dumps(v)}" for k, v in sets.items()])
    except ConfigError as e:
        raise ConfigError(f"{p.source}: run {run['name']}: {str(e).replace(str(tmp), 'the campaign config')}") from None
    finally:
        tmp.unlink(missing_ok=True)
    rdir.mkdir(parents=True, exist_ok=True)
    path = rdir / "run.toml"
    path.write_text(dump_toml(cfg).replace(str(tmp), str(p.source)), encoding="utf-8")
    return path


class Manifest:
    def __init__(self, p: Plan, resume: bool):
        self.path = p.folder / "manifest.json"
        if self.path.exists() and not resume:
            raise ConfigError(f"{p.folder} already holds a campaign; finish it with --resume, or set "
                              "campaign.directory to start another")
        old = json.loads(self.path.read_text()) if resume and self.path.exists() else {}
        states = {r["name"]: r for r in old.get("runs", [])}
        self.data = {"campaign": str(p.source), "created": old.get("created", time.strftime("%Y-%m-%dT%H:%M:%S")),
                     "runner_pid": os.getpid(), "seeds": sorted({r["seed"] for r in p.runs}),
                     "conditions": list(dict.fromkeys(r["condition"] for r in p.runs)),
                     "runs": [{**{k: v for k, v in r.items() if k != "overrides"}, "set": r["overrides"],
                               "state": states.get(r["name"], {}).get("state", "pending"),
                               **{k: states.get(r["name"], {}).get(k) for k in ("returncode", "started", "ended")}}
                              for r in p.runs]}
        self.save()

    def run(self, name: str) -> dict:
        return next(r for r in self.data["runs"] if r["name"] == name)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".manifest.json.{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def run_campaign(path: str, resume: bool, log=print) -> int:
    p = plan(path)
    manifest = Manifest(p, resume)
    threads = max(1, (os.cpu_count() or 1) // (p.workers if p.parallel else 1))
    todo = [r for r in p.runs if manifest.run(r["name"])["state"] != "finished"]
    configs = {r["name"]: write_run_config(p, r, threads) for r in todo}  # every config checked before any run
    log(f"campaign {p.source.name}: {len(p.runs)} runs ({len(todo)} to do) in {p.folder}; "
        f"{p.workers if p.parallel else 1} at a time, {threads} threads each")
    live: dict[str, subprocess.Popen] = {}
    squeezed = manifest.data.get("squeeze") is not None
    pending = list(todo)
    try:
        while pending or live:
            while pending and len(live) < (p.workers if p.parallel else 1):
                r = pending.pop(0)
                live[r["name"]] = _launch(p, r, configs[r["name"]], manifest)
                if p.stagger and pending:
                    time.sleep(p.stagger)
            time.sleep(0.2)
            for name, proc in list(live.items()):
                if proc.poll() is None:
                    continue
                del live[name]
                entry = manifest.run(name)
                entry.update(state="finished" if proc.returncode == 0 else "failed", returncode=proc.returncode,
                             ended=time.strftime("%Y-%m-%dT%H:%M:%S"))
                manifest.save()
                log(f"  {name}: {entry['state']}" + (f" (exit {proc.returncode}; see {p.folder / entry['folder']}"
                                                     "/stderr.log)" if proc.returncode else ""))
                if entry["state"] == "finished" and p.squeeze is not None and not squeezed:
                    squeezed = _squeeze_first(p, entry, manifest, log)
    except KeyboardInterrupt:
        for proc in live.values():
            proc.terminate()  # each run saves a checkpoint on SIGTERM; --resume continues them
        for proc in live.values():
            proc.wait()
        raise
    table = summary(p, manifest)
    failed = [r["name"] for r in manifest.data["runs"] if r["state"] != "finished"]
    log(f"summary written to {p.folder / 'summary.csv'}" + (f"; failed: {', '.join(failed)} (--resume retries "
                                                            "them)" if failed else ""))
    from rich.console import Console
    Console().print(table)
    return 1 if failed else 0


def _launch(p: Plan, run: dict, config: Path, manifest: Manifest) -> subprocess.Popen:
    rdir = config.parent
    args = [sys.executable, "-m", "retrograd", "train", str(config)]
    if any((rdir / "checkpoints").glob("*.state")):
        args.append("--resume")  # an interrupted run continues from its checkpoint
    entry = manifest.run(run["name"])
    entry.update(state="running", started=time.strftime("%Y-%m-%dT%H:%M:%S"), returncode=None, ended=None)
    out = open(rdir / "stdout.log", "a", encoding="utf-8")
    err = open(rdir / "stderr.log", "a", encoding="utf-8")
    proc = subprocess.Popen(args, stdout=out, stderr=err, cwd=p.source.parent,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out.close()
    err.close()
    entry["pid"] = proc.pid
    manifest.save()
    return proc


def _squeeze_first(p: Plan, entry: dict, manifest: Manifest, log) -> bool:
    from retrograd.export.squeeze import analyse, read_lora
    out = p.folder / entry["folder"] / "output"
    if not out.exists():
        out = out.with_suffix(".gguf")
    try:
        report, _ = analyse(read_lora(out), p.squeeze.get("target_ranks"), float(p.squeeze.get("min_retention", 0.95)))
    except ConfigError as e:
        manifest.data["squeeze"] = {"run": entry["name"], "error": str(e)}
        manifest.save()
        return True
    manifest.data["squeeze"] = {"run": entry["name"], "recommended_rank": report.recommended,
                                "mean_retained": report.mean}
    manifest.save()
    log(f"  squeeze of {entry['name']}: recommended rank {report.recommended} "
        f"(mean retained {', '.join(f'{k}: {v:.3f}' for k, v in report.mean.items())})")
    return True


def summary(p: Plan, manifest: Manifest):
    from rich.table import Table

    from retrograd.cli.status import HEADLINE, run_summary
    finals: dict[str, dict[str, list[float]]] = {}
    logged: set[str] = set()
    for r in manifest.data["runs"]:
        s = run_summary(p.folder / r["folder"])
        logged |= set(s["all_last"])
        for k, v in s["all_last"].items():
            finals.setdefault(r["condition"], {}).setdefault(k, []).append(v)
    metrics = p.metrics or [m for m in HEADLINE if m in logged]
    rows = []
    for cond in manifest.data["conditions"]:
        row = {"condition": cond, "runs": len(finals.get(cond, {}).get(metrics[0], [])) if metrics else 0}
        for m in metrics:
            vals = finals.get(cond, {}).get(m, [])
            row[f"{m} mean"] = statistics.mean(vals) if vals else None
            row[f"{m} std"] = statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else None)
        rows.append(row)
    with open(p.folder / "summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["condition"])
        w.writeheader()
        w.writerows(rows)
    t = Table(title=f"campaign {p.source.name}: final values, mean ± std over seeds", header_style="bold")
    t.add_column("condition")
    t.add_column("runs")
    for m in metrics:
        t.add_column(m)
    for row in rows:
        t.add_row(row["condition"], str(row["runs"]), *(
            "?" if row[f"{m} mean"] is None else f"{row[f'{m} mean']:.4g} ± {row[f'{m} std']:.2g}" for m in metrics))
    return t
