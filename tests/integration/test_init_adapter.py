"""`lora.init_adapter`: a new run starts from a PEFT or GGUF adapter's weights (rank, alpha and
targets read from it); its base-model evaluation at step 0 equals the finished run's last one."""
import json

import pytest

from tiny import make_model_dir, write_run

EVAL = '[evaluation]\ndata = "eval.jsonl"\nevery_steps = 100'


def eval_losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/loss"] for r in rows if "eval/loss" in r]


@pytest.mark.parametrize("output", ["out/adapter", "out/adapter.gguf"])
def test_new_run_starts_where_the_adapter_left_off(tmp_path, tiny_model, cli, output):
    first = tmp_path / "first"
    first.mkdir()
    cli.cwd = first
    cli("train", write_run(first, tiny_model, EVAL + f'\n[output]\npath = "{output}"\n[lora]\nrank = 2\nalpha = 6',
                           steps=4), check=0)
    trained_eval = eval_losses(first / "runs" / "run")[-1]

    second = tmp_path / "second"
    second.mkdir()
    cli.cwd = second
    cfg = write_run(second, tiny_model, EVAL, steps=2)
    text = cfg.read_text().replace("rank = 4\n", "").replace("alpha = 8\n", "")
    cfg.write_text(text.replace("[lora]\n", f'[lora]\ninit_adapter = "{first / output}"\n'))
    proc = cli("train", cfg, check=0)
    assert "LoRA initialised from" in proc.stdout and "LoRA r=2 alpha=6.0" in proc.stdout
    assert eval_losses(second / "runs" / "run")[0] == pytest.approx(trained_eval, abs=1e-5)
    resolved = (second / "runs" / "run" / "config.toml").read_text()
    assert "rank = 2" in resolved and "alpha = 6.0" in resolved

    proc = cli("train", cfg, "--resume")
    assert proc.returncode == 2 and "--resume cannot be combined with lora.init_adapter" in proc.stderr
    assert "rank = 2, alpha = 6.0" in proc.stderr


def test_init_adapter_errors(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, '[output]\npath = "out/a.gguf"', steps=1)
    cli("train", cfg, check=0)
    # rank given next to init_adapter
    text = cfg.read_text().replace("[lora]\n", '[lora]\ninit_adapter = "out/a.gguf"\n')
    cfg.write_text(text)
    proc = cli("train", cfg)
    assert proc.returncode == 2 and "lora.rank cannot be set together with lora.init_adapter" in proc.stderr
    # an adapter trained on another base model (hidden 48 instead of 32)
    other = make_model_dir(tmp_path / "other", hidden=48)
    cfg.write_text(text.replace("rank = 4\n", "").replace("alpha = 8\n", ""))
    proc = cli("train", cfg, "--model", other)
    assert proc.returncode == 2 and "does not match this base model" in proc.stderr and "Traceback" not in proc.stderr
    # a GGUF that is not an adapter
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "notadapter.gguf"), "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    cfg.write_text(cfg.read_text().replace("out/a.gguf", "notadapter.gguf"))
    proc = cli("train", cfg)
    assert proc.returncode == 2 and "is not a LoRA adapter" in proc.stderr
