"""Helpers of the 2-process torchrun tests (tests/distributed): launch `retrograd train --nproc N` as a user
does, read what the runs wrote, find a rank's process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

CKPT = '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 2\n'
LONG_CKPT = '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 10\n'


def launch(cwd: Path, *args, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "retrograd", "train", *map(str, args)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def run(cwd: Path, *args, nproc: int = 2, timeout: int = 240) -> tuple[int, str]:
    p = launch(cwd, *args, nproc=nproc)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def train_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def overrides(tag: str) -> list[str]:
    return ["--set", f'run.directory="runs/{tag}"', "--set", f'checkpoint.directory="ckpt-{tag}"',
            "--set", f'output.path="out-{tag}/adapter"']


def run_cli(cwd: Path, *args) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "retrograd", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       timeout=240)
    return p.returncode, p.stdout + p.stderr


def rank_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of `rank`'s worker among torchrun's children (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == torchrun.pid and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} found")


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (path / "manifest.json").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def completions(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    return [(r["step"], r["prompt"], r["completion"], r["reward"]) for r in rows]


def assert_same_metrics(tmp_path: Path, keys: tuple[str, ...], tags: tuple[str, str] = ("one", "two")) -> None:
    """Every logged value of `keys` in runs/<tag>/metrics.jsonl equal between the two runs to 1e-5."""
    import pytest
    rows = {tag: [json.loads(x) for x in (tmp_path / f"runs/{tag}/metrics.jsonl").read_text().splitlines()]
            for tag in tags}
    for key in keys:
        a = [r[key] for r in rows[tags[0]] if key in r]
        b = [r[key] for r in rows[tags[1]] if key in r]
        assert len(a) == len(b) > 0 and all(x == pytest.approx(y, abs=1e-5) for x, y in zip(a, b)), key


def kill_a_rank_then_resume(cwd: Path, cfg: Path, sets: list[str], checkpoint: Path) -> str:
    """Launch on 2 ranks, SIGKILL rank 1 once `checkpoint` is complete, check torchrun stops the other
    rank without writing an output, then --resume; returns the resumed run's output."""
    import signal
    p = launch(cwd, cfg, *sets)
    wait_for(checkpoint, p)
    os.kill(rank_pid(p, 1), signal.SIGKILL)
    out, _ = p.communicate(timeout=90)
    assert p.returncode != 0 and "wrote " not in out
    code, out = run(cwd, cfg, *sets, "--resume")
    assert code == 0 and "resumed from" in out and "wrote " in out, out
    return out
