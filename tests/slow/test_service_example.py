"""The seed's workflow end to end on the built-in SmolLM2: `retrograd serve`, then
examples/service/train_sft.py through the unmodified tinker SDK -- train and save, resume from
latest-checkpoint.json with optimizer state, --verify-download and --sample -- and the downloaded
checkpoint exported to a llama.cpp adapter."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service_util import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "service" / "train_sft.py"


def _example(server: ServeProcess, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": server.key, "TINKER_TELEMETRY": "0"}
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_example_train_resume_verify_and_sample(tmp_path, real_home):
    server = ServeProcess(tmp_path / "state", "smollm2-135m-instruct")
    try:
        first = _example(server, "--max-steps", "4", "--batch-size", "2", "--save-every", "2", "--sample",
                         "--output-dir", str(tmp_path / "run1"))
        assert first.returncode == 0, first.stderr[-3000:]
        locator = json.loads((tmp_path / "run1" / "latest-checkpoint.json").read_text())
        assert locator["step"] == 4 and locator["model"] == "smollm2-135m-instruct"
        assert locator["path"].endswith("/weights/step-000004")
        sample = json.loads((tmp_path / "run1" / "sample.json").read_text())
        assert sample["model_path"].startswith("tinker://") and sample["tokens"]

        bad = _example(server, "--resume-from", locator["path"], "--start-step", "4", "--max-steps", "4",
                       "--output-dir", str(tmp_path / "bad"))
        assert bad.returncode == 2 and "must exceed --start-step" in bad.stderr
        other = tmp_path / "other.jsonl"  # another dataset: the checkpoint's metadata refuses it
        other.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
        wrong = _example(server, "--resume-from", locator["path"], "--start-step", "4", "--max-steps", "6",
                         "--dataset", str(other), "--skip-sample", "--output-dir", str(tmp_path / "wrong"))
        assert wrong.returncode == 2 and "was trained on 'builtin:chat-sft'" in wrong.stderr

        second = _example(server, "--resume-from", locator["path"], "--start-step", "4", "--max-steps", "6",
                          "--batch-size", "2", "--save-every", "1", "--skip-sample", "--verify-download",
                          "--output-dir", str(tmp_path / "run2"))
        assert second.returncode == 0, second.stderr[-3000:]
        assert "step 5/6" in second.stdout and "step 1/" not in second.stdout  # resumed, not restarted
        report = json.loads((tmp_path / "run2" / "durable-verification.json").read_text())
        assert report["verified"] and report["step"] == 6
        folder = tmp_path / "run2" / "verified-checkpoint"
        assert set(report["files"]) == {p.name for p in folder.iterdir()}
        for name, info in report["files"].items():
            data = (folder / name).read_bytes()
            assert len(data) == info["expected_bytes"] and hashlib.sha256(data).hexdigest() == info["expected_sha256"]
        # the resumed run continues the checkpoint's step count (4 + 2)
        assert json.loads((folder / "progress.json").read_text())["step"] == 6

        listed = subprocess.run([sys.executable, "-m", "retrograd", "checkpoint", "list", "--session-id",
                                 locator["path"].split("/")[2].split(":")[0], "--base-url", server.url,
                                 "--api-key", server.key], capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0 and locator["path"] in listed.stdout
    finally:
        server.stop()

    # a downloaded service checkpoint is a .state folder: `retrograd export` turns it into a llama.cpp adapter
    out = tmp_path / "adapter.gguf"
    r = subprocess.run([sys.executable, "-m", "retrograd", "export", str(folder), "--format", "gguf", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.stat().st_size > 0
