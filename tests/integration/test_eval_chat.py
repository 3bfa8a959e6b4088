"""`retrograd eval` and `retrograd chat` on a tiny model: base and trained side by side."""
import json

from tiny import write_run

EVAL = '[evaluation]\ndata = "eval.jsonl"\nevery_steps = 100'


def test_eval_reports_base_and_trained_losses(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, EVAL + '\n[lora]\nalpha = 64', steps=8)
    cli("train", cfg, check=0)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    out = json.loads(cli("eval", cfg, "--json", check=0).stdout)
    assert out["trained_from"].endswith("out/adapter") and out["rows"] == 8
    # the same numbers the training run logged before its first step and after its last
    assert abs(out["base/loss"] - evals[0]) < 1e-5 and abs(out["trained/loss"] - evals[-1]) < 1e-5
    text = cli("eval", cfg, "--checkpoint", tmp_path / "nope.state").stderr
    assert "--checkpoint" in text and "nope.state: no such file or folder" in text


def test_chat_compare_reads_stdin(tmp_path, tiny_model, cli):
    import subprocess
    import sys
    cfg = write_run(tmp_path, tiny_model, steps=2)
    cli("train", cfg, check=0)
    proc = subprocess.run([sys.executable, "-m", "retrograd", "chat", str(cfg), "--compare", "--max-new-tokens", "5",
                           "--temperature", "0"], input="red cat dog\n/reset\nsun moon\n/exit\n", cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("chatting with base,")
    assert sum(line.startswith("[base] ") for line in lines) == 2
    assert sum("out/adapter] " in line for line in lines) == 2
    assert "(conversation cleared)" in lines
    proc = cli("chat", cfg, "--compare", "--base-only")
    assert proc.returncode == 2 and "--compare needs a trained adapter" in proc.stderr
