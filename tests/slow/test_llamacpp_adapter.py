"""A GGUF adapter written by retrograd, loaded by a real llama.cpp (xllamacpp) on top of
SmolLM2's base GGUF, gives the same next-token log-probabilities as the PyTorch model with the
LoRA merged. The base is the Q4_1 file de-quantised to F32, so both sides hold identical weights."""
import pytest
import torch

from llamacpp_util import next_token_logprobs, write_f32_base

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_llamacpp_matches_torch_with_the_lora_merged(tmp_path, real_home, monkeypatch):
    from peft import get_peft_model_state_dict

    from retrograd.export import gguf_lora
    from retrograd.models import architectures
    from retrograd.models.builtin import builtin_gguf
    from retrograd.models.load import load_model
    from retrograd.models.lora import attach_lora

    base_gguf = write_f32_base(builtin_gguf("smollm2-135m-instruct"), tmp_path / "base-f32.gguf")
    loaded = load_model("smollm2-135m-instruct")
    tok = loaded.tokenizer
    model, _ = attach_lora(loaded.model, 4, 8, ["auto"], 0.0, 0)  # q, k, v, o, gate, up, down
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a visible effect (B starts at zero after init)
    state = get_peft_model_state_dict(model)
    adapter = gguf_lora.write_gguf_lora(tmp_path / "adapter.gguf", state, 8, model.config)
    monkeypatch.setattr(architectures, "permute_rows", lambda w, n: w)
    unpermuted = gguf_lora.write_gguf_lora(tmp_path / "unpermuted.gguf", state, 8, model.config)
    monkeypatch.undo()

    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        with model.disable_adapter():
            ref_base = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
        merged = model.merge_and_unload()
        ref_lora = torch.log_softmax(merged(input_ids=ids).logits[0, -1], -1)
    assert float((ref_lora - ref_base).abs().max()) > 0.5  # the adapter really changes the output

    def max_diff(got, ref):  # over llama.cpp's top-20 next tokens
        assert len(got) == 20
        return max(abs(v - float(ref[i])) for i, v in got.items())

    assert max_diff(next_token_logprobs(base_gguf, PROMPT), ref_base) < 1e-3
    assert max_diff(next_token_logprobs(base_gguf, PROMPT, adapter), ref_lora) < 1e-3
    # negative control: without the q/k row permutation llama.cpp loads the file but disagrees
    assert max_diff(next_token_logprobs(base_gguf, PROMPT, unpermuted), ref_lora) > 0.05
