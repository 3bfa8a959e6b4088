"""An offline export of a run for Weights & Biases, written with the standard library only
(training never imports wandb and needs no network or account). Upload it later with
`WANDB_API_KEY=... python3 scripts/import_wandb.py DIR --project P`.

Layout of `<wandb_export_dir>/<run name>/` (format `retrograd-wandb-export/1`):
  run.json        name, config (nested tables), state: running | finished | stopped | early_stopped,
                  started / ended times; rewritten atomically at the start and at the end
  history.jsonl   one object per logged step: {"_step": N, "_timestamp": t, "train/loss": ...}
  summary.json    the last value of every metric, written when the run ends

A run killed mid-way leaves state "running": the importer refuses it until the run is resumed and
ends. On resume the history rows after the resumed step are dropped, as in metrics.jsonl.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

FORMAT = "retrograd-wandb-export/1"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def _clean(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


class WandbExport:
    def __init__(self, root: str | Path, run_name: str, config: dict, resume_step: int = 0):
        self.dir = Path(root) / run_name
        if resume_step == 0 and self.dir.exists():  # a fresh run keeps the earlier export beside it
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.dir.stat().st_mtime))
            os.replace(self.dir, self.dir.with_name(f"{run_name}-{stamp}"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history = self.dir / "history.jsonl"
        self.summary: dict = {}
        if resume_step and self.history.exists():
            kept = []
            for line in self.history.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if row.get("_step", 0) <= resume_step:
                    kept.append(line)
                    self.summary.update({k: v for k, v in row.items() if not k.startswith("_")})
            self.history.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        run_file = self.dir / "run.json"
        started = json.loads(run_file.read_text()).get("started") if resume_step and run_file.exists() else None
        self.run = {"format": FORMAT, "name": run_name, "config": config, "state": "running",
                    "started": started or time.time()}
        _write_json(run_file, self.run)
        self._f = open(self.history, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict) -> None:
        row = {"_step": step, "_timestamp": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        self.summary.update({k: _clean(v) for k, v in metrics.items()})

    def finish(self, state: str) -> None:
        self._f.close()
        _write_json(self.dir / "summary.json", self.summary)
        _write_json(self.dir / "run.json", {**self.run, "state": state, "ended": time.time()})
