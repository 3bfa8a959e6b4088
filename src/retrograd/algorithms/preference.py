"""Preference losses (DPO, IPO, SimPO, ORPO) as pure functions of per-response log-probabilities.

Every loss reads only, per pair, the summed log-probability S of the chosen (c) and rejected (r)
response under the policy, its token count n (l = S / n is the per-token mean), and for DPO/IPO
the reference model's summed log-probability R of the same response:

  DPO    m = beta * ((S_c - R_c) - (S_r - R_r));  L = (1 - eps) * softplus(-m) + eps * softplus(m)
         (eps = label_smoothing: conservative DPO)
  IPO    h = (S_c - R_c) / n_c - (S_r - R_r) / n_r;  L = (h - 1 / (2 * beta))^2
  SimPO  m = beta * (l_c - l_r - gamma_beta_ratio);  L = softplus(-m)   (no reference)
  ORPO   l clamped to <= -1e-6;  logodds(l) = l - log(1 - e^l);  z = logodds(l_c) - logodds(l_r);
         L = -l_c + beta * softplus(-z)   (beta is the odds-ratio weight lambda; no reference)

The math runs in float64 (S sums hundreds of float32 terms; the differences that matter are small),
and gradients flow back into S through autograd. "Rewards" are the implicit rewards each loss
compares: beta * (S - R) for DPO, beta * (S - R) / n for IPO, beta * l for SimPO and ORPO; the
accuracy counts pairs whose chosen reward is higher, a tie as half (so it is 0.5 at initialisation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")
ORPO_MAX_MEAN_LOGP = -1e-6


@dataclass(frozen=True)
class PreferenceParams:
    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma_beta_ratio: float = 0.5


def preference_loss(p: PreferenceParams, s_chosen: torch.Tensor, s_rejected: torch.Tensor,
                    n_chosen: torch.Tensor, n_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor | None = None, ref_rejected: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses [P] (float64) and per-pair statistics (detached, float64).

    s_* [P] summed policy log-probs, n_* [P] response token counts, ref_* [P] summed reference
    log-probs (DPO/IPO only)."""
    if p.loss not in LOSSES:
        raise ValueError(f"unknown preference loss {p.loss!r}; one of {', '.join(LOSSES)}")
    sc, sr = s_chosen.double(), s_rejected.double()
    nc, nr = n_chosen.double(), n_rejected.double()
    stats: dict[str, torch.Tensor] = {}
    if p.loss in NEEDS_REFERENCE:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"{p.loss} needs the reference log-probabilities")
        dc, dr = sc - ref_chosen.double(), sr - ref_rejected.double()
        if p.loss == "dpo":
            m = p.beta * (dc - dr)
            loss = (1 - p.label_smoothing) * F.softplus(-m) + p.label_smoothing * F.softplus(m)
            reward_c, reward_r = p.beta * dc, p.beta * dr
        else:
            h = dc / nc - dr / nr
            loss = (h - 1 / (2 * p.beta)) ** 2
            reward_c, reward_r = p.beta * dc / nc, p.beta * dr / nr
    else:
        lc, lr = sc / nc, sr / nr
        if p.loss == "simpo":
            loss = F.softplus(-p.beta * (lc - lr - p.gamma_beta_ratio))
        else:
            clamped = (lc > ORPO_MAX_MEAN_LOGP).double() + (lr > ORPO_MAX_MEAN_LOGP).double()
            lc, lr = lc.clamp(max=ORPO_MAX_MEAN_LOGP), lr.clamp(max=ORPO_MAX_MEAN_LOGP)
            z = (lc - torch.log(-torch.expm1(lc))) - (lr - torch.log(-torch.expm1(lr)))
            loss = -lc + p.beta * F.softplus(-z)
            stats.update(nll=-lc.detach(), log_odds=z.detach(), orpo_clamped=clamped / 2)
        reward_c, reward_r = p.beta * lc, p.beta * lr
    margin = (reward_c - reward_r).detach()
    stats.update(chosen_reward=reward_c.detach(), rejected_reward=reward_r.detach(), margin=margin,
                 accuracy=(margin > 0).double() + 0.5 * (margin == 0).double(),
                 chosen_logps=sc.detach(), rejected_logps=sr.detach())
    return loss, stats

