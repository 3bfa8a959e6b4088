"""The lean gated-MLP product: the same values and gradients as autograd's own, bit for bit, with a
third less kept for backward; MLPs it does not know keep their forward."""
import copy

import pytest
import torch
import torch.nn.functional as F

from retrograd.models.lean_mlp import _SiluGateProduct, lean_mlp, silu_gate_product


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while `fn()` builds its graph."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_product_matches_autograd_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(5, 7, 48, generator=g) * 3
    up = torch.randn(5, 7, 48, generator=g)
    grad = torch.randn(5, 7, 48, generator=g)
    a_gate, a_up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    b_gate, b_up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    plain = F.silu(a_gate) * a_up
    lean = silu_gate_product(b_gate, b_up)
    assert torch.equal(plain, lean)
    plain.backward(grad)
    lean.backward(grad)
    assert torch.equal(a_gate.grad, b_gate.grad) and torch.equal(a_up.grad, b_up.grad)
    # against the formula by hand: d/dg silu(g) = s(g) (1 + g (1 - s(g)))
    s = torch.sigmoid(gate.double())
    want = grad.double() * up.double() * s * (1 + gate.double() * (1 - s))
    assert torch.allclose(b_gate.grad.double(), want, atol=1e-5)


def test_product_finite_differences():
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(_SiluGateProduct.apply, (gate, up))


def test_only_the_needed_gradient_is_computed():
    gate = torch.randn(4, 8, requires_grad=True)
    up = torch.randn(4, 8)  # a frozen branch
    silu_gate_product(gate, up).sum().backward()
    assert gate.grad is not None and up.grad is None
    with torch.no_grad():  # no graph: the plain expression
        assert torch.equal(silu_gate_product(gate, up), F.silu(gate) * up)


def _tiny_llama(layers=3, hidden=32, inter=80):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def test_a_model_trains_bit_for_bit_with_less_kept():
    plain = _tiny_llama()
    lean = copy.deepcopy(plain)
    assert lean_mlp(lean) == 3
    assert lean_mlp(lean) == 0  # already lean: nothing to do twice
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    plain_bytes, plain_loss = _saved_bytes(lambda: plain(input_ids=ids, labels=ids).loss)
    lean_bytes, lean_loss = _saved_bytes(lambda: lean(input_ids=ids, labels=ids).loss)
    assert torch.equal(plain_loss, lean_loss)
    plain_loss.backward()
    lean_loss.backward()
    for (name, p), q in zip(plain.named_parameters(), lean.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # silu(gate) is not kept: one [tokens, intermediate] float32 tensor less per layer
    assert plain_bytes - lean_bytes == 3 * 2 * 11 * 80 * 4


def test_mlps_it_does_not_know_keep_their_forward():
    model = _tiny_llama(layers=2)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # another activation

    class Extra(type(model.model.layers[1].mlp)):  # a forward of its own
        def forward(self, x):
            return super().forward(x) * 2

    model.model.layers[1].mlp.__class__ = Extra
    assert lean_mlp(model) == 0
    assert all("forward" not in vars(layer.mlp) for layer in model.model.layers)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_other_llama_family_mlps_are_lean(kind):
    import importlib
    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    cls = getattr(mod, {"mistral": "MistralMLP", "qwen2": "Qwen2MLP"}[kind])
    cfg = getattr(importlib.import_module("transformers"), {"mistral": "MistralConfig", "qwen2": "Qwen2Config"}[kind])(
        hidden_size=16, intermediate_size=24)
    mlp = cls(cfg)
    x = torch.randn(3, 16, requires_grad=True)
    want = mlp(x)
    assert lean_mlp(mlp) == 1
    assert torch.equal(mlp(x), want)
