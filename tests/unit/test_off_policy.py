"""Importance weights for off-policy rollouts (algorithms/off_policy.py) against hand values.

Shared inputs: old = [-1, -2, -0.5], behaviour q = [-1.2, -1.5, -0.5], so delta = old - q =
[0.2, -0.5, 0], token ratios [e^0.2, e^-0.5, 1] = [1.2214028, 0.6065307, 1] and the sequence ratio
their product e^-0.3 = 0.7408182.
"""
from __future__ import annotations

import math

import pytest
import torch

from retrograd.algorithms.off_policy import DEFAULT_CLIP_MAX, MODES, importance_weights

D = torch.float64
OLD, Q = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D), torch.tensor([[-1.2, -1.5, -0.5]], dtype=D)
ONES = torch.ones(1, 3, dtype=D)
R = [1.2214028, 0.6065307, 1.0]
S = 0.7408182


def w(mode, clip_max=DEFAULT_CLIP_MAX, clip_min=None, mask=ONES):
    weights, stats = importance_weights(OLD, Q, mask, mode, clip_max, clip_min)
    return weights[0].tolist(), {k: float(v) for k, v in stats.items()}


def test_modes_and_defaults():
    assert MODES == ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    assert DEFAULT_CLIP_MAX == 3.0


def test_none_is_ones_but_reports_the_ratios():
    weights, st = w("none")
    assert weights == [1.0, 1.0, 1.0]
    assert st["is_ratio_max"] == pytest.approx(R[0]) and st["is_ratio_min"] == pytest.approx(R[1])
    assert st["is_ratio_mean"] == pytest.approx(sum(R) / 3) and st["is_masked_fraction"] == 0


def test_token_truncate_by_hand():
    assert w("token_truncate")[0] == pytest.approx(R)  # all below 3: untouched
    weights, st = w("token_truncate", clip_max=1.1, clip_min=0.7)
    assert weights == pytest.approx([1.1, 0.7, 1.0])
    assert st["is_truncated_fraction"] == pytest.approx(2 / 3) and st["is_masked_fraction"] == 0
    assert st["is_weight_mean"] == pytest.approx((1.1 + 0.7 + 1.0) / 3)
    assert w("token_truncate", clip_max=1.1)[0] == pytest.approx([1.1, R[1], 1.0])  # no lower bound


def test_token_mask_zeroes_tokens_outside_the_band():
    weights, st = w("token_mask", clip_max=1.1, clip_min=0.7)
    assert weights == pytest.approx([0.0, 0.0, 1.0]) and st["is_masked_fraction"] == pytest.approx(2 / 3)
    assert w("token_mask", clip_max=1.1)[0] == pytest.approx([0.0, R[1], 1.0])
    assert st["is_ratio_max"] == pytest.approx(R[0])  # stats are the ratios before masking


def test_sequence_modes_use_the_product_of_the_token_ratios():
    assert w("sequence_truncate")[0] == pytest.approx([S, S, S])
    assert w("sequence_truncate", clip_min=0.8)[0] == pytest.approx([0.8, 0.8, 0.8])
    weights, st = w("sequence_mask", clip_min=0.8)
    assert weights == [0.0, 0.0, 0.0] and st["is_masked_fraction"] == 1.0
    weights, st = w("sequence_mask", clip_min=0.5)
    assert weights == pytest.approx([S, S, S]) and st["is_ratio_mean"] == pytest.approx(S)
    assert S == pytest.approx(R[0] * R[1] * R[2], abs=1e-6)


def test_sequence_ratio_is_the_product_over_the_mask_only():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, dtype=D, generator=g) * 3
    q = old + 0.2 * torch.randn(3, 5, dtype=D, generator=g)
    q[1, 3:] = -50.0  # padding: would be a ratio of ~e^48 if it counted
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=D)
    token, _ = importance_weights(old, q, mask, "token_truncate", 1e6)
    seq, st = importance_weights(old, q, mask, "sequence_truncate", 1e6)
    for i in range(3):
        valid = [j for j in range(5) if mask[i, j] > 0]
        product = math.prod(float(token[i, j]) for j in valid)
        assert seq[i, valid].tolist() == pytest.approx([product] * len(valid))
    assert token[1, 3:].tolist() == seq[1, 3:].tolist() == [1.0, 1.0]  # weights are 1 outside the mask
    assert st["is_ratio_max"] < 10


def test_sequence_mask_drops_whole_sequences_and_keeps_the_others():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=D)
    q = torch.tensor([[-1.5, -1.5, -9.0], [-1.1, -0.9, -1.0]], dtype=D)  # seq 0: e^1.0 (pad not counted)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
    weights, st = importance_weights(old, q, mask, "sequence_mask", 2.0)
    assert weights[0].tolist() == [0.0, 0.0, 1.0]  # e = 2.718 > 2: both trained tokens dropped
    assert weights[1].tolist() == pytest.approx([1.0, 1.0, 1.0])  # e^(0.1 - 0.1 + 0) = 1
    assert float(st["is_masked_fraction"]) == pytest.approx(2 / 5)
    assert float(st["is_ratio_max"]) == pytest.approx(math.e)


def test_nan_behaviour_logprobs_get_no_correction_and_extremes_are_clamped():
    q = torch.tensor([[float("nan"), -60.0, -0.5]], dtype=D)
    old = torch.tensor([[-1.0, 0.0, -0.5]], dtype=D)
    weights, st = importance_weights(old, q, ONES, "token_truncate", 1e12)
    assert weights[0].tolist() == pytest.approx([1.0, math.exp(20), 1.0])
    weights, _ = importance_weights(old, q, ONES, "sequence_truncate", 1e12)
    assert weights[0].tolist() == pytest.approx([math.exp(20)] * 3)
    assert all(math.isfinite(float(v)) for v in st.values())


def test_weights_are_detached_and_errors_name_the_fix():
    old = OLD.clone().requires_grad_()
    weights, stats = importance_weights(old, Q, ONES, "token_mask", 3.0)
    assert not weights.requires_grad and not any(v.requires_grad for v in stats.values())
    with pytest.raises(ValueError, match="token_truncate, token_mask"):
        importance_weights(OLD, Q, ONES, "tis", 3.0)
    with pytest.raises(ValueError, match="clip_min <= clip_max"):
        importance_weights(OLD, Q, ONES, "token_mask", 1.0, clip_min=2.0)
