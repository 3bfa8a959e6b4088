"""`retrograd inspect --model PATH` on a tiny model: text and JSON."""
import json


def test_inspect_text_and_json(tiny_model, cli):
    proc = cli("inspect", "--model", tiny_model, check=0)
    assert "LlamaForCausalLM (model_type llama)" in proc.stdout
    assert "2 layers, hidden 32, 4 heads (2 kv)" in proc.stdout
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in proc.stdout
    assert "GGUF LoRA adapters supported" in proc.stdout
    d = json.loads(cli("inspect", "--model", tiny_model, "--json", check=0).stdout)
    assert d["tied_embeddings"] is True and d["lora_target_aliases"][:4] == ["q", "k", "v", "o"]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert d["parameters"] == sum(p.numel() for p in model.parameters())
    assert d["dtypes"] == {"float32": len(list(model.parameters()))}


def test_inspect_missing_model(cli, tmp_path):
    proc = cli("inspect", "--model", tmp_path / "nope")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
