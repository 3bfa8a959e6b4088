"""The unmodified tinker-cookbook loops against `retrograd serve` on the built-in SmolLM2: the
supervised loop (what sl_basic wraps) with its evals, checkpoints and resume into a second epoch,
and the RL loop (what rl_basic wraps) on the cookbook's arithmetic env. The driver is
tests/slow/cookbook_driver.py (offline configuration only; cookbook code runs as released)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service_util import ServeProcess, rest

DRIVER = Path(__file__).resolve().parent / "cookbook_driver.py"


def _drive(mode: str, server: ServeProcess, log: Path, *extra: str) -> subprocess.CompletedProcess:
    from retrograd.models.builtin import DEFAULT_MODEL
    from retrograd.models.load import load_model
    tokenizer_dir = load_model(DEFAULT_MODEL, log=lambda *_: None).model.name_or_path
    r = subprocess.run([sys.executable, str(DRIVER), mode, "--base-url", server.url, "--api-key", server.key,
                        "--model", DEFAULT_MODEL, "--tokenizer", tokenizer_dir, "--log-path", str(log), *extra],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "TINKER_TELEMETRY": "0"})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_cookbook_supervised_and_rl_loops(tmp_path, real_home):
    server = ServeProcess(tmp_path / "state", "smollm2-135m-instruct")
    try:
        sft = tmp_path / "sft"
        _drive("sft", server, sft, "--rolling-save-every", "3")  # rolling saves DELETE their predecessor
        metrics = _rows(sft / "metrics.jsonl")
        nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
        test_nll = [m["test/nll"] for m in metrics if "test/nll" in m]
        assert len(nll) == 8 and sum(nll[-2:]) < sum(nll[:2])  # it learns
        assert len(test_nll) >= 3 and test_nll[-1] < test_nll[0]  # held-out NLL through the sampler's logprobs
        final = [c for c in _rows(sft / "checkpoints.jsonl") if c.get("name") == "final"]
        assert final and final[0]["state_path"].endswith("/weights/final")

        # resume into a second epoch: the cookbook restores state + optimizer through create-via-load
        second = _drive("sft", server, sft, "--num-epochs", "2")
        out = second.stdout + second.stderr
        assert "Resumed training from" in out and "Renderer metadata matches" in out
        rolling = [c for c in _rows(sft / "checkpoints.jsonl") if c.get("rolling")]
        run_id = final[0]["state_path"].split("/")[2]
        listed = {c.tinker_path for c in rest(server.url, server.key).list_checkpoints(run_id).result().checkpoints}
        assert rolling and not any(c["state_path"] in listed for c in rolling[:-1])  # deleted by the loop
        assert len([m for m in _rows(sft / "metrics.jsonl") if "train_mean_nll" in m]) == 16

        rl = tmp_path / "rl"
        _drive("rl", server, rl, "--steps", "1")
        resumed = _drive("rl", server, rl)  # resumes at batch 1 and finishes batch 2
        assert "Resum" in resumed.stdout + resumed.stderr
        rl_ckpts = _rows(rl / "checkpoints.jsonl")
        assert [c["batch"] for c in rl_ckpts if c["name"] != "final"] == [1, 2]
        assert [c["name"] for c in rl_ckpts][-1] == "final"
        assert any("env/all/reward/total" in m for m in _rows(rl / "metrics.jsonl"))
        # what the loops saved is in the server's registry
        run_id = rl_ckpts[-1]["state_path"].split("/")[2]
        listed = {c.tinker_path for c in rest(server.url, server.key).list_checkpoints(run_id).result().checkpoints}
        assert rl_ckpts[-1]["state_path"] in listed and rl_ckpts[-1]["sampler_path"] in listed
    finally:
        server.stop()
