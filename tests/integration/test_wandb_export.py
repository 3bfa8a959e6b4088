"""`[metrics] wandb_export_dir` writes an offline export without wandb; scripts/import_wandb.py
replays it through the real wandb SDK (offline mode here) with steps, config and summary kept,
and refuses a half-written export."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import write_run

ROOT = Path(__file__).resolve().parents[2]
EXTRA = """
[evaluation]
data = "eval.jsonl"
every_steps = 2
[metrics]
wandb_export_dir = "wb"
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 2
"""


def importer(*args, cwd, env_extra=None):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(cwd), "WANDB_SILENT": "true",
           "HOME": str(cwd), **(env_extra or {})}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "import_wandb.py"), *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_export_then_import_with_wandb_offline(tmp_path, tiny_model, cli):
    pytest.importorskip("wandb")
    cfg = write_run(tmp_path, tiny_model, EXTRA, steps=4)
    proc = cli("train", cfg, check=0)
    assert "wandb" not in proc.stderr.lower()
    export = tmp_path / "wb" / "run"
    run = json.loads((export / "run.json").read_text())
    assert run["state"] == "finished" and run["config"]["training"]["lr"] == 0.01
    rows = [json.loads(x) for x in (export / "history.jsonl").read_text().splitlines()]
    assert [r["_step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]

    proc = importer(export, "--project", "my-project", "--name", "tiny-sft", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    from wandb_reader import read_run
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    got = read_run(runs[0])
    assert got["project"] == "my-project" and got["name"] == "tiny-sft"
    assert got["config"]["training"]["lr"] == 0.01 and got["config"]["lora"]["rank"] == 4
    steps = [h["_step"] for h in got["history"]]
    assert steps == [0, 1, 2, 3, 4]  # step 0 holds the base model's eval loss
    by_step = {h["_step"]: h for h in got["history"]}
    train = {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r}
    for step, loss in train.items():
        assert by_step[step]["train/loss"] == pytest.approx(loss)
        assert by_step[step]["train/global_step"] == step
    assert "eval/loss" in by_step[2] and "train/loss" in by_step[2]  # same-step rows merged
    assert got["summary"]["train/loss"] == pytest.approx(train[4])
    # a second upload is a no-op thanks to the marker
    again = importer(export, "--project", "my-project", cwd=tmp_path)
    assert again.returncode == 0 and "already uploaded" in again.stdout


def test_half_written_export_is_refused(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, EXTRA, steps=4)
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000004.state"})
    assert killed.returncode != 0
    proc = importer(tmp_path / "wb", "--project", "p", cwd=tmp_path)
    assert proc.returncode == 2 and "half-written" in proc.stderr and "Traceback" not in proc.stderr
    # after the resume the run ends and the export is complete, with the rows of one uninterrupted run
    cli("train", cfg, "--resume", check=0)
    rows = [json.loads(x) for x in (tmp_path / "wb" / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["_step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "wb" / "run" / "run.json").read_text())["state"] == "finished"


def test_training_never_imports_wandb(tmp_path):
    code = ("import sys; import retrograd.train.sft; from retrograd.metrics import MetricsLogger; "
            f"m = MetricsLogger({str(tmp_path)!r}, 1, wandb_export_dir={str(tmp_path / 'wb')!r}); "
            "m.log(1, {'train/loss': 1.0}); m.close(); print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr
