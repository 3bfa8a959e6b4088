"""GRPO maths against hand values, finite differences and the plain policy gradient."""
import math

import pytest
import torch

from retrograd.algorithms.policy import group_advantages, k3_kl, overlong_penalty, policy_loss, zero_signal_groups

D = torch.float64


def test_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert group_advantages(r, 4).tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    assert group_advantages(r, 4, "rloo").tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    # rloo is r_i minus the mean of the others
    assert group_advantages(r, 4, "rloo")[0] == pytest.approx(1.0 - (0 + 0 + 1) / 3)
    std = float(torch.tensor([1.0, 0.0, 0.0, 1.0]).std())
    assert group_advantages(r, 4, scale="std")[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert group_advantages(r, 4, scale="std")[4:].tolist() == [0, 0, 0, 0]
    assert zero_signal_groups(r, 4).tolist() == [False, True]


def test_k3_and_overlong():
    assert float(k3_kl(torch.tensor(-1.0, dtype=D), torch.tensor(-1.0, dtype=D))) == 0.0
    assert float(k3_kl(torch.tensor(-1.0, dtype=D), torch.tensor(-2.0, dtype=D))) == pytest.approx(math.exp(-1) + 1 - 1)
    assert overlong_penalty(torch.tensor([10, 14, 16, 20]), 20, 8, 1.0).tolist() == [0.0, -0.25, -0.5, -1.0]


def test_clipping_by_hand():
    mask = torch.ones(1, 1)
    # A > 0, ratio 1.5 beyond 1 + 0.28: objective 1.28 * A, no gradient
    logp = torch.tensor([[math.log(1.5)]], dtype=D, requires_grad=True)
    loss, st = policy_loss(logp, torch.zeros(1, 1, dtype=D), torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert float(loss) == pytest.approx(-1.28) and float(logp.grad) == 0.0 and float(st["clip_fraction"]) == 1.0
    # A < 0, ratio 0.5 below 1 - 0.2: objective 0.8 * A, no gradient
    logp = torch.tensor([[math.log(0.5)]], dtype=D, requires_grad=True)
    loss, st = policy_loss(logp, torch.zeros(1, 1, dtype=D), torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert float(loss) == pytest.approx(0.8) and float(logp.grad) == 0.0
    # A < 0, ratio 1.5: not clipped (pessimistic side), gradient -A * ratio
    logp = torch.tensor([[math.log(1.5)]], dtype=D, requires_grad=True)
    loss, st = policy_loss(logp, torch.zeros(1, 1, dtype=D), torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert float(loss) == pytest.approx(1.5) and float(logp.grad) == pytest.approx(1.5) and float(st["clip_fraction"]) == 0


def test_normalisations_by_hand():
    logp = torch.zeros(2, 3, dtype=D)  # ratio 1 everywhere: per-token loss = -A
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, 2.0])
    kw = dict(clip_low=0.2, clip_high=0.2, max_new_tokens=5)
    assert float(policy_loss(logp, logp, adv, mask, normalisation="token", **kw)[0]) == pytest.approx(-(3 + 2) / 4)
    assert float(policy_loss(logp, logp, adv, mask, normalisation="constant", **kw)[0]) == pytest.approx(-(3 + 2) / 10)
    assert float(policy_loss(logp, logp, adv, mask, normalisation="sequence", **kw)[0]) == pytest.approx(-(1 + 2) / 2)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalisation", ["token", "constant", "sequence"])
def test_at_ratio_one_the_loss_is_the_policy_gradient(level, normalisation):
    torch.manual_seed(0)
    logp = (-torch.rand(3, 4, dtype=D) * 3).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=D)
    adv = torch.tensor([0.7, -0.2, 1.5], dtype=D)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28, level=level,
                          normalisation=normalisation, max_new_tokens=4)
    loss.backward()
    n = mask.sum(1, keepdim=True)
    per_token = -adv[:, None] * mask  # at ratio 1, token level and GSPO-token give the same gradient
    want = {"token": per_token / mask.sum(), "constant": per_token / (3 * 4), "sequence": per_token / n / 3}[normalisation]
    assert torch.allclose(logp.grad, want, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradient_matches_finite_differences(level):
    torch.manual_seed(1)
    old = -torch.rand(3, 5, dtype=D) * 2
    ref = old + 0.1 * torch.randn(3, 5, dtype=D)
    logp = (old + 0.05 * torch.randn(3, 5, dtype=D)).requires_grad_()  # ratios inside the clip band
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=D)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=D)

    def f(x):
        return policy_loss(x, old, adv, mask, clip_low=0.3, clip_high=0.3, level=level, normalisation="token",
                           ref_logp=ref, beta=0.05)[0]
    if level == "token":
        assert torch.autograd.gradcheck(f, (logp,))
    else:  # GSPO-token's gradient is sg[s] * A / p_t * dp_t: check it against its own definition
        f(logp).backward()
        s = torch.exp(((logp.detach() - old) * mask).sum(1) / mask.sum(1))
        k3_grad = 0.05 * (1 - torch.exp(ref - logp.detach()))
        want = (-(s * adv)[:, None] + k3_grad) * mask / mask.sum()
        assert torch.allclose(logp.grad, want, atol=1e-12)


def test_sequence_ratio_is_the_geometric_mean():
    old = torch.zeros(1, 4, dtype=D)
    logp = torch.tensor([[0.1, 0.2, 0.3, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    _, st = policy_loss(logp, old, torch.tensor([1.0], dtype=D), mask, clip_low=1, clip_high=10, level="sequence")
    assert float(st["ratio_mean"]) == pytest.approx(math.exp(0.2))
