"""Delight gating (Osband 2026, arXiv 2603.14608): each token's advantage scaled by a gate that
opens on surprising tokens of good rollouts and on unsurprising tokens of bad ones.

The maths behind the `delight`, `delight_sepa` and `hard_delight` token transforms
(registered in transforms.py), following teilomillet/retrain's advantages/delight/. All of it is
per rollout (row) on s = min(-log p, 50), the sampled-token surprisal, whatever the configured
uncertainty kind (retrain does the same); rows with A = 0 get zero token advantages.

  norm      s' = s (none) | s / std(s) (scale, population std, no centring) |
            s / (1.4826 MAD(s)) (mad_scale, falls back to scale when MAD ~ 0); rows with < 2
            tokens or std < 1e-8 stay unscaled
  gate      g = sigmoid(A s' / eta), exactly 0 / 1 beyond |x| > 20
  delight   a = A g                        delight_sepa  a = A ((1 - lam) + lam g)
  hard      keep the k = max(1, floor(n k_frac)) highest-s tokens when A > 0, lowest when A < 0;
            a = A ((1 - lam) + lam keep)
  eta       fixed: `eta`. adaptive, per group: eta = quantile(|A s'|, eta_target_neutral_frac)
            / ln(0.6/0.4), clipped to [eta_min, eta_max] (a token at the quantile gets gate 0.6);
            shrunk by max(gap / eta_target_ordering_gap, 0.25) when the mean sign-corrected
            ordering gap is below that target; then EMA with the previous step's eta.

State between steps: the adaptive eta's EMA reads the previous step's eta from
`state["delight_eta_ema"]` and writes this step's (the mean over the groups with signal); the
loop keeps that dict and saves it in checkpoints, as retrain saves `delight_eta_ema`.
"""
from __future__ import annotations

import math

import torch

from retrograd.algorithms.advantages import average_metrics, group_slices, signal_slices

MAX_SURPRISAL = 50.0
NORM_MODES = ("none", "scale", "mad_scale")
ETA_MODES = ("fixed", "adaptive")
NEUTRAL_LOGIT = math.log(0.6 / 0.4)  # sigmoid(x) = 0.6 at this x
MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its std


def surprisals(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """min(-log p, 50) on sampled tokens, 0 elsewhere; [N, T] float64."""
    return torch.where(mask, (-logprobs.double()).clamp(max=MAX_SURPRISAL), torch.zeros((), dtype=torch.float64))


def _row_median(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Median of each row's masked values (mean of the two middle ones for an even count), [N]."""
    n = mask.sum(1)
    ordered = torch.where(mask, x, torch.full_like(x, math.inf)).sort(dim=1).values
    lo, hi = ((n - 1).clamp(min=0) // 2)[:, None], (n // 2).clamp(max=x.shape[1] - 1)[:, None]
    return 0.5 * (ordered.gather(1, lo) + ordered.gather(1, hi)).squeeze(1)


def scale_surprisals(s: torch.Tensor, mask: torch.Tensor, norm_mode: str) -> torch.Tensor:
    """Per-row scaling without centring (centring would flip the gate for most tokens, since
    surprisal is right-skewed). [N, T] -> [N, T]."""
    if norm_mode not in NORM_MODES:
        raise ValueError(f"delight norm_mode must be one of {NORM_MODES}, got {norm_mode!r}")
    if norm_mode == "none":
        return s
    n = mask.sum(1)  # [N]
    mean = (s * mask).sum(1) / n.clamp(min=1)
    std = ((((s - mean[:, None]) ** 2) * mask).sum(1) / n.clamp(min=1)).sqrt()
    scaled = torch.where(((n >= 2) & (std >= 1e-8))[:, None], s / std.clamp(min=1e-300)[:, None], s)
    if norm_mode == "mad_scale":
        med = _row_median(s, mask)
        robust = MAD_TO_STD * _row_median((s - med[:, None]).abs(), mask)
        scaled = torch.where(((n >= 2) & (robust >= 1e-8))[:, None], s / robust.clamp(min=1e-300)[:, None], scaled)
    return torch.where(mask, scaled, torch.zeros_like(scaled))


def gates(adv: torch.Tensor, s: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """sigmoid(A s / eta) per token, [N, T]; adv and eta are per row [N]."""
    x = adv[:, None] * s / eta.clamp(min=1e-8)[:, None]
    return torch.where(x > 20, 1.0, torch.where(x < -20, 0.0, torch.sigmoid(x)))


def ordering_gaps(adv: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per row with >= 2 tokens: mean gate of the higher-s half minus that of the lower-s half,
    sign-flipped for A < 0 (positive = the gate orders tokens as intended). [rows kept]."""
    n = mask.sum(1)
    order = torch.where(mask, s, torch.full_like(s, math.inf)).argsort(dim=1, stable=True)
    g_sorted = g.gather(1, order)  # gates by ascending s, masked positions last
    half = (n // 2)[:, None]
    pos = torch.arange(s.shape[1])[None, :]
    low = (g_sorted * (pos < half)).sum(1) / half.squeeze(1).clamp(min=1)
    high = (g_sorted * ((pos >= n[:, None] - half) & (pos < n[:, None]))).sum(1) / half.squeeze(1).clamp(min=1)
    gap = torch.where(adv > 0, high - low, low - high)
    return gap[n >= 2]


def _quantile(values: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile of a flat tensor, q in [0, 1]."""
    ordered = values.sort().values
    pos = q * (ordered.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(ordered[lo] * (1 - (pos - lo)) + ordered[hi] * (pos - lo))


def _check(cfg: dict) -> None:
    if cfg["eta_mode"] not in ETA_MODES:
        raise ValueError(f"delight eta_mode must be one of {ETA_MODES}, got {cfg['eta_mode']!r}")
    decay = cfg["eta_ema_decay"]
    if decay is not None and not 0.0 <= decay < 1.0:
        raise ValueError(f"delight eta_ema_decay must be in [0, 1) or unset, got {decay}")


def group_eta(adv: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, cfg: dict,
              prev_eta: float | None) -> tuple[float, dict[str, float]]:
    """One group's eta and its dg_eta* metrics; `s` already scaled by the norm mode."""
    base = max(float(cfg["eta"]), 1e-8)
    if cfg["eta_mode"] == "fixed":
        return base, {"dg_eta": base, "dg_eta_adaptive": 0.0}
    decay = float(cfg["eta_ema_decay"] or 0.0)
    smooth = prev_eta is not None and decay > 0
    live = adv != 0
    if not live.any():
        eta = max(decay * prev_eta + (1 - decay) * base, 1e-8) if smooth else base
        metrics = {"dg_eta": eta, "dg_eta_adaptive": 1.0}
        if smooth:
            metrics.update(dg_eta_raw=base, dg_eta_prev=prev_eta, dg_eta_ema_decay=decay)
        return eta, metrics
    neutral = min(max(float(cfg["eta_target_neutral_frac"]), 0.0), 1.0)
    target_gap = max(0.0, float(cfg["eta_target_ordering_gap"] or 0.0))
    eta_min = max(1e-8, float(cfg["eta_min"]))
    eta_max = max(eta_min, float(cfg["eta_max"]))
    adv, s, mask = adv[live], s[live], mask[live]
    magnitudes = (adv[:, None] * s).abs()[mask]
    eta = _quantile(magnitudes, neutral) / NEUTRAL_LOGIT if magnitudes.numel() else base
    eta = min(max(eta, eta_min), eta_max)
    if target_gap > 0:
        gaps = ordering_gaps(adv, s, mask, gates(adv, s, torch.full_like(adv, eta)))
        if gaps.numel() and float(gaps.mean()) < target_gap:
            eta = min(max(eta * max(float(gaps.mean()) / target_gap, 0.25), eta_min), eta_max)
    raw = eta
    if smooth:
        eta = min(max(decay * prev_eta + (1 - decay) * eta, eta_min), eta_max)
    metrics = {"dg_eta": eta, "dg_eta_adaptive": 1.0, "dg_eta_target_neutral_frac": neutral,
               "dg_eta_target_ordering_gap": target_gap, "dg_eta_min": eta_min, "dg_eta_max": eta_max}
    if smooth:
        metrics.update(dg_eta_raw=raw, dg_eta_prev=prev_eta, dg_eta_ema_decay=decay)
    return eta, metrics


def _gate_metrics(adv, s, mask, g, token_adv, lam) -> dict[str, float]:
    """retrain's dg_* diagnostics for one group (empty when no row has a non-zero advantage)."""
    live = adv != 0
    sel = mask & live[:, None]
    values = g[sel]
    if values.numel() == 0:
        return {}
    m = {"dg_gate_mean": float(values.mean()), "dg_gate_std": float(values.std(correction=0)),
         "dg_gate_min": float(values.min()), "dg_gate_max": float(values.max()),
         "dg_breakthrough_frac": float((values > 0.8).double().mean()),
         "dg_suppressed_frac": float((values < 0.2).double().mean()),
         "dg_neutral_frac": float(((values >= 0.4) & (values <= 0.6)).double().mean())}
    for name, rows in (("pos", adv > 0), ("neg", adv < 0)):
        if (mask & rows[:, None]).any():
            m[f"dg_gate_mean_{name}"] = float(g[mask & rows[:, None]].mean())
    gaps = ordering_gaps(adv[live], s[live], mask[live], g[live])
    signs = adv[live][mask[live].sum(1) >= 2]
    for key, keep in (("", torch.ones_like(signs, dtype=torch.bool)), ("_pos", signs > 0), ("_neg", signs < 0)):
        if keep.any():
            m[f"dg_gate_ordering_gap{key}"] = float(gaps[keep].mean())
    if lam is not None:
        m["dg_lambda"] = lam
    flat = token_adv[mask]
    if flat.numel():
        bias = float(flat.sum() - (adv * mask.sum(1)).sum())
        m["dg_net_advantage_bias"] = bias
        m["dg_net_advantage_bias_per_token"] = bias / flat.numel()
        m["dg_token_adv_std"] = float(flat.std(correction=0))
        n = mask.sum(1)
        rows = n >= 2
        if rows.any():
            mean = (token_adv * mask).sum(1) / n.clamp(min=1)
            var = (((token_adv - mean[:, None]) ** 2) * mask).sum(1) / n.clamp(min=1)
            m["dg_within_rollout_adv_var"] = float(var[rows].mean())
    return m


def delight_advantages(adv: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                       cfg: dict, state: dict, lam: float | None,
                       default_norm: str) -> tuple[torch.Tensor, dict[str, float]]:
    """`delight` (lam None) or `delight_sepa` (lam = the blend weight) token advantages [N, T]."""
    _check(cfg)
    norm = cfg["norm_mode"] if cfg["norm_mode"] is not None else default_norm
    s = scale_surprisals(surprisals(logprobs, mask), mask, norm)
    slices = group_slices(group)
    prev = state.get("delight_eta_ema")
    eta_rows = torch.empty_like(adv)
    eta_metrics = []
    for sl in slices:
        eta, m = group_eta(adv[sl], s[sl], mask[sl], cfg, None if prev is None else float(prev))
        eta_rows[sl] = eta
        eta_metrics.append(m)
    g = gates(adv, s, eta_rows)  # [N, T]
    weight = g if lam is None else (1 - min(max(lam, 0.0), 1.0)) + min(max(lam, 0.0), 1.0) * g
    token_adv = torch.where(mask & (adv != 0)[:, None], adv[:, None] * weight, torch.zeros_like(s))
    reported = signal_slices(adv, slices)
    per_group = [{**_gate_metrics(adv[sl], s[sl], mask[sl], g[sl], token_adv[sl], lam), **em}
                 for sl, em in zip(slices, eta_metrics) if sl in reported]
    metrics = average_metrics(per_group)
    if cfg["eta_mode"] == "adaptive" and "dg_eta" in metrics:  # the next step's EMA reads it
        state["delight_eta_ema"] = metrics["dg_eta"]
    return token_adv, metrics


def hard_keep(adv: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, k_frac: float) -> torch.Tensor:
    """[N, T] bool: the k = max(1, floor(n k_frac)) highest-s tokens of rows with A > 0, the k
    lowest of rows with A < 0 (ties: the earlier token first); nothing for A = 0."""
    n = mask.sum(1)
    k = torch.clamp(torch.floor(n.double() * k_frac), min=1)  # [N]
    key = torch.where(adv[:, None] > 0, -s, s)
    key = torch.where(mask, key, torch.full_like(key, math.inf))
    order = key.argsort(dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(s.shape[1]).expand_as(order).contiguous())
    return (rank < k[:, None]) & mask & (adv != 0)[:, None]


def hard_delight_advantages(adv: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                            k_frac: float, lam: float) -> tuple[torch.Tensor, dict[str, float]]:
    """`hard_delight`: A ((1 - lam) + lam keep) per token, [N, T]; lam = 0 is plain A."""
    s = surprisals(logprobs, mask)
    lam_c = min(max(lam, 0.0), 1.0)
    keep = hard_keep(adv, s, mask, k_frac).double()
    token_adv = torch.where(mask & (adv != 0)[:, None], adv[:, None] * ((1 - lam_c) + lam_c * keep),
                            torch.zeros_like(s))
    per_group = []
    slices = group_slices(group)
    for sl in signal_slices(adv, slices):
        flat = token_adv[sl][mask[sl]]
        m = {"hard_dg_active_frac": float((flat != 0).sum()) / max(flat.numel(), 1),
             "hard_dg_k_frac": float(k_frac), "hard_dg_lambda": float(lam)}
        if flat.numel():
            m["hard_dg_net_bias"] = float(flat.sum() - (adv[sl] * mask[sl].sum(1)).sum())
        per_group.append(m)
    return token_adv, average_metrics(per_group)
