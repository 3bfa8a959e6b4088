"""RoPE and Llama's RMSNorm as autograd functions that run fewer kernels than autograd's op-by-op graph.

On a CPU these elementwise ops are bound by memory traffic, not arithmetic: each kernel reads and writes
its whole [tokens, width] operands, and autograd records one node per op, so backward runs as many
kernels again (a 2-core Xeon streams ~20 GB/s). The packed forward (models/packed.py) runs them here:

- `rope(x, cos, sin)`: x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]. As written in transformers
  it is 5 kernels forward (mul, neg, cat, mul, add) and ~6 backward; here the product x cos is written
  once and the two half-rotations are added into its halves in place (3 kernels each way). Forward +
  backward of one layer's q and k, 390 tokens of SmolLM2 (9 + 3 heads of 64): 0.36 against 0.84 ms.
  cos and sin are what backward keeps, as autograd's graph keeps them.
- `rms_norm(norm, x)`: LlamaRMSNorm's forward op for op (so the same values, bit for bit), and a backward
  written out, dx = rstd (g w - x^ mean(g w x^)), dw = sum(g x^) over tokens, from the input and the
  per-token rstd it keeps: 0.50 against 0.63 ms for [390, 576] forward + backward. Any other norm
  (another class, a forward replaced from the kernels hub) is called as it is.

Gradients agree with autograd's to float32 rounding (the sums run in another order), tested against
it and a float64 reference (tests/unit/test_lean_ops.py). Under torch.compile both are the plain
expressions: inductor fuses those itself.
"""
from __future__ import annotations

import functools

import torch


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)  # - x2 sin
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])  # + x1 sin
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        # out1 = x1 c - x2 s, out2 = x2 c + x1 s  =>  dx1 = g1 c + g2 s, dx2 = g2 c - g1 s
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        dx = grad * cos
        dx[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        dx[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return dx, None, None


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [..., D] by cos / sin broadcast to it (their two halves equal, as
    transformers' rotary embeddings make them)."""
    if torch.compiler.is_compiling():
        return rope_reference(x, cos, sin)
    return _Rope.apply(x, cos, sin)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.float32)  # as LlamaRMSNorm.forward, op for op
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.to(torch.float32) * rstd
        g = (grad * weight).to(torch.float32)  # the gradient at x_hat
        dx = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)).mul_(rstd).to(x.dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (grad.to(torch.float32) * x_hat.to(x.dtype)).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        return dx, dw, None


@functools.lru_cache(maxsize=None)
def _plain_llama_norm_class(cls: type) -> bool:
    """cls is LlamaRMSNorm or a subclass whose forward is, bytecode for bytecode, LlamaRMSNorm's (asked once
    a class: the packed forward asks for every norm of every pass)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    forward = getattr(cls, "forward", None)
    return (issubclass(cls, LlamaRMSNorm) and forward is not None
            and forward.__code__.co_code == LlamaRMSNorm.forward.__code__.co_code)


def _plain_llama_norm(norm) -> bool:
    return "forward" not in vars(norm) and _plain_llama_norm_class(type(norm))


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) for a model's RMSNorm module: through _RmsNorm when it is transformers' LlamaRMSNorm
    with its own forward and autograd is recording, else the module itself. A float64 model (a reference run in
    tests) keeps the module's own autograd, so its gradients stay those of transformers' ops exactly (the
    written-out backward agrees with them only to float32 rounding, as the module computes in float32)."""
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled() or x.dtype == torch.float64
            or not (x.requires_grad or norm.weight.requires_grad) or not _plain_llama_norm(norm)):
        return norm(x)
    return _RmsNorm.apply(x, norm.weight, norm.variance_epsilon)
