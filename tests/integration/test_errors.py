"""Bad input: a clear message naming the file, line or key, exit 2, never a traceback."""
import json

from tiny import write_run


def fails(cli, *args, expect):
    proc = cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    for e in expect:
        assert e in proc.stderr, proc.stderr
    return proc.stderr


def test_config_errors(tmp_path, tiny_model, cli):
    fails(cli, "train", tmp_path / "missing.toml", expect=["config file not found", "missing.toml"])
    cfg = write_run(tmp_path, tiny_model)
    text = cfg.read_text()
    cfg.write_text(text.replace("batch_size = 2", "batch_size = 2\nbatch_sise = 3"))
    fails(cli, "train", cfg, expect=["unknown key 'batch_sise' in [training]", "did you mean 'batch_size'"])
    cfg.write_text(text.replace("batch_size = 2", "batch_size = [2"))
    fails(cli, "train", cfg, expect=["run.toml:", "malformed TOML"])
    cfg.write_text(text.replace("batch_size = 2", "batch_size = 0"))
    fails(cli, "train", cfg, expect=["training.batch_size: 0 is out of range (must be >= 1)"])
    cfg.write_text(text)
    fails(cli, "train", cfg, "--set", "training.lr=abc", expect=["training.lr: expected a number, got 'abc'"])
    fails(cli, "train", cfg, "--set", "lora.rnak=2", expect=["unknown key 'rnak' in [lora]", "did you mean 'rank'"])


def test_data_errors(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model)
    rows = (tmp_path / "train.jsonl").read_text().splitlines()
    rows[3] = '{"messages": [{"role": "user", "content": "x"}'
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    fails(cli, "train", cfg, expect=["train.jsonl:4: invalid JSON"])
    rows[3] = json.dumps({"prompt": "only a prompt"})
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    fails(cli, "train", cfg, expect=["train.jsonl:4: a prompt/completion row needs both"])
    (tmp_path / "train.jsonl").unlink()
    fails(cli, "train", cfg, expect=["data file not found", "train.jsonl"])


def test_model_and_resume_errors(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model)
    fails(cli, "train", cfg, "--model", tmp_path / "no-such-model",
          expect=["does not exist", "no-such-model", "smollm2-135m-instruct"])
    fails(cli, "train", cfg, "--resume", expect=["--resume needs a [checkpoint] table"])
    (tmp_path / "empty").mkdir()
    cfg.write_text(cfg.read_text() + '\n[checkpoint]\ndirectory = "empty"\nmode = "steps"\nevery_steps = 2\n')
    fails(cli, "train", cfg, "--resume", expect=["no complete checkpoint", "empty"])


def test_help_documents_every_flag(cli):
    proc = cli("train", "--help")
    assert proc.returncode == 0
    for flag in ("--resume", "--set", "--model", "--device", "--threads"):
        assert flag in proc.stdout


def test_a_fresh_run_never_overwrites_earlier_checkpoints(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 2', steps=2)
    cli("train", cfg, check=0)
    before = (tmp_path / "ckpt" / "step-000000000002.state" / "manifest.json").read_bytes()
    fails(cli, "train", cfg, expect=["already holds checkpoints of an earlier run", "--resume"])
    assert (tmp_path / "ckpt" / "step-000000000002.state" / "manifest.json").read_bytes() == before
