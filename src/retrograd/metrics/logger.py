"""Fan metrics out to the terminal, `metrics.jsonl` in the run folder, and TensorBoard.

Terminal: one plain line per logged step (step/total, loss, lr, tokens/s, ETA) when stdout is not
a TTY, so CI logs stay clean; on a TTY a live bar is redrawn in place and evaluation lines stay
in the scrollback.
metrics.jsonl: one JSON object per step, `{"step": N, "time": ..., "train/loss": ...}`. On resume
the rows after the resumed step (written by the interrupted run after its last checkpoint) are
dropped, so the file reads as one uninterrupted run; a fresh run moves an earlier file aside to
metrics-<time>.jsonl. NaN/inf are written as null.
"""
from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

from retrograd.metrics.tensorboard import EventWriter
from retrograd.metrics.wandb_export import WandbExport


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# the evaluation numbers a terminal line shows first, by loop; other eval/ keys follow, at most MAX_EVAL_SHOWN
EVAL_FIRST = ("eval/loss", "eval/mean_reward", "eval/reward/match", "eval/preference_loss", "eval/reward_accuracy",
              "eval/teacher_kl", "eval/top1_agreement")
MAX_EVAL_SHOWN = 4


def eval_summary(evals: dict, metrics: dict) -> str:
    keys = [k for k in EVAL_FIRST if k in evals] + sorted(k for k in evals if k not in EVAL_FIRST)
    parts = []
    for k in keys[:MAX_EVAL_SHOWN]:
        best = metrics.get("eval/best_" + k.removeprefix("eval/"))
        parts.append(f"{k} {evals[k]:.4f}" + (f" (best {best:.4f})" if _clean(best) is not None else ""))
    return "  ".join(parts)


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, *, tensorboard_dir: str | None = None,
                 wandb_export_dir: str | None = None, config: dict | None = None,
                 run_name: str = "run", log_every: int = 1, resume_step: int = 0, stream=None,
                 verbose: bool = False):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.log_every = log_every
        self.verbose = verbose  # [run] verbose: every logged number on the terminal, each step
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.path = self.run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self._jsonl = open(self.path, "a", encoding="utf-8")
        self._tb = EventWriter(Path(tensorboard_dir) / run_name, resume_step) if tensorboard_dir else None
        self._wandb = WandbExport(wandb_export_dir, run_name, config or {}, resume_step) if wandb_export_dir else None
        self._t0 = time.monotonic()
        self._step0 = resume_step
        self._bar_open = False
        self._status = {"state": "running", "pid": os.getpid(), "host": socket.gethostname(), "run": run_name,
                        "total_steps": total_steps, "start_step": resume_step, "started": round(time.time(), 3)}
        self._write_status()

    def _write_status(self) -> None:
        """status.json: what `retrograd status` reads (state, pid, total steps), replaced atomically."""
        tmp = self.run_dir / f".status.json.{os.getpid()}"
        tmp.write_text(json.dumps(self._status), encoding="utf-8")
        os.replace(tmp, self.run_dir / "status.json")

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        if step == 0:  # a fresh run: keep the earlier run's file rather than overwrite it
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.path.stat().st_mtime))
            self.path.rename(self.path.with_name(f"metrics-{stamp}.jsonl"))
            return
        keep = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:
                continue  # a line cut by a kill mid-write
        self.path.write_text("".join(k + "\n" for k in keep), encoding="utf-8")

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb:
            self._tb.add_scalars(step, {k: v for k, v in metrics.items() if _clean(v) is not None})
        if self._wandb:
            self._wandb.log(step, metrics)
        if "train/loss" in metrics and (step % self.log_every == 0 or step == self.total):
            self._progress(step, metrics)
            if self.verbose:
                self.print("  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in sorted(metrics.items())))
        evals = {k: v for k, v in metrics.items() if k.startswith("eval/") and not k.startswith("eval/best_")
                 and isinstance(v, (int, float)) and _clean(v) is not None}
        if evals:
            self.print(f"eval  step {step}/{self.total}  " + eval_summary(evals, metrics))

    def _progress(self, step: int, m: dict) -> None:
        done = step - self._step0
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        rl = ""  # what an RL user watches: the mean reward, and the accuracy when a match reward exists
        if _clean(m.get("reward/mean")) is not None:
            rl = f"reward {m['reward/mean']:.3f}  "
            if _clean(m.get("reward/match/mean")) is not None:
                rl += f"acc {m['reward/match/mean']:.3f}  "
        text = (f"step {step}/{self.total}  loss {m['train/loss']:.4f}  {rl}lr {m.get('optimizer/lr', 0):.2e}  "
                f"tok/s {m.get('system/tokens_per_second', 0):.0f}  eta {_fmt_duration(eta)}")
        if self.tty:
            width = 24
            filled = int(width * step / max(1, self.total))
            self.stream.write("\r\x1b[2K[" + "#" * filled + "-" * (width - filled) + "] " + text)
            self._bar_open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def print(self, text: str) -> None:
        """A line that stays (not overwritten by the live bar)."""
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self, state: str = "finished") -> None:
        """`state` (finished | stopped | early_stopped) is what the W&B export and status.json record."""
        self._status.update(state=state, ended=round(time.time(), 3))
        self._write_status()
        if self._wandb:
            self._wandb.finish(state)
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        self._jsonl.close()
        if self._tb:
            self._tb.close()
