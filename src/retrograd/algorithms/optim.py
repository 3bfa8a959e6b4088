"""The optimizer and gradient clipping every training loop and the service share."""
from __future__ import annotations

import torch
from torch.autograd.graph import increment_version


def build_optimizer(params: list[torch.nn.Parameter], tr) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) or SGD from a [training] table's optimizer, lr, adam_* and
    weight_decay."""
    if tr.optimizer == "sgd":
        return torch.optim.SGD(params, lr=tr.lr, weight_decay=tr.weight_decay)
    return adamw(params, tr.lr, (tr.adam_beta1, tr.adam_beta2), tr.adam_epsilon, tr.weight_decay)


def adamw(params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float], eps: float,
          weight_decay: float = 0.0) -> torch.optim.AdamW:
    """torch's AdamW, with its fused kernel where that applies (fused_adamw_applies); the training loops'
    and the service's."""
    fused = fused_adamw_applies(params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
    if fused:
        optimizer.register_step_post_hook(_bump_param_versions)
    return optimizer


def fused_adamw_applies(params: list[torch.nn.Parameter]) -> bool:
    """AdamW's fused kernel: one pass per tensor instead of a dozen elementwise ops, ~8x faster per
    step on CPU (a full fine-tune of SmolLM2-135M spends ~0.8 s per step in the for-loop AdamW at one
    thread) and the same update to float32 rounding (1.5e-8 after three steps; in bf16 it rounds once
    instead of per op). For a LoRA's ~240 small tensors the for-loop's ~12 ops each cost ~20-30 ms a step
    in dispatch alone. Not for sharded (DTensor) parameters, whose fused path is not supported on
    every backend, nor for devices other than CPU and CUDA."""
    return bool(params) and all(p.device.type in ("cpu", "cuda") and not hasattr(p, "full_tensor")
                                and p.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
                                for p in params)


def _bump_param_versions(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The fused kernel writes the weights through raw pointers, so their version counters stay put;
    anything that caches a copy of a weight keyed on its version (the RL decoder's packed weights,
    rl/decoder._prepared) would go on using the old copy. Bump them as an in-place op would."""
    increment_version([p for group in optimizer.param_groups for p in group["params"]])


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the gradients (before clipping); clips when max_norm > 0."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    sharded = hasattr(grads[0].grad, "full_tensor")  # FSDP2 gradients: the norm over every rank's shard
    if max_norm <= 0 and not sharded:
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))
    norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
    whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    # torch's clip_grad_norm_, less one pass over every gradient in the usual step: it multiplies by
    # min(max_norm / (norm + 1e-6), 1) even when that is 1, to spare an accelerator a host sync. We
    # read the norm back anyway, and g * 1.0 == g bit for bit, so an unclipped step skips the multiply
    # (a full fine-tune of SmolLM2: 1.1 GB of memory traffic a step). NaN coefficients still multiply.
    if max_norm > 0 and not bool(max_norm / (whole + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return float(whole)


def optimizer_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip, step, zero the gradients; returns the gradient norm before clipping."""
    grad_norm = clip_gradients(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class Dimuon(torch.optim.Optimizer):
    """Tinker's Dimuon for LoRA factors: an EMA of the gradient (beta1), orthogonalised, as the step
    direction: for each matrix the polar factor U V^T of its momentum (all singular values 1, so
    Frobenius norm sqrt(rank) for a LoRA factor), and `lr` scales that direction. Vectors (biases)
    step along their normalised momentum. Exact (an SVD of the small [r, d] factor), no Newton-Schulz."""

    def __init__(self, params, lr: float = 1e-4, beta1: float = 0.9):
        super().__init__(params, {"lr": lr, "beta1": beta1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, beta1 = group["lr"], group["beta1"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                m = state["momentum"]
                m.mul_(beta1).add_(p.grad.float(), alpha=1 - beta1)
                p.add_(orthogonalised(m).to(p.dtype), alpha=-lr)
        return None


def orthogonalised(m: torch.Tensor) -> torch.Tensor:
    """The polar factor U V^T of a matrix (0 for a zero matrix); a vector is normalised to unit norm."""
    if m.ndim < 2:
        n = torch.linalg.vector_norm(m)
        return m / n if n > 0 else torch.zeros_like(m)
    u, s, vh = torch.linalg.svd(m.reshape(m.shape[0], -1), full_matrices=False)
    keep = (s > s.max() * 1e-7).to(u.dtype) if s.numel() else s  # a rank-deficient momentum keeps its rank
    return ((u * keep) @ vh).reshape(m.shape)
