"""PPO's critic maths (algorithms/gae.py): GAE by hand and against the textbook recursion written out
per episode, the value loss's gradient by finite differences, whitening and explained variance."""
import random

import pytest
import torch

from retrograd.algorithms.gae import explained_variance, gae, terminal_rewards, value_loss, whiten

D = torch.float64


def test_gae_by_hand():
    # one episode of 3 tokens, reward 1 at the end, V = (0.5, 0.2, 0.4), gamma 0.9, lambda 0.8
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    v = torch.tensor([[0.5, 0.2, 0.4]], dtype=D)
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(r, v, m, 0.9, 0.8)
    d2 = 1.0 - 0.4  # terminal: no V after the last token
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    assert adv.tolist()[0] == pytest.approx([a0, a1, a2])
    assert ret.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4])


def test_lambda_one_gamma_one_gives_monte_carlo_returns_and_lambda_zero_td():
    r = torch.tensor([[0.0, 0.5, 2.0, 0.0]], dtype=D)
    v = torch.tensor([[0.3, 0.1, 0.7, 9.0]], dtype=D)
    m = torch.tensor([[True, True, True, False]])
    _, ret = gae(r, v, m, 1.0, 1.0)
    assert ret.tolist()[0] == pytest.approx([2.5, 2.5, 2.0, 0.0])  # the reward-to-go; padding ignored
    adv, _ = gae(r, v, m, 1.0, 0.0)
    assert adv.tolist()[0] == pytest.approx([0.1 - 0.3, 0.5 + 0.7 - 0.1, 2.0 - 0.7, 0.0])


def _reference(rewards, values, gamma, lam):
    """The textbook recursion, one Python list per episode."""
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        nxt = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * nxt - values[t] + gamma * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize("seed", range(4))
def test_gae_against_the_recursion_on_ragged_episodes(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 7) for _ in range(5)]
    width = max(lengths)
    r = torch.zeros(5, width, dtype=D)
    v = torch.randn(5, width, dtype=D, generator=torch.Generator().manual_seed(seed))
    for i, n in enumerate(lengths):
        for t in range(n):
            r[i, t] = rng.uniform(-1, 1)
    m = torch.tensor(lengths)[:, None] > torch.arange(width)[None]
    gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.5, 1.0)
    adv, ret = gae(r, v, m, gamma, lam)
    for i, n in enumerate(lengths):
        want = _reference(r[i, :n].tolist(), v[i, :n].tolist(), gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(want)
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


def test_terminal_rewards_sit_on_the_last_token():
    out = terminal_rewards(torch.tensor([1.0, -2.0]), torch.tensor([3, 1]), 4)
    assert out.tolist() == [[0, 0, 1.0, 0], [-2.0, 0, 0, 0]]


def test_value_loss_gradient_and_clipping():
    torch.manual_seed(0)
    v = torch.randn(3, 4, dtype=D, requires_grad=True)
    r = torch.randn(3, 4, dtype=D)
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, r, m), (v,))
    assert float(value_loss(v, r, m)) == pytest.approx(float(((v - r)[m] ** 2).mean() / 2))
    old = v.detach() + 1.0  # the clipped branch binds when V moved far from V_old
    clipped = value_loss(v, r, m, old_values=old, clip=0.1)
    assert float(clipped) >= float(value_loss(v, r, m)) - 1e-12


def test_whiten_and_explained_variance():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]], dtype=D)
    m = torch.tensor([[True, True, True], [True, True, False]])
    w = whiten(x, m)
    assert float(w[m].mean()) == pytest.approx(0.0, abs=1e-12) and float(w[m].std(correction=0)) == pytest.approx(1.0)
    assert float(w[1, 2]) == 0.0
    r = torch.tensor([[1.0, 2.0, 3.0]], dtype=D)
    full = torch.ones(1, 3, dtype=torch.bool)
    assert explained_variance(r, r, full) == 1.0
    assert explained_variance(torch.full_like(r, 2.0), r, full) == pytest.approx(0.0)
