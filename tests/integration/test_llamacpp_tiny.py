"""A GGUF adapter written for a tiny random llama model, loaded by a real llama.cpp (xllamacpp) on
an F32 GGUF of the same model, gives the PyTorch merged model's next-token log-probabilities."""
import random

import torch
from peft import get_peft_model_state_dict

from llamacpp_util import next_token_logprobs, write_tiny_llama_gguf
from retrograd.export import gguf_lora
from retrograd.models import architectures
from retrograd.models.load import load_model
from retrograd.models.lora import attach_lora


def test_tiny_adapter_in_llamacpp_matches_torch(tmp_path, tiny_model, monkeypatch):
    base_gguf = write_tiny_llama_gguf(tiny_model, tmp_path / "base.gguf")
    loaded = load_model(str(tiny_model))
    tok = loaded.tokenizer
    model, _ = attach_lora(loaded.model, 4, 8, ["auto"], 0.0, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    state = get_peft_model_state_dict(model)
    adapter = gguf_lora.write_gguf_lora(tmp_path / "adapter.gguf", state, 8, model.config)
    monkeypatch.setattr(architectures, "permute_rows", lambda w, n: w)
    unpermuted = gguf_lora.write_gguf_lora(tmp_path / "unpermuted.gguf", state, 8, model.config)
    monkeypatch.undo()

    # llama.cpp's server holds back a token that is an incomplete UTF-8 byte, so pick a prompt (token
    # ids, no tokenizer involved) whose most likely next token is plain ASCII on both sides
    def ascii_token(i):
        text = tok.decode([i])
        return len(text) == 1 and 32 <= ord(text) < 127

    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(33, 127) for _ in range(7)]
        with torch.no_grad():
            with model.disable_adapter():
                ref_base = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            ref_lora = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
        if ascii_token(int(ref_base.argmax())) and ascii_token(int(ref_lora.argmax())):
            break
    assert float((ref_lora - ref_base).abs().max()) > 0.1

    def max_diff(got, ref):
        assert len(got) == 20
        return max(abs(v - float(ref[i])) for i, v in got.items())

    assert max_diff(next_token_logprobs(base_gguf, ids), ref_base) < 1e-4
    assert max_diff(next_token_logprobs(base_gguf, ids, adapter), ref_lora) < 1e-4
    assert max_diff(next_token_logprobs(base_gguf, ids, unpermuted), ref_lora) > 1e-2
