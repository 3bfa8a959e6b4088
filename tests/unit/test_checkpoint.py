"""Atomic .state directories: manifest last, verification, resume selection, mismatch messages."""
import json

import pytest

from retrograd.checkpoint import state as ckpt
from retrograd.errors import CheckpointError


def write_payload(folder):
    (folder / "a.bin").write_bytes(b"hello")
    (folder / "progress.json").write_text(json.dumps({"step": 1}))


def test_save_verify_and_select(tmp_path):
    for step in (2, 10):
        ckpt.save_state(tmp_path, ckpt.step_name(step), write_payload, {"step": step})
    assert (tmp_path / "step-000000000010.state" / "manifest.json").exists()
    manifest = ckpt.verify_state(tmp_path / "step-000000000010.state")
    assert manifest["files"]["a.bin"]["bytes"] == 5
    assert ckpt.find_resume(tmp_path).name == "step-000000000010.state"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_incomplete_and_corrupt_checkpoints_are_refused(tmp_path):
    ckpt.save_state(tmp_path, ckpt.step_name(1), write_payload, {})
    ckpt.save_state(tmp_path, ckpt.step_name(2), write_payload, {})
    # a checkpoint whose manifest never got written is skipped by --resume and refused by path
    (tmp_path / "step-000000000002.state" / "manifest.json").unlink()
    assert ckpt.find_resume(tmp_path).name == "step-000000000001.state"
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.verify_state(tmp_path / "step-000000000002.state")
    (tmp_path / "step-000000000001.state" / "a.bin").write_bytes(b"HELLO")
    with pytest.raises(CheckpointError, match="a.bin does not match its SHA-256"):
        ckpt.verify_state(tmp_path / "step-000000000001.state")
    (tmp_path / "step-000000000001.state" / "a.bin").write_bytes(b"hi")
    with pytest.raises(CheckpointError, match="a.bin has 2 bytes"):
        ckpt.verify_state(tmp_path / "step-000000000001.state")


def test_staging_folders_are_never_picked(tmp_path):
    (tmp_path / ".staging-step-000000000009.state-123").mkdir()
    ckpt.save_state(tmp_path, "best.state", write_payload, {})
    assert ckpt.find_resume(tmp_path).name == "best.state"
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.find_resume(tmp_path / "empty")


def test_replacing_best_keeps_one_complete_copy(tmp_path):
    ckpt.save_state(tmp_path, "best.state", write_payload, {"step": 1})
    ckpt.save_state(tmp_path, "best.state", write_payload, {"step": 2})
    assert ckpt.read_manifest(tmp_path / "best.state")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.state"]


def test_compare_meta_names_what_differs():
    saved = {"algorithm": "sft", "fingerprints": {"model": "aaa", "data": "bbb"},
             "settings": {"training.lr": 0.001, "lora.rank": 8}}
    now = {"algorithm": "sft", "fingerprints": {"model": "aaa", "data": "ccc"},
           "settings": {"training.lr": 0.002, "lora.rank": 8}}
    diffs = ckpt.compare_meta(saved, now)
    assert any(d.startswith("data: content changed") for d in diffs)
    assert "training.lr: checkpoint 0.001, config 0.002" in diffs
    assert len(diffs) == 2
    assert ckpt.compare_meta(saved, saved) == []
