"""Token transforms (GTPO, HICRA, SEPA, entropy mask) and uncertainty signals: hand values, a
plain-Python re-implementation of retrain's per-sequence definitions on ragged random batches,
and the properties of each transform."""
import math
import random

import pytest
import torch

from retrograd.algorithms.registry import PluginError
from retrograd.algorithms.transforms import (TABLE_DEFAULTS, TABLE_HELP, TOKEN_TRANSFORMS, UNCERTAINTY, TokenContext,
                                             entropy_mask, fill_tables, gtpo_weights, sepa_transform, split_stats,
                                             token_uncertainty)

D = torch.float64


def make_ctx(rows, groups, lam=0.0, entropy=None):
    """rows: list of (A, logprobs list, planning list); groups: group index per row."""
    n, t = len(rows), max(len(r[1]) for r in rows)
    lp, mask, plan = torch.zeros(n, t, dtype=D), torch.zeros(n, t, dtype=torch.bool), torch.zeros(n, t, dtype=torch.bool)
    for i, (_, l, p) in enumerate(rows):
        lp[i, :len(l)] = torch.tensor(l, dtype=D)
        mask[i, :len(l)] = True
        plan[i, :len(p)] = torch.tensor(p, dtype=torch.bool)
    ent = None
    if entropy is not None:
        ent = torch.zeros(n, t, dtype=D)
        for i, e in enumerate(entropy):
            ent[i, :len(e)] = torch.tensor(e, dtype=D)
    return TokenContext(torch.tensor([r[0] for r in rows], dtype=D), lp, mask, torch.tensor(groups), plan, ent, lam, 0)


def run(name, ctx, tables=None, kind="surprisal"):
    entry = TOKEN_TRANSFORMS.entry(name)
    params = fill_tables(entry.tables, tables or {})
    params.update(transform_params={}, uncertainty_kind=kind, state={})
    return entry.fn(ctx, params)


def rows_of(out, rows):
    return [out[i, :len(r[1])].tolist() for i, r in enumerate(rows)]


# -- plain-Python references (retrain's per-sequence definitions) ---------------------------------

def ref_surprisal(lps):
    return [min(-x, 50.0) for x in lps]


def ref_gtpo(a, u, beta):
    if not u or beta == 0.0:
        return [a] * len(u)
    u = [min(x, 50.0) for x in u]
    m = sum(u) / len(u)
    if m < 1e-7:
        return [a] * len(u)
    return [a * max(0.0, 1.0 + beta * (x / (m + 1e-8) - 1.0)) for x in u]


def ref_sepa(u, plan, lam, variant):
    lam = max(0.0, min(1.0, lam))
    if lam == 0.0:
        return list(u)
    u = [min(x, 50.0) for x in u]
    ex = [x for x, p in zip(u, plan) if not p]
    if not ex:
        return u
    mu = sum(ex) / len(ex)
    out = []
    for x, p in zip(u, plan):
        if p:
            out.append(x)
        elif variant == "pool":
            out.append(lam * mu + (1 - lam) * x)
        elif variant == "amp":
            out.append((1 + lam) * x - lam * mu)
        else:
            out.append(max(0.0, (1 + lam) * x - lam * mu))
    return out


def ref_hicra(a, plan, alpha):
    return [x + alpha * abs(x) if p else x for x, p in zip(a, plan)]


def ref_mask(advs, us, rho):
    """One group: keep tokens whose u is at least the top-rho threshold."""
    if rho <= 0:
        return advs
    flat = sorted((x for u in us for x in u), reverse=True)
    thr = -math.inf if rho >= 1 else flat[max(1, int(len(flat) * rho)) - 1]
    return [[a if x >= thr else 0.0 for a, x in zip(ar, u)] for ar, u in zip(advs, us)]


def ref_transform(name, rows, groups, lam=0.0, beta=0.1, alpha=0.2, rho=0.0):
    sepa = {"gtpo_sepa": "pool", "gtpo_sepa_amp": "amp", "gtpo_sepa_amp_c": "amp_c"}.get(name)
    out = []
    for a, lps, plan in rows:
        u = ref_surprisal(lps)
        if name == "none":
            out.append([a] * len(u))
            continue
        if sepa:
            u = ref_sepa(u, plan, lam, sepa)
        t = ref_gtpo(a, u, beta)
        if name == "gtpo_hicra":
            t = ref_hicra(t, plan, alpha)
        out.append(t)
    if name == "entropy_mask":
        for g in sorted(set(groups)):
            idx = [i for i, x in enumerate(groups) if x == g]
            masked = ref_mask([out[i] for i in idx], [ref_surprisal(rows[i][1]) for i in idx], rho)
            for i, m in zip(idx, masked):
                out[i] = m
    return out


def random_rows(seed, n_groups=3, size=4, max_len=9):
    rng = random.Random(seed)
    rows, groups = [], []
    for g in range(n_groups):
        advs = [rng.choice([-1.0, -0.25, 0.0, 0.5, 2.0]) for _ in range(size)]
        for a in advs:
            n = rng.randint(1, max_len)
            lps = [-rng.expovariate(0.7) for _ in range(n)]
            if rng.random() < 0.2:
                lps[0] = -math.inf  # surprisal capped at 50
            if rng.random() < 0.15:
                lps = [0.0] * n  # a certain completion: mean u below 1e-7
            plan = [rng.random() < 0.3 for _ in range(n)]
            if rng.random() < 0.15:
                plan = [True] * n  # no execution token
            rows.append((a, lps, plan))
            groups.append(g)
    return rows, groups


# -- uncertainty --------------------------------------------------------------------------------

def test_uncertainty_by_hand():
    ctx = make_ctx([(1.0, [-0.5, -math.inf, math.log(0.25)], [0, 0, 0])], [0], entropy=[[0.1, 70.0, 2.0]])
    assert token_uncertainty(ctx, "surprisal")[0].tolist() == pytest.approx([0.5, 50.0, math.log(4)])
    # p (1 - p): p = e^-0.5; p = e^-50 (the -inf floored at -50); p = 1/4 gives 3/16
    pv = token_uncertainty(ctx, "predictive_variance")[0].tolist()
    assert pv == pytest.approx([math.exp(-0.5) * (1 - math.exp(-0.5)), math.exp(-50) * (1 - math.exp(-50)), 3 / 16])
    assert token_uncertainty(ctx, "shannon_entropy")[0].tolist() == [0.1, 50.0, 2.0]
    for alias, target in (("nll", "surprisal"), ("neg_logprob", "surprisal"), ("token_surprisal", "surprisal"),
                          ("negative_logprob", "surprisal"), ("entropy", "shannon_entropy"),
                          ("shannon", "shannon_entropy"), ("token_entropy", "shannon_entropy"),
                          ("pred_var", "predictive_variance"), ("bernoulli_variance", "predictive_variance")):
        assert UNCERTAINTY.canonical(alias) == target
        assert torch.equal(token_uncertainty(ctx, alias), token_uncertainty(ctx, target))
    assert "varentropy" not in UNCERTAINTY
    with pytest.raises(PluginError, match="surprisal, predictive_variance, shannon_entropy"):
        UNCERTAINTY.entry("varentropy")


def test_shannon_entropy_needs_the_sampler():
    ctx = make_ctx([(1.0, [-0.5], [0])], [0])
    with pytest.raises(ValueError, match="sampler must compute entropies"):
        token_uncertainty(ctx, "shannon_entropy")


def test_uncertainty_is_zero_outside_the_mask():
    ctx = make_ctx([(1.0, [-0.5, -1.0], [0, 0]), (1.0, [-2.0], [0])], [0, 0])
    ctx.logprobs[1, 1] = -7.0  # garbage beyond the mask
    assert token_uncertainty(ctx, "surprisal")[1].tolist() == [2.0, 0.0]


# -- GTPO ---------------------------------------------------------------------------------------

def test_gtpo_by_hand():
    # A = 2, u = (1, 2, 3): mean 2, w = 1 + 0.1 (u / 2 - 1) = (0.95, 1, 1.05) (up to the 1e-8)
    rows = [(2.0, [-1.0, -2.0, -3.0], [0, 0, 0]), (-1.0, [0.0, 0.0], [0, 0])]
    out, m = run("gtpo", make_ctx(rows, [0, 0]))
    assert out[0].tolist() == pytest.approx([1.9, 2.0, 2.1], abs=1e-7)
    assert out[1].tolist() == [-1.0, -1.0, 0.0]  # mean u = 0 < 1e-7: plain A; beyond the mask: 0
    # beta = 1: w = u / 2, and u = 0.1 of mean 2.05 gives 1 + 5 (0.1/2.05 - 1) < 0 -> clamped at 0
    out, _ = run("gtpo", make_ctx([(1.0, [-0.1, -4.0], [0, 0])], [0]), {"gtpo": {"beta": 5.0}})
    assert out[0, 0] == 0.0
    out, _ = run("gtpo", make_ctx(rows, [0, 0]), {"gtpo": {"beta": 0.0}})
    assert out[0].tolist() == [2.0, 2.0, 2.0]
    # stats: exec = all five tokens' surprisal (1, 2, 3, 0, 0): mean 1.2, var 1.36
    assert m["exec_surprisal_mean"] == pytest.approx(1.2) and m["exec_surprisal_var"] == pytest.approx(1.36)
    assert m["plan_surprisal_mean"] == 0.0 and m["post_exec_surprisal_mean"] == pytest.approx(1.2)


def test_gtpo_weights_average_to_one():
    torch.manual_seed(0)
    u = torch.rand(5, 8, dtype=D) * 3 + 0.5
    mask = torch.rand(5, 8) > 0.3
    mask[:, 0] = True
    w = gtpo_weights(u, mask, 0.3)
    assert bool((w[mask] > 0).all())  # none clamped at 0
    assert (w.sum(1) / mask.sum(1)).tolist() == pytest.approx([1.0] * 5, abs=1e-7)
    assert bool((w[~mask] == 0).all())


# -- SEPA and HICRA ---------------------------------------------------------------------------

def test_sepa_by_hand():
    u = torch.tensor([[1.0, 3.0, 8.0, 60.0]], dtype=D)
    execution = torch.tensor([[True, True, False, True]])
    # exec tokens (1, 3, 50 after the cap): mean 18
    assert sepa_transform(u, execution, 1.0, "pool").tolist() == [[18.0, 18.0, 8.0, 18.0]]
    assert sepa_transform(u, execution, 0.5, "pool").tolist() == [[9.5, 10.5, 8.0, 34.0]]
    assert sepa_transform(u, execution, 0.5, "amp").tolist() == [[-7.5, -4.5, 8.0, 66.0]]
    assert sepa_transform(u, execution, 0.5, "amp_c").tolist() == [[0.0, 0.0, 8.0, 66.0]]
    assert sepa_transform(u, execution, 0.0, "pool") is u  # lam = 0: untouched
    assert sepa_transform(u, execution, 7.0, "pool").tolist() == [[18.0, 18.0, 8.0, 18.0]]  # lam clipped to 1


def test_sepa_pooling_at_one_equalises_execution_tokens():
    rows, groups = random_rows(11)
    ctx = make_ctx(rows, groups, lam=1.0)
    u = token_uncertainty(ctx, "surprisal")
    execution = ctx.mask & ~ctx.planning
    pooled = sepa_transform(u, execution, 1.0, "pool")
    for i in range(len(rows)):
        ex = execution[i]
        if ex.any():
            mu = float(u[i][ex].mean())
            assert pooled[i][ex].tolist() == pytest.approx([mu] * int(ex.sum()))
        assert torch.equal(pooled[i][ctx.planning[i] & ctx.mask[i]], u[i][ctx.planning[i] & ctx.mask[i]])


def test_hicra_keeps_signs_and_leaves_execution_alone():
    rows, groups = random_rows(12)
    ctx = make_ctx(rows, groups)
    plain, _ = run("gtpo", ctx)
    boosted, _ = run("gtpo_hicra", ctx, {"hicra": {"alpha": 0.5}})
    plan = ctx.planning & ctx.mask
    assert torch.equal(boosted[~plan], plain[~plan])
    assert bool((torch.sign(boosted) == torch.sign(plain)).all())
    assert torch.allclose(boosted[plan], plain[plan] * torch.where(plain[plan] > 0, 1.5, 0.5))


def test_planning_transforms_need_the_mask():
    ctx = make_ctx([(1.0, [-1.0], [0])], [0])
    ctx.planning = None
    for name in ("gtpo_hicra", "gtpo_sepa", "gtpo_sepa_amp", "gtpo_sepa_amp_c"):
        with pytest.raises(ValueError, match="planning-token mask"):
            run(name, ctx)
    assert run("gtpo", ctx)[0].tolist() == [[pytest.approx(1.0)]]  # gtpo does not


# -- entropy mask ------------------------------------------------------------------------------

def test_entropy_mask_by_hand():
    u = torch.tensor([[4.0, 1.0, 3.0], [2.0, 5.0, 0.0]], dtype=D)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    a = torch.ones(2, 3, dtype=D)
    group, adv = torch.tensor([0, 0]), torch.ones(2, dtype=D)
    # 5 tokens, rho 0.4: floor(2.0) = 2 -> threshold = 2nd largest = 4
    out, m = entropy_mask(a, u, mask, group, adv, 0.4)
    assert out.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert m == {"entropy_mask_threshold": 4.0, "entropy_mask_fraction": 0.6}
    out, m = entropy_mask(a, u, mask, group, adv, 1.0)
    assert torch.equal(out, torch.where(mask, a, 0.0)) and m["entropy_mask_fraction"] == 0.0
    out, m = entropy_mask(a, u, mask, group, adv, 0.0)  # off, as retrain's default
    assert torch.equal(out, a) and m == {}
    out, _ = entropy_mask(a, u, mask, group, adv, 0.01)  # tiny rho: still the top token kept
    assert out.tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]


def test_entropy_mask_keeps_the_top_fraction():
    rows, groups = random_rows(13, size=6, max_len=12)
    ctx = make_ctx(rows, groups)
    for rho in (0.1, 0.3, 0.7):
        out, _ = run("entropy_mask", ctx, {"entropy_mask": {"rho": rho}, "gtpo": {"beta": 0.0}})
        u = token_uncertainty(ctx, "surprisal")
        for g in set(groups):
            rows_g = ctx.group == g
            n = int(ctx.mask[rows_g].sum())
            values = u[rows_g][ctx.mask[rows_g]]
            thr = values.sort(descending=True).values[max(1, int(n * rho)) - 1]
            assert int((values >= thr).sum()) >= max(1, int(n * rho))
            signal = ctx.mask[rows_g] & (ctx.advantages[rows_g, None] != 0)  # A = 0 cannot tell
            kept = out[rows_g] != 0
            assert bool((kept[signal] == (u[rows_g][signal] >= thr)).all())
            assert int(signal.sum()) > 0


# -- the whole transforms against the reference ---------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", ["none", "gtpo", "gtpo_hicra", "gtpo_sepa", "gtpo_sepa_amp", "gtpo_sepa_amp_c",
                                  "entropy_mask"])
def test_against_reference(name, seed):
    rows, groups = random_rows(seed)
    lam = [0.0, 0.4, 1.0][seed % 3]
    ctx = make_ctx(rows, groups, lam=lam)
    tables = {"gtpo": {"beta": 0.3}, "hicra": {"alpha": 0.25}, "entropy_mask": {"rho": 0.35}}
    out, _ = run(name, ctx, tables)
    want = ref_transform(name, rows, groups, lam=lam, beta=0.3, alpha=0.25, rho=0.35)
    for got, ref in zip(rows_of(out, rows), want):
        assert got == pytest.approx(ref, abs=1e-12)
    assert bool((out[~ctx.mask] == 0).all())


def test_stats_against_reference():
    rows, groups = random_rows(7)
    ctx = make_ctx(rows, groups, lam=0.6)
    _, m = run("gtpo_sepa", ctx)

    def mean_var(xs):
        mu = sum(xs) / len(xs)
        return mu, sum((x - mu) ** 2 for x in xs) / len(xs)

    pre = {"exec": [], "plan": []}
    post = {"exec": [], "plan": []}
    for _, lps, plan in rows:
        u = ref_surprisal(lps)
        for x, y, p in zip(u, ref_sepa(u, plan, 0.6, "pool"), plan):
            pre["plan" if p else "exec"].append(x)
            post["plan" if p else "exec"].append(y)
    for kind in ("exec", "plan"):
        assert (m[f"{kind}_surprisal_mean"], m[f"{kind}_surprisal_var"]) == pytest.approx(mean_var(pre[kind]))
        assert (m[f"post_{kind}_surprisal_mean"], m[f"post_{kind}_surprisal_var"]) == pytest.approx(mean_var(post[kind]))
    assert split_stats(torch.zeros(1, 1, dtype=D), torch.zeros(1, 1, dtype=torch.bool),
                       torch.zeros(1, 1, dtype=torch.bool)) == {"exec_surprisal_mean": 0.0, "exec_surprisal_var": 0.0,
                                                                "plan_surprisal_mean": 0.0, "plan_surprisal_var": 0.0}


def test_other_uncertainty_kinds_feed_gtpo():
    rows = [(1.0, [-0.1, -1.0, -3.0], [0, 0, 0])]
    ctx = make_ctx(rows, [0], entropy=[[0.5, 1.5, 1.0]])
    out, _ = run("gtpo", ctx, {"gtpo": {"beta": 1.0}}, kind="shannon_entropy")
    assert out[0].tolist() == pytest.approx(ref_gtpo(1.0, [0.5, 1.5, 1.0], 1.0))
    out, _ = run("gtpo", ctx, {"gtpo": {"beta": 1.0}}, kind="predictive_variance")
    pv = [math.exp(x) * (1 - math.exp(x)) for x in (-0.1, -1.0, -3.0)]
    assert out[0].tolist() == pytest.approx(ref_gtpo(1.0, pv, 1.0))


# -- registry and tables -------------------------------------------------------------------------

def test_registry_and_tables():
    assert TOKEN_TRANSFORMS.names() == ["none", "gtpo", "gtpo_hicra", "gtpo_sepa", "gtpo_sepa_amp", "gtpo_sepa_amp_c",
                                        "entropy_mask", "delight", "delight_sepa", "hard_delight"]
    tables = {n: TOKEN_TRANSFORMS.entry(n).tables for n in TOKEN_TRANSFORMS.names()}
    assert tables["none"] == () and tables["gtpo"] == ("gtpo",)
    assert set(tables["gtpo_hicra"]) == {"gtpo", "hicra", "planning"}
    assert set(tables["gtpo_sepa"]) == {"gtpo", "planning", "sepa"}
    assert set(tables["hard_delight"]) == {"delight", "sepa"}
    assert all(set(t) <= set(TABLE_DEFAULTS) for t in tables.values())
    assert {k: set(v) for k, v in TABLE_HELP.items()} == {k: set(v) for k, v in TABLE_DEFAULTS.items()}
    assert TABLE_DEFAULTS["gtpo"]["beta"] == 0.1 and TABLE_DEFAULTS["hicra"]["alpha"] == 0.2
    assert TABLE_DEFAULTS["entropy_mask"]["rho"] == 0.0
    filled = fill_tables(("sepa", "planning"), {"sepa": {"steps": 10}})
    assert filled["sepa"] == {"steps": 10, "schedule": "linear", "delay_steps": 50, "correct_rate_gate": 0.1}
    filled["planning"]["strategic_grams"].append("x")  # a copy, not the defaults
    assert TABLE_DEFAULTS["planning"]["strategic_grams"] == []
    with pytest.raises(PluginError, match=r"\[grpo.gtpo\]: unknown keys \['alpha'\]"):
        fill_tables(("gtpo",), {"gtpo": {"alpha": 1}})
