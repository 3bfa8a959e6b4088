"""Delight gating: hand values, a plain-Python re-implementation of retrain's per-rollout
definitions (norms, adaptive eta with ordering gap and EMA, hard top-k), and properties."""
import math
import random

import pytest
import torch

from retrograd.algorithms.delight import gates, hard_keep, scale_surprisals, surprisals
from retrograd.algorithms.transforms import TOKEN_TRANSFORMS, TokenContext, fill_tables

D = torch.float64


def make_ctx(rows, groups, lam=0.0):
    """rows: list of (A, logprobs list)."""
    n, t = len(rows), max(len(r[1]) for r in rows)
    lp, mask = torch.zeros(n, t, dtype=D), torch.zeros(n, t, dtype=torch.bool)
    for i, (_, l) in enumerate(rows):
        lp[i, :len(l)] = torch.tensor(l, dtype=D)
        mask[i, :len(l)] = True
    return TokenContext(torch.tensor([r[0] for r in rows], dtype=D), lp, mask, torch.tensor(groups), None, None, lam, 0)


def run(name, ctx, delight=None, state=None):
    params = fill_tables(TOKEN_TRANSFORMS.entry(name).tables, {"delight": delight or {}})
    params.update(transform_params={}, uncertainty_kind="surprisal", state={} if state is None else state)
    return TOKEN_TRANSFORMS.get(name)(ctx, params)


# -- plain-Python references ----------------------------------------------------------------------

def sig(x):
    return 1.0 if x > 20 else 0.0 if x < -20 else 1 / (1 + math.exp(-x))


def median(xs):
    o = sorted(xs)
    return o[len(o) // 2] if len(o) % 2 else (o[len(o) // 2 - 1] + o[len(o) // 2]) / 2


def ref_norm(s, mode):
    if mode == "none" or len(s) < 2:
        return list(s)
    mu = sum(s) / len(s)
    sd = math.sqrt(sum((x - mu) ** 2 for x in s) / len(s))
    scaled = [x / sd for x in s] if sd >= 1e-8 else list(s)
    if mode == "scale":
        return scaled
    med = median(s)
    robust = 1.4826 * median([abs(x - med) for x in s])
    return [x / robust for x in s] if robust >= 1e-8 else scaled


def ref_quantile(xs, q):
    o = sorted(xs)
    pos = q * (len(o) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return o[lo] * (1 - (pos - lo)) + o[hi] * (pos - lo)


def ref_gaps(rollouts, eta):
    out = []
    for a, s in rollouts:
        if len(s) < 2:
            continue
        g = [sig(a * x / eta) for x in sorted(s)]
        half = len(s) // 2
        gap = sum(g[-half:]) / half - sum(g[:half]) / half
        out.append(gap if a > 0 else -gap)
    return out


def ref_eta(rollouts, cfg, prev):
    """retrain's eta for one group; rollouts = [(A, normalised s)] with A != 0."""
    base = max(cfg["eta"], 1e-8)
    if cfg["eta_mode"] == "fixed":
        return base
    d = cfg["eta_ema_decay"] or 0.0
    if not rollouts:
        return max(d * prev + (1 - d) * base, 1e-8) if prev is not None and d > 0 else base
    lo = max(1e-8, cfg["eta_min"])
    hi = max(lo, cfg["eta_max"])
    mags = [abs(a * x) for a, s in rollouts for x in s]
    eta = min(max(ref_quantile(mags, min(max(cfg["eta_target_neutral_frac"], 0), 1)) / math.log(1.5), lo), hi)
    target = cfg["eta_target_ordering_gap"] or 0.0
    if target > 0:
        gaps = ref_gaps(rollouts, eta)
        if gaps and sum(gaps) / len(gaps) < target:
            eta = min(max(eta * max(sum(gaps) / len(gaps) / target, 0.25), lo), hi)
    if prev is not None and d > 0:
        eta = min(max(d * prev + (1 - d) * eta, lo), hi)
    return eta


def ref_delight(rows, groups, cfg, lam=None, default_norm="none", prev=None):
    mode = cfg["norm_mode"] or default_norm
    out, etas = [None] * len(rows), []
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        normed = {i: ref_norm([min(-x, 50.0) for x in rows[i][1]], mode) for i in idx}
        eta = ref_eta([(rows[i][0], normed[i]) for i in idx if rows[i][0] != 0], cfg, prev)
        if any(rows[i][0] != 0 for i in idx):
            etas.append(eta)
        for i in idx:
            a = rows[i][0]
            if a == 0:
                out[i] = [0.0] * len(normed[i])
            elif lam is None:
                out[i] = [a * sig(a * x / eta) for x in normed[i]]
            else:
                lc = max(0.0, min(1.0, lam))
                out[i] = [a * ((1 - lc) + lc * sig(a * x / eta)) for x in normed[i]]
    return out, etas


def ref_hard(a, lps, k_frac, lam):
    s = [min(-x, 50.0) for x in lps]
    if a == 0:
        return [0.0] * len(s)
    lc = max(0.0, min(1.0, lam))
    k = max(1, int(len(s) * k_frac))
    order = sorted(range(len(s)), key=lambda i: s[i], reverse=a > 0)
    keep = set(order[:k])
    return [a * ((1 - lc) + lc * (1.0 if i in keep else 0.0)) for i in range(len(s))]


def random_rows(seed, n_groups=3, size=4):
    rng = random.Random(seed)
    rows, groups = [], []
    for g in range(n_groups):
        for _ in range(size):
            n = rng.randint(1, 10)
            lps = [-rng.expovariate(0.6) for _ in range(n)]
            if rng.random() < 0.3 and n > 2:
                lps[1] = lps[0]  # a tie
            rows.append((rng.choice([-1.0, -0.5, 0.0, 0.75, 1.5]) if g < n_groups - 1 else 0.0, lps))
            groups.append(g)
    return rows, groups


def flat_rows(out, rows):
    return [out[i, :len(r[1])].tolist() for i, r in enumerate(rows)]


CFG = fill_tables(("delight",), {})["delight"]


# -- hand values --------------------------------------------------------------------------------

def test_delight_by_hand():
    # s = (0, 1, 2), eta = 1: a = A sigmoid(A s)
    ctx = make_ctx([(1.0, [0.0, -1.0, -2.0]), (-2.0, [-1.0, -0.5, 0.0])], [0, 0])
    out, m = run("delight", ctx)
    assert out[0].tolist() == pytest.approx([0.5, 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))])
    assert out[1].tolist() == pytest.approx([-2 / (1 + math.exp(2)), -2 / (1 + math.exp(1)), -1.0])
    assert m["dg_eta"] == 1.0 and m["dg_eta_adaptive"] == 0.0
    # delight_sepa at lam = 0.5 with no scaling: A (0.5 + 0.5 gate)
    out, m = run("delight_sepa", ctx, {"lambda": 0.5, "norm_mode": "none"})
    assert out[0].tolist() == pytest.approx([0.75, 0.5 + 0.5 / (1 + math.exp(-1)), 0.5 + 0.5 / (1 + math.exp(-2))])
    assert m["dg_lambda"] == 0.5
    # lam = 0 is the plain policy gradient
    out, _ = run("delight_sepa", ctx)
    assert out[0].tolist() == [1.0, 1.0, 1.0] and out[1].tolist() == [-2.0, -2.0, -2.0]


def test_gate_metrics_by_hand():
    ctx = make_ctx([(1.0, [0.0, -1.0]), (0.0, [-1.0])], [0, 0])
    out, m = run("delight", ctx)
    g1 = 1 / (1 + math.exp(-1))
    assert m["dg_gate_mean"] == pytest.approx((0.5 + g1) / 2) and m["dg_gate_min"] == 0.5
    assert m["dg_neutral_frac"] == 0.5 and m["dg_gate_mean_pos"] == pytest.approx((0.5 + g1) / 2)
    assert "dg_gate_mean_neg" not in m
    assert m["dg_gate_ordering_gap"] == pytest.approx(g1 - 0.5)
    # net bias: sum of token advantages (0.5 + g1) minus sum of A n (1 * 2)
    assert m["dg_net_advantage_bias"] == pytest.approx(0.5 + g1 - 2)
    assert out[1].tolist() == [0.0, 0.0]


def test_norms_by_hand():
    s = torch.tensor([[1.0, 2.0, 3.0, 10.0], [4.0, 0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[True] * 4, [True, False, False, False]])
    sd = math.sqrt(((1 - 4) ** 2 + (2 - 4) ** 2 + (3 - 4) ** 2 + (10 - 4) ** 2) / 4)
    assert scale_surprisals(s, mask, "scale")[0].tolist() == pytest.approx([1 / sd, 2 / sd, 3 / sd, 10 / sd])
    # median 2.5, |s - 2.5| = (1.5, 0.5, 0.5, 7.5), MAD = 1.0
    assert scale_surprisals(s, mask, "mad_scale")[0].tolist() == pytest.approx([x / 1.4826 for x in (1, 2, 3, 10)])
    assert scale_surprisals(s, mask, "scale")[1].tolist() == [4.0, 0.0, 0.0, 0.0]  # one token: unscaled
    with pytest.raises(ValueError, match="norm_mode"):
        scale_surprisals(s, mask, "zscore")


def test_adaptive_eta_by_hand():
    # one rollout A = 1, s = (0, 1, 2, 3): |A s| median 1.5 -> eta = 1.5 / ln 1.5
    ctx = make_ctx([(1.0, [0.0, -1.0, -2.0, -3.0])], [0])
    state = {}
    _, m = run("delight", ctx, {"eta_mode": "adaptive"}, state)
    assert m["dg_eta"] == pytest.approx(1.5 / math.log(1.5)) and state["delight_eta_ema"] == m["dg_eta"]
    # EMA with decay 0.5 against the previous step's eta 1.0; the clip to eta_max 5 still applies
    state = {"delight_eta_ema": 1.0}
    _, m = run("delight", ctx, {"eta_mode": "adaptive", "eta_ema_decay": 0.5}, state)
    assert m["dg_eta"] == pytest.approx(0.5 + 0.5 * 1.5 / math.log(1.5)) and m["dg_eta_prev"] == 1.0
    assert state["delight_eta_ema"] == pytest.approx(m["dg_eta"])
    _, m = run("delight", ctx, {"eta_mode": "adaptive", "eta_max": 2.0})
    assert m["dg_eta"] == 2.0


# -- properties --------------------------------------------------------------------------------

def test_gate_in_open_interval():
    torch.manual_seed(0)
    adv = torch.randn(6, dtype=D)
    s = torch.rand(6, 9, dtype=D) * 5
    g = gates(adv, s, torch.full((6,), 2.0, dtype=D))
    assert bool(((g > 0) & (g < 1)).all())
    # beyond |x| > 20 the gate is exactly 0 / 1
    assert gates(torch.tensor([1.0, -1.0], dtype=D), torch.tensor([[30.0], [30.0]], dtype=D),
                 torch.ones(2, dtype=D)).tolist() == [[1.0], [0.0]]


def test_hard_delight_keeps_exactly_k():
    torch.manual_seed(1)
    s = torch.rand(5, 11, dtype=D)
    mask = torch.ones(5, 11, dtype=torch.bool)
    mask[3, 6:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0], dtype=D)
    keep = hard_keep(adv, s, mask, 0.3)
    assert keep.sum(1).tolist() == [3, 3, 3, 1, 0]  # floor(11 * 0.3) = 3; floor(6 * 0.3) = 1; A = 0: none
    top = s[0].topk(3).indices.sort().values
    assert keep[0].nonzero().squeeze(1).tolist() == top.tolist()
    bottom = s[1].topk(3, largest=False).indices.sort().values
    assert keep[1].nonzero().squeeze(1).tolist() == bottom.tolist()
    ctx = make_ctx([(1.0, [-0.1, -3.0, -0.2, -5.0, -1.0])], [0])
    out, m = run("hard_delight", ctx, {"lambda": 1.0, "k_frac": 0.4})
    assert out[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]  # the two most surprising tokens
    assert m["hard_dg_active_frac"] == 0.4 and m["hard_dg_net_bias"] == -3.0
    out, _ = run("hard_delight", ctx, {"lambda": 0.5, "k_frac": 0.4})
    assert out[0].tolist() == [0.5, 1.0, 0.5, 1.0, 0.5]


def test_hard_delight_ties_take_the_earlier_token():
    ctx = make_ctx([(1.0, [-1.0, -1.0, -1.0, -1.0, -1.0]), (-1.0, [-1.0] * 5)], [0, 0])
    out, _ = run("hard_delight", ctx, {"lambda": 1.0, "k_frac": 0.4})
    assert out.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0], [-1.0, -1.0, 0.0, 0.0, 0.0]]


def test_bad_settings_are_refused():
    ctx = make_ctx([(1.0, [-1.0])], [0])
    with pytest.raises(ValueError, match="eta_mode"):
        run("delight", ctx, {"eta_mode": "auto"})
    with pytest.raises(ValueError, match="eta_ema_decay"):
        run("delight", ctx, {"eta_mode": "adaptive", "eta_ema_decay": 1.0})


# -- against the reference -----------------------------------------------------------------------

CASES = [
    ("delight", {}),
    ("delight", {"norm_mode": "scale", "eta": 0.5}),
    ("delight", {"norm_mode": "mad_scale", "eta_mode": "adaptive"}),
    ("delight", {"eta_mode": "adaptive", "eta_target_ordering_gap": 0.9, "eta_ema_decay": 0.7}),
    ("delight_sepa", {}),
    ("delight_sepa", {"lambda": 0.6, "eta_mode": "adaptive", "eta_target_neutral_frac": 0.8}),
    ("delight_sepa", {"norm_mode": "none", "eta_mode": "adaptive", "eta_target_ordering_gap": 0.5}),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,given", CASES)
def test_delight_against_reference(name, given, seed):
    rows, groups = random_rows(seed)
    cfg = {**CFG, **given}
    lam_ctx = 0.7
    ctx = make_ctx(rows, groups, lam=lam_ctx)
    prev = 1.3 if cfg["eta_ema_decay"] else None
    state = {} if prev is None else {"delight_eta_ema": prev}
    out, m = run(name, ctx, given, state)
    lam = None if name == "delight" else (cfg["lambda"] if cfg["lambda"] is not None else lam_ctx)
    want, etas = ref_delight(rows, groups, cfg, lam, "none" if name == "delight" else "scale", prev)
    for got, ref in zip(flat_rows(out, rows), want):
        assert got == pytest.approx(ref, abs=1e-12)
    assert bool((out[~ctx.mask] == 0).all())
    assert m["dg_eta"] == pytest.approx(sum(etas) / len(etas))  # the last group has no signal: left out
    if cfg["eta_mode"] == "adaptive":
        assert state["delight_eta_ema"] == pytest.approx(m["dg_eta"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam,k_frac", [(1.0, 0.2), (0.3, 0.5), (0.0, 0.2)])
def test_hard_delight_against_reference(seed, lam, k_frac):
    rows, groups = random_rows(seed)
    ctx = make_ctx(rows, groups, lam=lam)
    out, m = run("hard_delight", ctx, {"k_frac": k_frac})
    for got, (a, lps) in zip(flat_rows(out, rows), rows):
        assert got == ref_hard(a, lps, k_frac, lam)
    assert m["hard_dg_lambda"] == lam and m["hard_dg_k_frac"] == k_frac


def test_surprisals_are_capped_and_masked():
    lp = torch.tensor([[-math.inf, -2.0, -9.0]], dtype=D)
    assert surprisals(lp, torch.tensor([[True, True, False]])).tolist() == [[50.0, 2.0, 0.0]]
