"""Which library runs a float32 training product on this CPU: MKL (torch's default) or oneDNN.

torch sends a float32 `x @ W^T` on a CPU to MKL's sgemm. On an AMD CPU with AVX-512 (the 2-core EPYC
of our machine kind, Zen 4) MKL's sgemm runs well below oneDNN's, the other GEMM library torch ships, on
the very same operands: SmolLM2's MLP products at 512 rows 170-184 against 110-145 GFLOP/s, the head's
logits 188 against 105 and its input gradient 184 against 137, the k/v projections equal (interleaved
pairs in one process, benchmarks/ab_cpu_gemm.py; whole SFT, DPO and GRPO passes 11-12 % less time).
oneDNN reads the weight in its plain row-major layout or through a transposed view, so the same tensor
serves a layer's forward (x W^T) and its input gradient (g W) with no second copy. A trained weight's own
gradient (g^T x) stays with autograd's MKL product, which was as fast or faster there.

The choice is fixed per machine, never timed at start-up: a resumed run must multiply with the library
the run began with (bit-exact resume), and two libraries round differently. oneDNN is taken on AMD CPUs
with AVX-512 (measured), for float32 products of at least ONEDNN_MIN_ROWS rows and weights at least
ONEDNN_MIN_FEATURES wide each way, where it won or tied at every shape measured (at 16-50 rows it lost
on the narrow 576 -> 192 projections, and a tiny model's products are dominated by its per-call
overhead). Intel CPUs keep MKL, Intel's own library for them. So does the AVX2-only EPYC (Zen 3), where
oneDNN measured slower: whole passes 19-36 % longer (ab_cpu_gemm_20261207_174005.json). CPUs not measured
keep torch's default.
RETROGRAD_FP32_GEMM=mkl or =onednn overrides the choice (benchmarks' A/Bs, a user who measures
otherwise). bf16 products are unaffected: torch already runs those through oneDNN.

`linear(x, weight)` is x @ weight^T for x [..., K] and weight [N, K] (a transposed view is fine: the
input gradient g W is `linear(g, W.t())`). It is called inside autograd Functions (the LoRA node, the
frozen linear node, the fused head), whose own backward says what to differentiate: oneDNN's op has no
derivative of its own. Inside a compiled region (`[training] compile`) the same product is the opaque op
retrograd::onednn_linear, so compiling keeps oneDNN's speed and adds inductor's fused elementwise kernels
(before, compiled passes fell back to MKL: 10 % slower than eager on the AVX-512 EPYC, 12-07).
"""
from __future__ import annotations

import os
import types
import warnings

import torch
import torch.nn.functional as F

from retrograd.device import cpu_info

# below this many rows oneDNN lost on some of SmolLM2's shapes (576 -> 192 at 1-50 rows: 10-50 % slower)
ONEDNN_MIN_ROWS = 128
# nor on narrower weights than SmolLM2's narrowest (576 -> 192, the k/v projections): on a tiny model's
# 64 -> 128 at 128 rows its per-call overhead made it 2x slower than MKL
ONEDNN_MIN_FEATURES = 192
ENV = "RETROGRAD_FP32_GEMM"


def _cpu_vendor_and_flags() -> tuple[str, set[str]]:
    info = cpu_info() or {}
    return info.get("vendor_id", ""), set(info.get("flags", "").split())


def fp32_gemm_library() -> str:
    """"onednn" or "mkl": the library this process runs its large float32 training products with. Decided
    once per process; a plain global after that, so a compiled region reads it as a constant."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _choose_library()
    return _LIBRARY


_LIBRARY: str | None = None


def _choose_library() -> str:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("mkl", "onednn"):
        chosen = forced
    else:
        if forced:
            warnings.warn(f"{ENV}={os.environ[ENV]!r} is neither 'mkl' nor 'onednn': ignored, this CPU's own choice "
                          "stands", stacklevel=2)
        vendor, flags = _cpu_vendor_and_flags()
        chosen = "onednn" if vendor == "AuthenticAMD" and "avx512f" in flags else "mkl"
    if chosen == "onednn" and not _onednn_works():
        return "mkl"
    return chosen


def _onednn_works() -> bool:
    """oneDNN's linear op exists in this torch build and gives x W^T (a build without it keeps MKL)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 3), torch.arange(12, dtype=torch.float32).view(4, 3)
        return bool(torch.equal(_onednn_linear(x, w), x @ w.t()))
    except (RuntimeError, AttributeError):
        return False


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether x @ weight^T (+ bias) runs through oneDNN here: float32 on a CPU, enough rows, and this
    machine's choice."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32)
            and weight.dim() == 2 and min(weight.shape) >= ONEDNN_MIN_FEATURES
            and x.numel() >= ONEDNN_MIN_ROWS * max(x.shape[-1], 1)
            and fp32_gemm_library() == "onednn")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inductor lowers the aten op only for frozen (constant) weights
        return torch.ops.retrograd.onednn_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# retrograd::onednn_linear: oneDNN's x @ weight^T (+ bias) as an op opaque to torch.compile, so that
# `[training] compile` keeps oneDNN's products: inductor calls it as an external kernel and fuses the
# elementwise work around it (its own lowering of the aten op asserts a frozen, constant weight). A
# plain Library op, not torch.library.custom_op: that wrapper costs ~30 us a call against ~5 here.
_OPS = torch.library.Library("retrograd", "FRAGMENT")
_OPS.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_OPS.impl("onednn_linear", lambda x, weight, bias: torch.ops.mkldnn._linear_pointwise(
    x, weight, bias, "none", [], ""), "CPU")


@torch.library.register_fake("retrograd::onednn_linear")
def _onednn_linear_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) with this machine's float32 GEMM library; F.linear wherever oneDNN is not
    chosen. No autograd: call it under an autograd Function (or no_grad)."""
    return (_onednn_linear if uses_onednn(x, weight, bias) else F.linear)(x, weight, bias)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b (a [M, K], b [K, N]), written into `out` (a view is fine), with this machine's library."""
    if uses_onednn(a, b):
        return out.copy_(_onednn_linear(a, b.t()))
    return torch.mm(a, b, out=out)


class _Linear(torch.autograd.Function):
    """x W^T + b through `linear`, its input gradient g W through it too; a trained weight's gradient g^T x
    (and the bias's) as autograd's linear computes it."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # only called where uses_onednn(x, weight, bias) holds
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear(grad, weight.t())
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


def _plain(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor or other subclass


def _routed_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    if not uses_onednn(x, weight, bias) or not (_plain(x) and _plain(weight) and _plain(bias)):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def route_linears(model: torch.nn.Module) -> int:
    """Where this machine runs float32 products through oneDNN, give every plain nn.Linear of `model` a
    forward that does (per call: float32 on a CPU with enough rows, else F.linear); returns how many were
    changed (0 where MKL stays). The instance's forward is swapped, never the class, and hooks on the
    module still fire around it. LoRA layers' own node (models/mixed_lora.py) calls `linear` itself."""
    if fp32_gemm_library() != "onednn":
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in vars(module):
            module.forward = types.MethodType(_routed_forward, module)
            changed += 1
    return changed
