"""PPO's critic-side maths, as pure functions on tensors.

Shapes: N completions, T positions (right-padded); `mask` [N, T] true on sampled tokens. Position t
is the state before token t was sampled; `rewards[i, t]` is what token t earned (a terminal reward
sits on each completion's last token, a per-token reward where it applies).

  GAE          delta_t = r_t + gamma V_{t+1} - V_t   (V after the last token = 0: the episode ends)
               A_t = sum_k (gamma lambda)^k delta_{t+k};  returns R_t = A_t + V_t  (the TD(lambda) target)
  whiten       (x - mean) / (std + 1e-8) over the masked entries (population std), 0 outside
  value loss   mean over the mask of (V - R)^2 / 2, optionally with PPO's value clipping
  explained variance   1 - Var(R - V) / Var(R) over the mask (1: perfect, 0: no better than the mean)
"""
from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N, T], returns [N, T]), 0 outside the mask; computed backwards in float64."""
    r, v, m = rewards.double(), values.double(), mask.bool()
    n, t_max = r.shape
    adv = torch.zeros_like(r)
    running = torch.zeros(n, dtype=torch.float64, device=r.device)
    next_value = torch.zeros(n, dtype=torch.float64, device=r.device)
    for t in range(t_max - 1, -1, -1):
        live = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(live, delta + gamma * lam * running, torch.zeros_like(running))
        adv[:, t] = running
        next_value = torch.where(live, v[:, t], torch.zeros_like(next_value))
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, returns


def terminal_rewards(rewards: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[N] sequence rewards -> [N, width] with each on its completion's last token."""
    out = torch.zeros(rewards.shape[0], width, dtype=torch.float64)
    out[torch.arange(rewards.shape[0]), (lengths - 1).clamp(min=0)] = rewards.double()
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.bool()
    values = x.double()[m]
    if values.numel() < 2:
        return torch.where(m, x.double() - values.mean() if values.numel() else x.double(), torch.zeros_like(x.double()))
    centred = (x.double() - values.mean()) / (values.std(correction=0) + 1e-8)
    return torch.where(m, centred, torch.zeros_like(centred))


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, old_values: torch.Tensor | None = None,
               clip: float = 0.0) -> torch.Tensor:
    """Mean over the mask of (V - R)^2 / 2; with `clip` > 0 and `old_values`, PPO's clipped form
    max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) / 2."""
    m = mask.to(values.dtype)
    err = (values - returns.to(values.dtype)) ** 2
    if clip > 0 and old_values is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns.to(values.dtype)) ** 2)
    return 0.5 * (err * m).sum() / m.sum().clamp(min=1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    r, v = returns.double()[m], values.double()[m]
    if r.numel() < 2 or float(r.var(correction=0)) == 0.0:
        return 0.0
    return float(1 - (r - v).var(correction=0) / r.var(correction=0))
