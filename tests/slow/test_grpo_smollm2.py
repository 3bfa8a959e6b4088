"""examples/grpo.toml, shortened to 10 updates, on the real SmolLM2, from two seeds: the held-out
exact-answer rate of greedy completions (all 64 held-out questions) rises, and the run's artifacts are there."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _train(run_dir: Path, threads: str, seed: int) -> list[dict]:
    run_dir.mkdir()
    shutil.copy(ROOT / "examples" / "grpo.toml", run_dir / "grpo.toml")
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", "grpo.toml", "--threads", threads,
                           "--set", "grpo.updates=10", "--set", "evaluation.max_examples=64",
                           "--set", f"training.seed={seed}", "--set", f"grpo.sampling.seed={seed}"],
                          cwd=run_dir, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in (run_dir / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean_reward" in r]
    assert [r["step"] for r in evals] == [0, 10]
    return evals


def test_grpo_example_raises_held_out_accuracy(tmp_path, real_home, threads):
    gains = {}
    for seed in (42, 7):
        evals = _train(tmp_path / f"seed{seed}", threads, seed)
        gains[seed] = evals[-1]["eval/reward/match"] - evals[0]["eval/reward/match"]
    # Measured 2026-12-05 on the Xeon (of 64 answers): seed 42 +10 with 2 threads, +8 with 1 thread
    # (pytest-xdist's share of 2 cores); seed 7 +6 and +8. The thread count changes the float rounding
    # and so the sampled trajectory, which is why one seed on 32 questions was too noisy a judge.
    assert all(g > 0 for g in gains.values()), gains
    assert sum(gains.values()) / len(gains) >= 0.1 - 1e-9, gains
    run = tmp_path / "seed42"
    assert (run / "out" / "grpo-checkpoints" / "best.state").is_dir()
    assert len((run / "runs" / "grpo" / "completions.jsonl").read_text().splitlines()) == 10 * 4 * 8
