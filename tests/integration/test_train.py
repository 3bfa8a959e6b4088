"""The real CLI on a tiny random model: it learns, writes the documented layout and metrics."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tiny import write_run


def read_metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_lora_learns_and_writes_everything(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, """
[lora]
alpha = 64
[training]
epochs = 6
lr_scheduler = "cosine"
warmup_steps = 2
[evaluation]
data = "eval.jsonl"
every_steps = 6
[checkpoint]
directory = "ckpt"
mode = "steps_and_best_eval"
every_steps = 12
[metrics]
tensorboard_dir = "tb"
""", steps=None)
    proc = cli("train", cfg, check=0)
    assert "step 36/36" in proc.stdout and "eval" in proc.stdout
    rows = read_metrics(tmp_path / "runs" / "run" / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 37))
    # a random tiny model learns slowly through LoRA alone (its head is frozen); full FT is checked below
    assert sum(r["train/loss"] for r in train[-6:]) / 6 < train[0]["train/loss"] - 0.1
    assert evals[-1] < evals[0] - 0.02
    for key in ("optimizer/lr", "optimizer/grad_norm", "system/tokens_per_second", "system/peak_rss_mb"):
        assert key in train[0]
    assert train[0]["optimizer/lr"] == pytest.approx(0.005)  # warm-up step 1 of 2
    # checkpoints, best, resolved config, output adapter
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["best.gguf", "best.state", "step-000000000012.gguf", "step-000000000012.state",
                     "step-000000000024.gguf", "step-000000000024.state", "step-000000000036.gguf",
                     "step-000000000036.state"]
    for f in ("weights.safetensors", "optimizer.pt", "rng.pt", "progress.json", "manifest.json"):
        assert (tmp_path / "ckpt" / "best.state" / f).exists()
    resolved = (tmp_path / "runs" / "run" / "config.toml").read_text()
    assert 'lr_scheduler = "cosine"' in resolved
    out = tmp_path / "out" / "adapter"
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    # TensorBoard: one subfolder per run, readable by tensorboard itself
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb" / "run"))
    acc.Reload()
    assert {"train/loss", "eval/loss", "optimizer/lr", "optimizer/grad_norm", "system/tokens_per_second",
            "system/peak_rss_mb"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("train/loss")) == 36


def test_output_adapter_loads_in_peft_and_matches_training(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, steps=4)
    cli("train", cfg, check=0)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter")
    saved = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    lora_b = [v for k, v in saved.items() if "lora_B" in k]
    assert lora_b and any(float(v.abs().sum()) > 0 for v in lora_b)  # B moved away from its zero init
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert not torch.allclose(model(x).logits, base.__class__.from_pretrained(tiny_model)(x).logits)


def test_full_fine_tune_writes_an_hf_model(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, steps=3)
    text = cfg.read_text()
    start = text.index("[lora]")
    end = text.index("[training]")
    cfg.write_text(text[:start] + text[end:].replace("[training]", '[training]\ntrainable = "full"', 1)
                   .replace("lr = 0.01\n", "lr = 0.003\n"))
    cfg.write_text(cfg.read_text().replace("max_steps = 3", "max_steps = 30"))
    cli("train", cfg, check=0)
    rows = read_metrics(tmp_path / "runs" / "run" / "metrics.jsonl")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 1.0  # full fine-tuning learns fast
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    w0, w1 = base.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(w0, w1)
    assert (tmp_path / "out" / "adapter" / "tokenizer.json").exists()


def test_patience_stops_early_and_still_writes_output(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, """
[evaluation]
data = "eval.jsonl"
every_steps = 1
patience = 2
min_delta = 100.0
""", steps=20)
    proc = cli("train", cfg, check=0)
    assert "early stop at step 3" in proc.stdout
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").exists()


def test_gguf_adapter_output_and_checkpoint_copies(tmp_path, tiny_model, cli):
    import gguf
    import numpy as np
    from retrograd.models.architectures import permute_rows
    cfg = write_run(tmp_path, tiny_model, """
[output]
path = "out/adapter.gguf"
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 2
""", steps=4)
    cli("train", cfg, check=0)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-000000000002.gguf", "step-000000000002.state", "step-000000000004.gguf", "step-000000000004.state"]
    reader = gguf.GGUFReader(str(tmp_path / "out" / "adapter.gguf"))
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["general.architecture"] == "llama" and fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == 8.0
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    assert len(tensors) == 2 * 7 * 2  # 7 linear layers x 2 blocks, A and B each
    # the final GGUF equals the last checkpoint's weights, with lora_B of q rows RoPE-permuted
    from safetensors.torch import load_file
    w = load_file(tmp_path / "ckpt" / "step-000000000004.state" / "weights.safetensors")
    b_q = w["base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"].numpy()
    assert np.array_equal(tensors["blk.1.attn_q.weight.lora_b"], permute_rows(b_q, 4))
    a_v = w["base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight"].numpy()
    assert np.array_equal(tensors["blk.0.attn_v.weight.lora_a"], a_v)


def test_merged_model_output_equals_base_plus_adapter(tmp_path, tiny_model, cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    a, b = tmp_path / "a", tmp_path / "b"
    for d, extra in ((a, ""), (b, '[output]\nkind = "model"')):
        d.mkdir()
        cli.cwd = d
        cli("train", write_run(d, tiny_model, extra, steps=3), check=0)
    merged = AutoModelForCausalLM.from_pretrained(b / "out" / "adapter")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), a / "out" / "adapter")
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(merged(x).logits, peft(x).logits, atol=1e-5)
    assert (b / "out" / "adapter" / "tokenizer.json").exists()
