"""models/lean_ops.py: RoPE and LlamaRMSNorm as autograd functions with fewer kernels, against autograd through
transformers' own expressions and a float64 re-implementation."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from retrograd.models.lean_ops import rms_norm, rope, rope_reference


def rotary(tokens: int, dim: int, dtype=torch.float32):
    """cos / sin [tokens, 1, dim] as transformers builds them: the two halves equal."""
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(dim // 2) / (dim // 2))
    angles = torch.cat([angles, angles], -1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def kernels(fn) -> int:
    """aten kernels a forward + backward runs (views and allocations not counted)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    skip = ("view", "empty", "slice", "as_strided", "transpose", "expand", "t", "detach", "alias", "reshape",
            "unsqueeze", "squeeze", "select", "ones_like", "fill_", "zeros_like", "empty_like", "empty_strided")
    return sum(e.count for e in prof.key_averages()
               if e.key.startswith("aten::") and e.key[6:] not in skip and not e.key.startswith("aten::_to"))


def test_rope_values_and_gradients_match_transformers_and_float64():
    torch.manual_seed(0)
    cos, sin = rotary(7, 8)
    x = torch.randn(7, 3, 8, requires_grad=True)
    weight = torch.randn(7, 3, 8)
    got = rope(x, cos, sin)
    (got * weight).sum().backward()
    got_grad, x.grad = x.grad, None
    want = rope_reference(x, cos, sin)
    (want * weight).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, x.grad, rtol=1e-6, atol=1e-6)
    # the rotation is orthogonal: the gradient is the inverse rotation of the incoming one
    c64, s64 = rotary(7, 8, torch.float64)
    x64 = x.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rope(t, c64, s64), (x64,))
    torch.testing.assert_close(got_grad.double(), rope(weight.double(), c64, -s64), rtol=1e-6, atol=1e-6)


def test_rope_runs_fewer_kernels_than_the_expression():
    cos, sin = rotary(64, 16)
    x = torch.randn(64, 4, 16, requires_grad=True)
    ours = kernels(lambda: rope(x, cos, sin).sum().backward())
    theirs = kernels(lambda: rope_reference(x, cos, sin).sum().backward())
    assert ours < theirs


def llama_norm(width: int, dtype=torch.float32, train_weight: bool = False) -> LlamaRMSNorm:
    torch.manual_seed(1)
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width) + 0.5)
    return norm.to(dtype).requires_grad_(train_weight)


@pytest.mark.parametrize("train_weight", [False, True])
def test_rms_norm_forward_is_the_module_bit_for_bit_and_gradients_match(train_weight):
    norm = llama_norm(16, train_weight=train_weight)
    x = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(2, 5, 16)
    got = rms_norm(norm, x)
    (got * weight).sum().backward()
    got_x, got_w = x.grad, norm.weight.grad
    x.grad, norm.weight.grad = None, None
    want = norm(x)
    (want * weight).sum().backward()
    assert torch.equal(got, want)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-5, atol=1e-6)
    if train_weight:
        torch.testing.assert_close(got_w, norm.weight.grad, rtol=1e-5, atol=1e-6)
    else:
        assert got_w is None
    # against a float64 re-implementation of y = w x / sqrt(mean(x^2) + eps)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    y64 = w64 * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    (y64 * weight.double()).sum().backward()
    torch.testing.assert_close(got_x.double(), x64.grad, rtol=1e-5, atol=1e-6)
    if train_weight:
        torch.testing.assert_close(got_w.double(), w64.grad, rtol=1e-5, atol=1e-6)


def test_rms_norm_in_bf16_follows_the_module():
    norm = llama_norm(32, torch.bfloat16)
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    got = rms_norm(norm, x)
    got.float().square().sum().backward()
    got_x, x.grad = x.grad, None
    want = norm(x)
    want.float().square().sum().backward()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert got_x.dtype == torch.bfloat16
    torch.testing.assert_close(got_x.float(), x.grad.float(), rtol=2e-2, atol=2e-2)


def test_rms_norm_runs_fewer_kernels_and_leaves_other_norms_alone():
    norm = llama_norm(64)
    x = torch.randn(32, 64, requires_grad=True)
    assert kernels(lambda: rms_norm(norm, x).sum().backward()) < kernels(lambda: norm(x).sum().backward())

    class OtherNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64))

        def forward(self, t):
            return t * 2 * self.weight

    assert torch.equal(rms_norm(OtherNorm(), x), x * 2)
    replaced = llama_norm(64)
    replaced.forward = lambda t: t + 1  # a forward swapped in on the instance (as the kernels hub may)
    assert torch.equal(rms_norm(replaced, x), x + 1)
