"""Resume is exact: N steps straight == N/2, SIGKILL, --resume, N/2 (weights bit for bit, same
logged losses), also mid-epoch with shuffling and dropout on; mismatches and corruption refused."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tiny import write_run

STEPS = 10  # 24 rows, 4 rows per step: step 5 ends mid-epoch (row 20 of 24), step 6 starts epoch 2
EXTRA = """
[training]
threads = 2
lr_scheduler = "linear"
warmup_steps = 2
weight_decay = 0.01
[evaluation]
data = "eval.jsonl"
every_steps = 3
[checkpoint]
directory = "ckpt"
mode = "steps_and_best_eval"
every_steps = 5
"""


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in rows]


def weights(folder):
    return load_file(folder / "adapter_model.safetensors")


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model):
    from tiny import CLI
    d = tmp_path_factory.mktemp("straight")
    CLI(d)("train", write_run(d, tiny_model, EXTRA, steps=STEPS), check=0)
    return d


def test_kill_and_resume_is_bit_exact(tmp_path, tiny_model, cli, straight):
    cfg = write_run(tmp_path, tiny_model, EXTRA, steps=STEPS)
    cli.cwd = tmp_path
    # SIGKILL the run while it saves step 10: step 5 is the last complete checkpoint
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000010.state"})
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "out" / "adapter").exists()
    assert not (tmp_path / "ckpt" / "step-000000000010.state").exists()
    resumed = cli("train", cfg, "--resume", check=0)
    assert "resumed from" in resumed.stdout and "at step 5 (epoch 0, row 20 of 24)" in resumed.stdout
    assert_bit_identical(weights(straight / "out" / "adapter"), weights(tmp_path / "out" / "adapter"))
    assert losses(straight / "runs" / "run") == losses(tmp_path / "runs" / "run")
    a = load_file(straight / "ckpt" / "step-000000000010.state" / "weights.safetensors")
    b = load_file(tmp_path / "ckpt" / "step-000000000010.state" / "weights.safetensors")
    assert_bit_identical(a, b)


def test_resume_from_an_explicit_path_and_from_best(tmp_path, tiny_model, cli, straight):
    cfg = write_run(tmp_path, tiny_model, EXTRA, steps=STEPS)
    cli.cwd = tmp_path
    cli("train", cfg, check=0)
    proc = cli("train", cfg, "--resume", tmp_path / "ckpt" / "step-000000000005.state", check=0)
    assert "at step 5" in proc.stdout
    assert_bit_identical(weights(straight / "out" / "adapter"), weights(tmp_path / "out" / "adapter"))
    best_step = json.loads((tmp_path / "ckpt" / "best.state" / "progress.json").read_text())["step"]
    assert best_step in (3, 6, 9, 10)


def test_sigterm_saves_and_resume_continues_exactly(tmp_path, tiny_model, cli):
    extra = EXTRA.replace("every_steps = 5", "every_steps = 1000").replace("every_steps = 3", "every_steps = 1000")
    straight_dir = tmp_path / "a"
    straight_dir.mkdir()
    cli.cwd = straight_dir
    cli("train", write_run(straight_dir, tiny_model, extra, steps=80), check=0)

    d = tmp_path / "b"
    d.mkdir()
    cfg = write_run(d, tiny_model, extra, steps=80)
    proc = subprocess.Popen([sys.executable, "-m", "retrograd", "train", str(cfg)], cwd=d,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = d / "runs" / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received" in err
    saved = [p.name for p in (d / "ckpt").iterdir() if p.name.endswith(".state")]
    assert len(saved) == 1, saved
    stop_step = int(saved[0][5:17])
    assert 3 <= stop_step < 80
    assert (d / "out" / "adapter" / "adapter_model.safetensors").exists()  # output written on stop
    cli.cwd = d
    resumed = cli("train", cfg, "--resume", check=0)
    assert f"at step {stop_step}" in resumed.stdout
    assert_bit_identical(weights(straight_dir / "out" / "adapter"), weights(d / "out" / "adapter"))


def test_mismatched_checkpoint_is_refused_with_what_differs(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, EXTRA, steps=5)
    cli.cwd = tmp_path
    cli("train", cfg, check=0)
    proc = cli("train", cfg, "--resume", "--set", "training.lr=0.5", "--set", "lora.rank=2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not match this run" in proc.stderr
    assert "training.lr: checkpoint 0.01, config 0.5" in proc.stderr and "lora.rank: checkpoint 4, config 2" in proc.stderr
    (tmp_path / "train.jsonl").write_text((tmp_path / "train.jsonl").read_text().replace("red", "RED"))
    proc = cli("train", cfg, "--resume")
    assert proc.returncode == 2 and "data: content changed" in proc.stderr
    # bookkeeping-only changes do not block a resume
    (tmp_path / "train.jsonl").write_text((tmp_path / "train.jsonl").read_text().replace("RED", "red"))
    cli("train", cfg, "--resume", "--set", "metrics.log_every=2", "--set", "training.threads=2", check=0)


def test_corrupt_or_incomplete_checkpoint_is_refused(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, EXTRA, steps=5)
    cli.cwd = tmp_path
    cli("train", cfg, check=0)
    state = tmp_path / "ckpt" / "step-000000000005.state"
    data = bytearray((state / "optimizer.pt").read_bytes())
    data[-20] ^= 0xFF
    (state / "optimizer.pt").write_bytes(bytes(data))
    proc = cli("train", cfg, "--resume", state)
    assert proc.returncode == 2 and "optimizer.pt does not match its SHA-256" in proc.stderr
    (state / "manifest.json").unlink()
    proc = cli("train", cfg, "--resume", state)
    assert proc.returncode == 2 and "is incomplete" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("train", cfg, "--resume", tmp_path / "nowhere.state")
    assert proc.returncode == 2 and "checkpoint not found" in proc.stderr


def test_full_fine_tune_resume_is_bit_exact(tmp_path, tiny_model, cli):
    def full_run(d):
        d.mkdir()
        cfg = write_run(d, tiny_model, EXTRA.replace("[training]", '[training]\ntrainable = "full"'), steps=6)
        text = cfg.read_text()
        cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
        return cfg

    a, b = tmp_path / "a", tmp_path / "b"
    cli.cwd = a
    cli("train", full_run(a), check=0)
    cfg = full_run(b)
    cli.cwd = b
    cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "best.state"})  # dies at its first eval save (step 3)
    assert (b / "ckpt").exists() and not (b / "ckpt" / "best.state").exists()
    # nothing complete to resume from yet except... nothing: the run died before any step checkpoint
    proc = cli("train", cfg, "--resume")
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
    cli("train", cfg, check=0)
    # the resumed run must write the model itself: remove what the straight run left there
    shutil.rmtree(b / "out")
    proc = cli("train", cfg, "--resume", b / "ckpt" / "step-000000000005.state", check=0)
    assert "at step 5" in proc.stdout and (b / "out" / "adapter" / "config.json").is_file()
    wa = load_file(a / "out" / "adapter" / "model.safetensors")
    wb = load_file(b / "out" / "adapter" / "model.safetensors")
    assert_bit_identical(wa, wb)
    assert losses(a / "runs" / "run") == losses(b / "runs" / "run")


def straight_and_resumed(tmp_path, tiny_model, cli, extra: str, crash_in: str):
    """Run `extra`'s config straight (in tmp_path/a) and killed while saving `crash_in`, then resumed (in
    tmp_path/b); asserts both end on the same weights bit for bit and the same logged losses."""
    straight_dir, d = tmp_path / "a", tmp_path / "b"
    straight_dir.mkdir()
    cli.cwd = straight_dir
    cli("train", write_run(straight_dir, tiny_model, extra, steps=STEPS), check=0)
    d.mkdir()
    cfg = write_run(d, tiny_model, extra, steps=STEPS)
    cli.cwd = d
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": crash_in})
    assert killed.returncode == -signal.SIGKILL
    cli("train", cfg, "--resume", check=0)
    assert_bit_identical(weights(straight_dir / "out" / "adapter"), weights(d / "out" / "adapter"))
    assert losses(straight_dir / "runs" / "run") == losses(d / "runs" / "run")
    return straight_dir


def test_bf16_weights_resume_is_bit_exact_through_the_mixed_lora_node(tmp_path, tiny_model, cli):
    """bf16 base weights with float32 LoRA (and LoRA dropout on) train through models/mixed_lora.py's node;
    a killed run resumes onto the same weights and losses as the straight one."""
    straight_dir = straight_and_resumed(tmp_path, tiny_model, cli, EXTRA + '[model]\ndtype = "bfloat16"\n',
                                        "step-000000000010.state")
    straight_losses = [loss for _, loss, _ in losses(straight_dir / "runs" / "run") if loss is not None]
    assert len(straight_losses) == STEPS and straight_losses[-1] < straight_losses[0]  # it trained


def test_compiled_training_passes_resume_bit_exact_and_train_as_eager(tmp_path, tiny_model, cli):
    """[training] compile: without LoRA dropout a compiled run's losses are the eager run's up to summation
    order (with it the masks differ: inductor draws them from its own random stream); with dropout on, a
    killed compiled run resumes onto the straight compiled run's weights and losses bit for bit."""
    extra = EXTRA.replace("threads = 2\n", "threads = 2\ncompile = true\n")
    curves = {}
    for name, text in (("eager", EXTRA), ("compiled", extra)):
        folder = tmp_path / name
        folder.mkdir()
        cfg = write_run(folder, tiny_model, text, steps=STEPS)
        cfg.write_text(cfg.read_text().replace("dropout = 0.1", "dropout = 0.0"))
        cli.cwd = folder
        out = cli("train", cfg, check=0)
        curves[name] = [loss for _, loss, _ in losses(folder / "runs" / "run") if loss is not None]
    assert "training.compile: the first training passes compile" in out.stdout + out.stderr
    assert len(curves["compiled"]) == STEPS and curves["compiled"][-1] < curves["compiled"][0]  # it trained
    assert curves["compiled"] == pytest.approx(curves["eager"], rel=1e-5)
    straight_and_resumed(tmp_path, tiny_model, cli, extra, "step-000000000005.state")
