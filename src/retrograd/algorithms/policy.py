"""Policy-gradient maths for GRPO-style training, as pure functions on tensors.

Shapes: N completions, T completion positions (right-padded); `mask` [N, T] is 1 on sampled
tokens. `logp` are the current policy's log-probabilities of the sampled tokens (with gradient),
`old_logp` those of the policy that sampled them (detached; equal to logp on the first pass, so
the ratio is exactly 1 on-policy), `ref_logp` the reference's.

  advantages      A_i = r_i - mean_group(r)              (Dr. GRPO: no std division)
                  rloo: A_i = r_i - mean_{j != i}(r_j) = n/(n-1) * (r_i - mean(r))
                  scale = "std" divides by the group std (original GRPO), 0 where std = 0
  ratio           token level: rho_t = exp(logp_t - old_t); sequence level (GSPO):
                  s = exp(mean_t(logp_t - old_t)), used on every token as sg[s] * p_t / sg[p_t]
  surrogate       per token  -min(rho * A, clip(rho, 1 - low, 1 + high) * A)
  KL (k3)         exp(ref - logp) - (ref - logp) - 1, per token, added with weight beta
  normalisation   token     sum over all tokens / number of tokens in the batch (DAPO)
                  constant  sum / (N * max_new_tokens) (Dr. GRPO)
                  sequence  mean over each completion's tokens, then over completions (GRPO)
"""
from __future__ import annotations

import torch

NORMALISATIONS = ("token", "constant", "sequence")


def group_advantages(rewards: torch.Tensor, group_size: int, baseline: str = "mean",
                     scale: str = "none") -> torch.Tensor:
    """rewards [P * G] grouped contiguously -> advantages [P * G] (float64)."""
    r = rewards.double().view(-1, group_size)  # [P, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if baseline in ("rloo", "leave_one_out"):
        adv = adv * group_size / (group_size - 1)
    elif baseline != "mean":
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale == "std":
        std = r.std(dim=1, keepdim=True)
        adv = torch.where(std > 0, adv / std.clamp(min=1e-12), torch.zeros_like(adv))
    return adv.reshape(-1)


def zero_signal_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P] bool: groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, max_penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then linear to -max_penalty."""
    excess = (lengths.double() - (max_new_tokens - buffer_tokens)) / buffer_tokens
    return -max_penalty * excess.clamp(min=0, max=1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float, clip_high: float, level: str = "token", normalisation: str = "token",
                max_new_tokens: int | None = None, ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss and detached statistics. `denominator` overrides the token / constant
    normalisation's divisor (the whole update's token count when the batch is split into passes)."""
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]  # [N, 1]
    delta = (logp - old_logp) * mask
    if level == "token":
        ratio = torch.exp(delta)
    elif level == "sequence":
        n = mask.sum(1, keepdim=True).clamp(min=1)
        seq = torch.exp(delta.sum(1, keepdim=True) / n)  # [N, 1]
        ratio = seq.detach() * torch.exp(logp - logp.detach())  # value s, gradient of p_t / sg[p_t]
    else:
        raise ValueError(f"unknown importance_sampling_level {level!r}")
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_logp is not None and beta:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
    per_token = per_token * mask
    if normalisation == "token":
        loss = per_token.sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    elif normalisation == "constant":
        if max_new_tokens is None:
            raise ValueError("normalisation 'constant' needs max_new_tokens")
        loss = per_token.sum() / (denominator if denominator is not None else mask.shape[0] * max_new_tokens)
    elif normalisation == "sequence":
        per_seq = per_token.sum(1) / mask.sum(1).clamp(min=1)
        loss = per_seq.sum() / (denominator if denominator is not None else mask.shape[0])
    else:
        raise ValueError(f"unknown normalisation {normalisation!r}")
    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        is_clipped = ((ratio > 1 + clip_high) & (adv > 0)) | ((ratio < 1 - clip_low) & (adv < 0))
        r = ratio.detach()
        stats = {"clip_fraction": (is_clipped.to(mask.dtype) * mask).sum() / n_tok,
                 "ratio_mean": (r * mask).sum() / n_tok,
                 "ratio_max": r.masked_fill(mask == 0, float("-inf")).max(),
                 "ratio_min": r.masked_fill(mask == 0, float("inf")).min(),
                 "tokens": mask.sum()}
        if kl is not None:
            stats["kl"] = (kl.detach() * mask).sum() / n_tok
    return loss, stats
