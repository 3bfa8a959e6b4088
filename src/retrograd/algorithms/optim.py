"""The optimizer and gradient clipping every training loop and the service share."""
from __future__ import annotations

import torch


def build_optimizer(params: list[torch.nn.Parameter], tr) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) or SGD from a [training] table's optimizer, lr, adam_* and
    weight_decay."""
    if tr.optimizer == "sgd":
        return torch.optim.SGD(params, lr=tr.lr, weight_decay=tr.weight_decay)
    return torch.optim.AdamW(params, lr=tr.lr, betas=(tr.adam_beta1, tr.adam_beta2), eps=tr.adam_epsilon,
                             weight_decay=tr.weight_decay)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the gradients (before clipping); clips when max_norm > 0."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))


def optimizer_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip, step, zero the gradients; returns the gradient norm before clipping."""
    grad_norm = clip_gradients(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
