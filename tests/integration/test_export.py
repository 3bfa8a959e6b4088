"""`retrograd export CHECKPOINT --format gguf|peft|hf --out PATH` on a tiny model's checkpoints."""
import torch

from tiny import write_run

CKPT = '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 3'


def test_export_every_format_from_a_lora_checkpoint(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, CKPT, steps=3)
    cli("train", cfg, check=0)
    state = tmp_path / "ckpt" / "step-000000000003.state"

    cli("export", state, "--format", "gguf", "--out", tmp_path / "x.gguf", check=0)
    import gguf
    import numpy as np
    mine = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "x.gguf")).tensors}
    copy = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "ckpt" / "step-000000000003.gguf")).tensors}
    assert mine.keys() == copy.keys() and all(np.array_equal(mine[k], copy[k]) for k in mine)

    cli("export", state, "--format", "peft", "--out", tmp_path / "peft", check=0)
    cli("export", state, "--format", "hf", "--out", tmp_path / "merged", check=0)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "peft")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "out" / "adapter")
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        ref = trained(x).logits  # the run's own output at the same (last) step
        assert torch.allclose(peft(x).logits, ref, atol=1e-6)
        assert torch.allclose(merged(x).logits, ref, atol=1e-5)

    proc = cli("export", state, "--format", "peft", "--out", tmp_path / "peft")
    assert proc.returncode == 2 and "already exists; pass --force" in proc.stderr
    cli("export", state, "--format", "peft", "--out", tmp_path / "peft", "--force", check=0)


def test_export_refusals(tmp_path, tiny_model, cli):
    proc = cli("export", tmp_path / "nope.state", "--format", "hf", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "checkpoint not found" in proc.stderr
    cfg = write_run(tmp_path, tiny_model, CKPT, steps=3)
    text = cfg.read_text()
    cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):].replace(
        "[training]", '[training]\ntrainable = "full"', 1))
    cli("train", cfg, check=0)
    proc = cli("export", tmp_path / "ckpt" / "step-000000000003.state", "--format", "gguf", "--out", tmp_path / "a.gguf")
    assert proc.returncode == 2 and "is a full fine-tune; use --format hf" in proc.stderr
    cli("export", tmp_path / "ckpt" / "step-000000000003.state", "--format", "hf", "--out", tmp_path / "full", check=0)
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    saved = load_file(tmp_path / "ckpt" / "step-000000000003.state" / "weights.safetensors")
    assert torch.equal(exported.model.layers[0].mlp.up_proj.weight, saved["model.layers.0.mlp.up_proj.weight"])
