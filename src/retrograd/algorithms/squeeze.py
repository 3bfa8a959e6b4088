"""LoRA-Squeeze (arXiv 2602.10993, Algorithm 2): how much of a LoRA update each rank carries, and the
best lower-rank adapter, from the factors alone (never the out x in product).

For one adapted module, ΔW ∝ B A with A [r, in], B [out, r]. With the reduced QR factorisations
Aᵀ = Q_A R_A and B = Q_B R_B, B A = Q_B (R_B R_Aᵀ) Q_Aᵀ, so the singular values of ΔW are those of
the small matrix M = R_B R_Aᵀ (at most r x r): M = U S Vᵀ gives B A = (Q_B U) S (Q_A V)ᵀ.

  retained(k) = Σ_{j<k} S_j² / Σ S_j²     the share of ‖ΔW‖²_F the best rank-k update keeps
  compress(k): B' = Q_B U_k √S_k, A' = √S_k V_kᵀ Q_Aᵀ, the Eckart-Young best rank-k factors; the
               adapter's scale alpha / r is kept (alpha' = alpha k / r), so ΔW' = (alpha/r) B'A'.

Pure functions on tensors, in float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Spectrum:
    q_a: torch.Tensor  # [in, m]
    q_b: torch.Tensor  # [out, n]
    u: torch.Tensor  # [n, p]
    s: torch.Tensor  # [p] singular values of B A, descending
    vh: torch.Tensor  # [p, m]


def spectrum(a: torch.Tensor, b: torch.Tensor) -> Spectrum:
    """a [r, in], b [out, r] -> the SVD of b @ a through two QRs and an SVD of at most r x r."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA factors must be A [r, in] and B [out, r], got {tuple(a.shape)} and {tuple(b.shape)}")
    q_a, r_a = torch.linalg.qr(a.double().t())  # [in, m], [m, r]
    q_b, r_b = torch.linalg.qr(b.double())  # [out, n], [n, r]
    u, s, vh = torch.linalg.svd(r_b @ r_a.t(), full_matrices=False)  # [n, p], [p], [p, m]
    return Spectrum(q_a, q_b, u, s, vh)


def retained(s: torch.Tensor, k: int) -> float:
    """Share of the update's squared Frobenius norm kept by its best rank-k approximation (1.0 for a zero update)."""
    total = float((s.double() ** 2).sum())
    return 1.0 if total == 0 else float((s.double()[:k] ** 2).sum()) / total


def compress(sp: Spectrum, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-k factors (A' [k, in], B' [out, k]) of B A, float64. k beyond the spectrum pads with zeros."""
    p = sp.s.shape[0]
    kk = min(k, p)
    root = sp.s[:kk].sqrt()
    b = sp.q_b @ sp.u[:, :kk] * root[None]  # [out, kk]
    a = root[:, None] * (sp.vh[:kk] @ sp.q_a.t())  # [kk, in]
    if kk < k:
        a = torch.cat([a, a.new_zeros(k - kk, a.shape[1])])
        b = torch.cat([b, b.new_zeros(b.shape[0], k - kk)], dim=1)
    return a, b


def default_target_ranks(rank: int) -> list[int]:
    """1, 2, 4, ... below the source rank, and the source rank."""
    out, k = [], 1
    while k < rank:
        out.append(k)
        k *= 2
    return out + [rank]


def recommend(mean_retained: dict[int, float], min_retention: float, source_rank: int) -> int:
    """The smallest target rank whose mean retained variance reaches `min_retention` (else the source rank)."""
    ok = [k for k, v in sorted(mean_retained.items()) if v >= min_retention - 1e-12]
    return ok[0] if ok else source_rank
