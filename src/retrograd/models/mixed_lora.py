"""LoRA on bf16 or float32 weights as one autograd node that computes in the weights' dtype.

With `[model] dtype = "bfloat16"` the base weights are bf16 and the LoRA weights stay float32 (the
optimizer updates them in float32). PEFT's `lora.Linear.forward` then casts every input to float32, runs
both rank-r products in float32, adds its float32 result to the bf16 base output (which promotes the sum
to float32) and casts the sum back: per adapted layer and pass, four casts of a [tokens, features] tensor
forward, as many again backward, and a float32 copy of the input kept for lora_A's gradient (for q, k and v
each, though they share one input). On SmolLM2 with r=8 on q/k/v/o that was 12 % of a bf16 SFT pass
([2, 256], AMD EPYC with avx512_bf16): 0.165 s of 1.32 s against the same pass with one adapted layer.

`_MixedLoRALinear` computes y = x W^T + s (x A^T) B^T with A and B cast to the input's dtype (r x features,
negligible) and the rank-r product added into the base output in place (one addmm). Backward gives the
input gradient g W + s (g B) A the same way and the LoRA gradients s (g B)^T x and s g^T (x A^T) from
bf16 products (accumulated in float32 inside the kernel and rounded to bf16 - lora_A's twice, through
g B - then float32 for the optimizer), and it keeps only the bf16 input (shared by q, k and v) and the
[tokens, r] product. This is the arithmetic torch.autocast would do for these layers. In ad-hoc checks (not
committed): on one such layer against PEFT's float32 LoRA path the output differed by 0.09 % and the
gradients by 0.1-0.3 % of their norm; on a whole bf16 SFT pass of SmolLM2 the LoRA gradients of either path
differed from the float32 model's by about 4 % of their norm (this node's 3.98 %, PEFT's 4.20 %): bf16
activations dominate. Measured in-process against PEFT's path (benchmarks/ab_mixed_lora.py): that SFT pass
took 15.5 % less time (medians, 7 of 8 pairs faster); a GRPO training pass and a DPO step were inside the
host's noise (4 of 8 pairs each). bench_sft.py --dtype bfloat16's peak RSS fell from 1482 to 1230-1243 MB
(separate runs).

Float32 models take it too, for memory: PEFT's layer allocates three [tokens, out] tensors a call (the base
output, the rank-r product, its scaled copy) and their sum, where the node adds the rank-r product into the
base output. Freed between layers, those temporaries fragment glibc's heap under the activations that are
kept; an SFT LoRA run of SmolLM2 (bench_sft.py's settings, 4 steps, AMD EPYC) peaked at 1714-1735 MB of RSS
against 1811-1828 with PEFT's forward (3 runs each, alternating), at the same speed. The values are PEFT's
up to rounding (the node rounds the scaled product once, inside the GEMM; PEFT rounds it, then its
scaled copy): the losses of those runs agreed to 4 decimals.

Only bf16 and float32 weights with float32 adapters take it. fp16 ones keep PEFT's forward (there g B
underflows while B is small, early in training, where PEFT's float32 path does not).
The fast path also stands aside, per call, for everything it does not reproduce: adapters disabled or
merged, more than one active adapter, per-row adapter names, DoRA and other variants, a LoRA bias,
fan_in_fan_out, a trained base weight, in-place dropout, DTensor parameters, and hooks on base_layer,
lora_A or lora_B (or global module hooks), which the node would never fire; those calls run PEFT's own
forward. Under FSDP2 a forward sees the gathered parameters as plain tensors, so the node runs there too
(bf16 weights without mixed_precision; with mixed_precision = "bf16" the adapters are bf16 and PEFT's
forward runs). LoRA dropout is kept: the node takes dropout(x) for the rank-r branch, drawn by the same
module call as PEFT's. The base products (x W^T, g W) run with this machine's float32 GEMM library
(models/cpu_gemm.py: oneDNN on AMD CPUs with AVX-512, else F.linear's).
"""
from __future__ import annotations

import types

import torch

from retrograd.models.cpu_gemm import linear


class _MixedLoRALinear(torch.autograd.Function):
    """x W^T + b + s (d A^T) B^T, where d is x itself or, under LoRA dropout, dropout(x) (passed as
    `dropped`; None when it is x)."""

    @staticmethod
    def forward(ctx, x, dropped, weight, bias, lora_a, lora_b, scaling: float):
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        rows = x.reshape(-1, x.shape[-1])
        lora_rows = rows if dropped is None else dropped.reshape(-1, x.shape[-1])
        down = lora_rows @ a.t()  # [N, r]
        out = linear(x, weight, bias)  # returned as it is, not as a view: callers may edit it in place
        out.view(-1, out.shape[-1]).addmm_(down, b.t(), alpha=scaling)
        ctx.save_for_backward(lora_rows, down, weight, a, b)
        ctx.scaling, ctx.dtypes, ctx.shared = scaling, (lora_a.dtype, lora_b.dtype), dropped is None
        return out

    @staticmethod
    def backward(ctx, grad):
        lora_rows, down, weight, a, b = ctx.saved_tensors
        s, shape = ctx.scaling, (*grad.shape[:-1], lora_rows.shape[-1])
        g = grad.reshape(-1, grad.shape[-1]).to(lora_rows.dtype)
        g_down = g @ b  # [N, r]: the gradient of d A^T, before the scaling
        grad_x = grad_dropped = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear(g, weight.t())  # g W
            if ctx.shared:
                grad_x.addmm_(g_down, a, alpha=s)
            grad_x = grad_x.view(shape)
        if ctx.needs_input_grad[1]:
            grad_dropped = (g_down @ a).mul_(s).view(shape)
        if ctx.needs_input_grad[4]:
            grad_a = (g_down.t() @ lora_rows).to(ctx.dtypes[0]).mul_(s)
        if ctx.needs_input_grad[5]:
            grad_b = (g.t() @ down).to(ctx.dtypes[1]).mul_(s)
        return grad_x, grad_dropped, None, None, grad_a, grad_b, None


def _plain_tensor(t: torch.Tensor | None) -> bool:
    return t is None or type(t) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor or other subclass


def _fast_path_args(module, x: torch.Tensor, args: tuple, kwargs: dict):
    """(dropout, weight, bias, lora_a, lora_b, scaling) when this call is plain LoRA on a bf16 or float32
    layer with float32 adapters, else None."""
    if args or kwargs or module.disable_adapters or module.merged or module.lora_variant:
        return None
    active = [n for n in module.active_adapters if n in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    base, lora_a, lora_b = module.base_layer, module.lora_A[name], module.lora_B[name]
    if type(base) is not torch.nn.Linear or lora_b.bias is not None or base.weight.requires_grad \
            or (base.bias is not None and base.bias.requires_grad):
        return None
    dropout = module.lora_dropout[name]
    if module.use_dora.get(name) or getattr(module, "fan_in_fan_out", False) \
            or type(dropout) not in (torch.nn.Identity, torch.nn.Dropout) or getattr(dropout, "inplace", False):
        return None
    if _hooked(base, lora_a, lora_b):
        return None
    weight, bias, a, b = base.weight, base.bias, lora_a.weight, lora_b.weight
    # bf16 and float32 only: in fp16 the [tokens, r] gradient g B underflows while B is small (early
    # training), which PEFT's float32 path avoids; fp16 models keep PEFT's forward
    if not (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float32)
            and a.dtype == b.dtype == torch.float32):
        return None
    if not all(_plain_tensor(t) for t in (x, weight, bias, a, b)):
        return None
    return dropout, weight, bias, a, b, float(module.scaling[name])


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _hooked(*modules: torch.nn.Module) -> bool:
    """Whether a hook would see one of these sublayers called: the node never calls them, so a hook on them
    (a user's activation probe, a profiler, an offloading library) or a global module hook runs PEFT's path."""
    import torch.nn.modules.module as module_globals
    if any(getattr(module_globals, name, None) for name in _GLOBAL_HOOKS):
        return True
    return any(getattr(m, name, None) for m in modules for name in _MODULE_HOOKS)


def _mixed_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    fast = _fast_path_args(self, x, args, kwargs)
    if fast is None:
        return type(self).forward(self, x, *args, **kwargs)
    dropout, *rest = fast
    dropped = dropout(x)  # the same call as PEFT's, so the same random mask from the same generator state
    return _MixedLoRALinear.apply(x, None if dropped is x else dropped, *rest)


def mixed_lora(model: torch.nn.Module) -> int:
    """Give every PEFT LoRA linear layer of `model` the node's fast path (it decides per call whether
    it applies); returns how many layers were changed. The instance's forward is swapped, never the class."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    changed = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in vars(module):
            module.forward = types.MethodType(_mixed_forward, module)
            changed += 1
    return changed
