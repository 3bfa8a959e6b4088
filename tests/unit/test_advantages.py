"""Episode advantages, batch normalisation and the cap: hand values, a plain-Python
re-implementation of retrain's definitions, and the properties of each formula."""
import math
import random

import pytest
import torch

from retrograd.algorithms.advantages import (EPISODE_ADVANTAGES, average_metrics, batch_advantage_norm,
                                             clip_token_advantages, entropic_beta, group_slices,
                                             overlong_penalty, signal_slices, zero_signal_groups)

D = torch.float64


def adv(name, rewards, **params):
    entry = EPISODE_ADVANTAGES.entry(name)
    return entry.fn(torch.tensor(rewards, dtype=D), {**entry.defaults, **params})


# -- plain-Python references (one group = one list) ------------------------------------------

def ref_grpo(r):
    m = sum(r) / len(r)
    return [x - m for x in r]


def ref_rloo(r):
    return [x - (sum(r) - x) / (len(r) - 1) for x in r]


def ref_maxrl(r):
    m = sum(r) / len(r)
    return [0.0] * len(r) if m <= 1e-6 else [(x - m) / (m + 1e-6) for x in r]


def ref_softmax(r, beta):
    top = max(r)
    e = [math.exp(max(-700.0, beta * (x - top))) for x in r]
    return [v / sum(e) for v in e]


def ref_kl(p):
    return sum(q * (math.log(q) + math.log(len(p))) for q in p if q > 0)


def ref_discover(r, target=0.2, beta_max=50.0, steps=24, beta=None):
    if max(r) - min(r) <= 1e-12:
        b = 0.0
    elif beta is not None:
        b = max(0.0, beta)
    elif ref_kl(ref_softmax(r, beta_max)) <= target:
        b = beta_max
    else:
        lo, hi, b = 0.0, beta_max, 0.0
        for _ in range(steps):
            mid = (lo + hi) / 2
            if ref_kl(ref_softmax(r, mid)) <= target:
                b, lo = mid, mid
            else:
                hi = mid
    return b, [len(r) * p - 1 for p in ref_softmax(r, b)]


def random_groups(seed, n_groups=6, size=5):
    rng = random.Random(seed)
    groups = []
    for i in range(n_groups):
        kind = i % 3
        if kind == 0:
            groups.append([float(rng.random() < 0.4) for _ in range(size)])
        elif kind == 1:
            groups.append([rng.uniform(-2, 3) for _ in range(size)])
        else:
            groups.append([rng.choice([0.0, 0.5, 1.0]) for _ in range(size)])
    groups.append([1.0] * size)  # constant
    groups.append([0.0] * size)  # nothing correct
    return groups


# -- hand values --------------------------------------------------------------------------------

def test_by_hand():
    r = [[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [1.0, 0.0, 0.0, 0.0]]
    assert adv("grpo", r).tolist() == [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [0.75, -0.25, -0.25, -0.25]]
    assert adv("reinforce_pp", r).tolist() == adv("grpo", r).tolist()
    # rloo: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert adv("rloo", r)[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # maxrl, 1 of 4 correct (p = 1/4): correct (1 - 1/4) / (1/4 + 1e-6), wrong -(1/4) / (1/4 + 1e-6)
    assert adv("maxrl", r)[2].tolist() == pytest.approx([0.75 / 0.250001, -0.25 / 0.250001, -0.25 / 0.250001,
                                                         -0.25 / 0.250001], rel=1e-12)
    assert adv("maxrl", r)[1].tolist() == [0.0] * 4
    # grpo_std: sample std of (1, 0, 0, 1) is sqrt(1/3)
    assert adv("grpo_std", r)[0].tolist() == pytest.approx([0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)] * 1
                                                           + [-0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 3)])
    assert adv("grpo_std", r)[1].tolist() == [0.0] * 4


def test_discover_by_hand():
    # beta = ln 3 on rewards (0, 1): p = (1/4, 3/4), A = 2 p - 1 = (-1/2, 1/2)
    assert adv("discover_entropic", [[0.0, 1.0]], beta=math.log(3)).tolist()[0] == pytest.approx([-0.5, 0.5])
    # constant rewards: beta 0 and exactly zero advantages, whatever the fixed beta
    assert adv("discover_entropic", [[0.3, 0.3, 0.3]], beta=5.0).tolist() == [[0.0, 0.0, 0.0]]
    # a tiny spread: even beta_max = 50 keeps KL under 0.2, so beta = beta_max
    beta, kl = entropic_beta(torch.tensor([[0.0, 0.001]], dtype=D), {})
    assert float(beta) == 50.0 and float(kl) <= 0.2


def test_grpo_std_is_the_original_grpo():
    # (r - mean) / unbiased std per group, 0 for a group whose rewards are all equal
    torch.manual_seed(0)
    r = torch.randint(0, 3, (7, 6)).double()
    r[2] = 1.0
    for got, row in zip(adv("grpo_std", r.tolist()).tolist(), r.tolist()):
        m = sum(row) / len(row)
        sd = (sum((x - m) ** 2 for x in row) / (len(row) - 1)) ** 0.5
        assert got == pytest.approx([(x - m) / sd if sd > 0 else 0.0 for x in row], abs=1e-12)
    assert adv("grpo_std", r.tolist())[2].tolist() == [0.0] * 6


# -- re-implementation ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_reference(seed):
    groups = random_groups(seed)
    for name, ref in (("grpo", ref_grpo), ("rloo", ref_rloo), ("maxrl", ref_maxrl), ("reinforce_pp", ref_grpo)):
        got = adv(name, groups).tolist()
        for g, r in zip(got, groups):
            assert g == pytest.approx(ref(r), abs=1e-12), name
    got = adv("discover_entropic", groups)
    betas, _ = entropic_beta(torch.tensor(groups, dtype=D), {"beta": None, "target_kl": 0.2, "beta_max": 50.0,
                                                              "search_steps": 24})
    for g, b, r in zip(got.tolist(), betas.tolist(), groups):
        ref_b, ref_a = ref_discover(r)
        assert b == pytest.approx(ref_b, abs=1e-12)
        assert g == pytest.approx(ref_a, abs=1e-12)
    got = adv("discover_entropic", groups, target_kl=0.05, beta_max=10.0)
    for g, r in zip(got.tolist(), groups):
        assert g == pytest.approx(ref_discover(r, target=0.05, beta_max=10.0)[1], abs=1e-12)


# -- properties --------------------------------------------------------------------------------

def test_properties_binary_rewards():
    size = 8
    for k in range(size + 1):
        r = [[1.0] * k + [0.0] * (size - k)]
        a = adv("grpo", r)[0]
        assert float(a.abs().max()) <= (size - 1) / size + 1e-12
        m = adv("maxrl", r)[0].tolist()
        p = k / size
        if k == 0:
            assert m == [0.0] * size
        else:
            assert m[:k] == pytest.approx([(1 - p) / p] * k, rel=1e-5)
            assert m[k:] == pytest.approx([-1.0] * (size - k), rel=1e-5)
        loo = adv("rloo", r)[0].tolist()
        for i in range(size):
            others = r[0][:i] + r[0][i + 1:]
            assert loo[i] == pytest.approx(r[0][i] - sum(others) / len(others))


def test_maxrl_mean_at_most_1e6_is_zero():
    assert adv("maxrl", [[1e-6, 0.0, 2e-6]]).tolist() == [[0.0, 0.0, 0.0]]  # mean 1e-6
    assert adv("maxrl", [[-1.0, 0.5, 0.4]]).tolist() == [[0.0, 0.0, 0.0]]  # negative mean
    assert adv("maxrl", [[3e-6, 0.0, 3e-6]]).abs().sum() > 0  # mean 2e-6


def test_discover_meets_target_and_weights_sum_to_g():
    groups = torch.tensor(random_groups(5, size=6), dtype=D)
    for target in (0.01, 0.2, 1.0):
        params = {"beta": None, "target_kl": target, "beta_max": 50.0, "search_steps": 24}
        beta, kl = entropic_beta(groups, params)
        assert bool((kl <= target + 1e-12).all())
        a = EPISODE_ADVANTAGES.get("discover_entropic")(groups, params)
        assert (a + 1).sum(1).tolist() == pytest.approx([6.0] * len(groups))  # weights G * p sum to G
        # the search is tight: a slightly larger beta (unless capped at beta_max) breaks the target
        inner = [(b, row) for b, row in zip(beta.tolist(), groups) if 0 < b < 50.0]
        assert inner  # the bisection was exercised
        for b, row in inner:
            bigger = entropic_beta(row[None], {**params, "beta": b * 1.001})[1]
            assert float(bigger) > target - 1e-6


def test_registry_entries():
    assert EPISODE_ADVANTAGES.names() == ["grpo", "rloo", "grpo_std", "maxrl", "reinforce_pp", "discover_entropic"]
    assert EPISODE_ADVANTAGES.entry("discover_entropic").defaults == {"beta": None, "target_kl": 0.2,
                                                                      "beta_max": 50.0, "search_steps": 24}
    assert all(not EPISODE_ADVANTAGES.entry(n).defaults for n in ("grpo", "rloo", "grpo_std", "maxrl", "reinforce_pp"))


# -- batch normalisation and the cap ---------------------------------------------------------------

def ref_batch_norm(rows, eps=1e-8):
    vals = [a for row in rows for a in row if a != 0.0]
    if not vals:
        return rows
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
    if sd < eps:
        return [[a - mu if a != 0.0 else 0.0 for a in row] for row in rows]
    return [[(a - mu) / (sd + eps) if a != 0.0 else 0.0 for a in row] for row in rows]


def test_batch_norm_by_hand():
    a = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out, m = batch_advantage_norm(a, mask)
    # non-zeros (1, 3): mean 2, population std 1
    assert out[0].tolist() == pytest.approx([-1 / (1 + 1e-8), 1 / (1 + 1e-8), 0.0], rel=1e-15)
    assert out[1].tolist() == [0.0, 0.0, 0.0]
    assert m == {"batch_adv_mean": 2.0, "batch_adv_std": 1.0, "batch_adv_count": 2.0}
    # all equal: only centred (they become 0)
    out, m = batch_advantage_norm(torch.tensor([[0.5, 0.5, 0.0]], dtype=D), torch.ones(1, 3, dtype=torch.bool))
    assert out.tolist() == [[0.0, 0.0, 0.0]] and m["batch_adv_std"] == 0.0
    # nothing non-zero: unchanged
    out, m = batch_advantage_norm(torch.zeros(1, 2, dtype=D), torch.ones(1, 2, dtype=torch.bool))
    assert out.tolist() == [[0.0, 0.0]] and m["batch_adv_count"] == 0.0


def test_batch_norm_reference_and_properties():
    torch.manual_seed(3)
    a = torch.randn(6, 9, dtype=D)
    mask = torch.rand(6, 9) > 0.3
    a = torch.where(mask, a, 0.0)
    a[2] = 0.0  # a no-signal completion
    out, m = batch_advantage_norm(a, mask)
    assert out.tolist() == [pytest.approx(row, abs=1e-12) for row in ref_batch_norm(a.tolist())]
    live = a != 0
    assert bool((out[~live] == 0).all())
    assert float(out[live].mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(out[live].std(correction=0)) == pytest.approx(1.0, abs=1e-7)
    assert m["batch_adv_count"] == float(live.sum())


def test_clip_by_hand():
    a = torch.tensor([[3.0, -0.5, 0.0], [-4.0, 1.0, 2.0]], dtype=D)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out, m = clip_token_advantages(a, mask, 2.0)
    # 4 non-zero sampled tokens, 3.0 and -4.0 capped; the unsampled 2.0 is left alone
    assert out.tolist() == [[2.0, -0.5, 0.0], [-2.0, 1.0, 2.0]]
    assert m == {"adv_cap_fraction": 0.5, "adv_cap_magnitude": 3.5}
    out, m = clip_token_advantages(a, mask, 0.0)
    assert torch.equal(out, a) and m == {"adv_cap_fraction": 0.0, "adv_cap_magnitude": 0.0}


def test_clip_reference():
    torch.manual_seed(4)
    a = torch.randn(5, 7, dtype=D) * 2
    mask = torch.ones(5, 7, dtype=torch.bool)
    out, m = clip_token_advantages(a, mask, 1.5)
    flat = [x for row in a.tolist() for x in row]
    capped = [x for x in flat if abs(x) > 1.5]
    assert [x for row in out.tolist() for x in row] == [max(-1.5, min(1.5, x)) for x in flat]
    assert m["adv_cap_fraction"] == pytest.approx(len(capped) / len(flat))
    assert m["adv_cap_magnitude"] == pytest.approx(sum(abs(x) for x in capped) / len(capped))


# -- moved helpers and group bookkeeping -------------------------------------------------------------

def test_zero_signal_groups_and_overlong_penalty():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert zero_signal_groups(r, 4).tolist() == [False, True]
    assert zero_signal_groups(r, 2).tolist() == [False, False, True, True]
    lengths = torch.tensor([10, 14, 16, 20])
    assert overlong_penalty(lengths, 20, 8, 1.0).tolist() == [0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 8, 0.5).tolist() == [0.0, -0.125, -0.25, -0.5]


def test_group_bookkeeping():
    group = torch.tensor([0, 0, 1, 1, 1, 2])
    assert group_slices(group) == [slice(0, 2), slice(2, 5), slice(5, 6)]
    a = torch.tensor([0.0, 0.0, 1.0, 0.0, -1.0, 0.0])
    assert signal_slices(a, group_slices(group)) == [slice(2, 5)]
    assert signal_slices(torch.zeros(6), group_slices(group)) == group_slices(group)
    assert average_metrics([{"x": 1.0, "y": 4.0}, {"x": 3.0}]) == {"x": 2.0, "y": 4.0}
