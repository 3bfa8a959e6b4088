"""The llama.cpp adapter exporter: the q/k RoPE row permutation, tensor names, refusals."""
import numpy as np
import pytest
import torch

from retrograd.errors import ConfigError
from retrograd.export.gguf_lora import check_exportable
from retrograd.models.architectures import adapter_tensors, permute_rows


def test_permute_rows_hand_example():
    # one head, 4 rows (2 rotary pairs): rotate-half order [a0, a1, b0, b1] -> interleaved [a0, b0, a1, b1]
    w = np.array([[0.0], [1.0], [2.0], [3.0]])
    assert permute_rows(w, 1)[:, 0].tolist() == [0.0, 2.0, 1.0, 3.0]
    # two heads permute independently
    w2 = np.arange(8.0)[:, None]
    assert permute_rows(w2, 2)[:, 0].tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]


def test_permute_rows_matches_the_rope_pairing():
    # HF rotate-half pairs row i with row i + d/2; interleaved RoPE pairs rows 2j and 2j+1
    d, heads = 8, 3
    w = np.random.default_rng(0).normal(size=(heads * d, 5))
    p = permute_rows(w, heads)
    for h in range(heads):
        for j in range(d // 2):
            assert np.array_equal(p[h * d + 2 * j], w[h * d + j])
            assert np.array_equal(p[h * d + 2 * j + 1], w[h * d + j + d // 2])


class Cfg:
    model_type = "llama"
    num_hidden_layers = 2
    num_attention_heads = 2
    num_key_value_heads = 1


def test_tensor_names_and_permuted_lora_b():
    b_q = torch.arange(8.0).reshape(8, 1)
    state = {
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": torch.ones(1, 8),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": b_q,
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.ones(8, 1),
    }
    out = dict(adapter_tensors(state, Cfg))
    assert set(out) == {"blk.1.attn_q.weight.lora_a", "blk.1.attn_q.weight.lora_b", "blk.0.ffn_down.weight.lora_b"}
    assert out["blk.1.attn_q.weight.lora_b"][:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert out["blk.0.ffn_down.weight.lora_b"].dtype == np.float32


def test_refusals():
    class Gpt2:
        model_type = "gpt2"
    with pytest.raises(ConfigError, match="PEFT adapter folder"):
        check_exportable(Gpt2, ["auto"])
    with pytest.raises(ConfigError, match="embeddings / output head"):
        check_exportable(Cfg, ["q", "lm_head"])
