"""LoRA-Squeeze's maths against the dense product (never formed by the code): singular values, the
compressed factors at full rank equal the original update, and at rank k the update loses exactly
the variance reported as not retained (Eckart-Young)."""
import pytest
import torch

from retrograd.algorithms.squeeze import compress, default_target_ranks, recommend, retained, spectrum


def factors(r=6, n_in=20, n_out=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, n_in, generator=g, dtype=torch.float64), torch.randn(n_out, r, generator=g, dtype=torch.float64)


def test_singular_values_are_those_of_the_product():
    a, b = factors()
    dense = torch.linalg.svdvals(b @ a)[:6]
    assert torch.allclose(spectrum(a, b).s, dense, atol=1e-10)


@pytest.mark.parametrize("shape", [(6, 20, 14), (8, 5, 30), (4, 3, 3)])  # r > in and r > out too
def test_full_rank_compression_is_the_original_update(shape):
    a, b = factors(*shape)
    a2, b2 = compress(spectrum(a, b), shape[0])
    assert a2.shape == a.shape and b2.shape == b.shape
    assert torch.allclose(b2 @ a2, b @ a, atol=1e-10)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_rank_k_loses_exactly_the_reported_variance(k):
    a, b = factors()
    sp = spectrum(a, b)
    a2, b2 = compress(sp, k)
    full = b @ a
    lost = float(((full - b2 @ a2) ** 2).sum() / (full ** 2).sum())
    assert lost == pytest.approx(1 - retained(sp.s, k), abs=1e-10)
    u, s, vh = torch.linalg.svd(full)  # the dense best rank-k approximation is the same matrix
    assert torch.allclose(b2 @ a2, u[:, :k] * s[:k] @ vh[:k], atol=1e-9)


def test_retained_by_hand_and_the_recommendation():
    s = torch.tensor([3.0, 2.0, 1.0])  # squares 9, 4, 1 of 14
    assert retained(s, 1) == pytest.approx(9 / 14) and retained(s, 2) == pytest.approx(13 / 14)
    assert retained(torch.zeros(3), 1) == 1.0
    assert default_target_ranks(8) == [1, 2, 4, 8] and default_target_ranks(6) == [1, 2, 4, 6]
    assert recommend({1: 0.6, 2: 0.93, 4: 0.99, 8: 1.0}, 0.95, 8) == 4
    assert recommend({1: 0.6, 2: 0.9}, 0.95, 8) == 8
