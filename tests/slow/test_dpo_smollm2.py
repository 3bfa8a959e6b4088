"""examples/dpo.toml, shortened, on the real SmolLM2: held-out preference accuracy and loss
improve within a dozen steps on the shipped preference data."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_dpo_example_raises_held_out_accuracy(tmp_path, real_home, threads):
    shutil.copy(ROOT / "examples" / "dpo.toml", tmp_path / "dpo.toml")
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", "dpo.toml", "--threads", threads,
                           "--set", "training.max_steps=12", "--set", "evaluation.every_steps=12",
                           "--set", "evaluation.max_examples=24", "--set", "checkpoint.every_steps=12"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/preference_loss" in r]
    assert evals[0]["eval/accuracy"] == 0.5 and abs(evals[0]["eval/preference_loss"] - 0.6931) < 1e-3
    assert evals[-1]["eval/accuracy"] >= 0.8 and evals[-1]["eval/preference_loss"] < 0.55
    assert (tmp_path / "out" / "dpo-checkpoints" / "preference-reference.bin").is_file()
    assert (tmp_path / "out" / "dpo-checkpoints" / "step-000000000012.gguf").is_file()
