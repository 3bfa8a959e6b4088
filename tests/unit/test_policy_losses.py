"""Policy losses (algorithms/policy_losses.py): hand values on 3-token tensors, gradients by finite
differences or against the analytic gradient of their definition, properties, equality with the
pre-registry `policy_loss` of algorithms/policy.py, and the registry itself.

Shared hand-value inputs: lp = [-1, -2, -0.5], old = [-1.2, -1.5, -0.5], A = [1, -2, 0.5], so the
log-ratio d = [0.2, -0.5, 0] and r = [e^0.2, e^-0.5, 1] = [1.2214028, 0.6065307, 1].
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

from retrograd.algorithms.policy_losses import COMMON_DEFAULTS, POLICY_LOSSES, aggregate, k3_kl, resolve
from retrograd.algorithms.registry import PluginError, merged_params

D = torch.float64
LP, OLD, ADV = [-1.0, -2.0, -0.5], [-1.2, -1.5, -0.5], [1.0, -2.0, 0.5]
BUILTINS = ["clip", "gspo", "cispo", "sapo", "gmpo", "kl_cov", "clip_cov", "importance_sampling", "dro"]


def t(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


def run(name, logp, old, adv, mask=None, **params):
    """Call a loss through `resolve`, as the loop does: common keys and the loss's own keys split."""
    common = {k: params.pop(k) for k in list(params) if k in COMMON_DEFAULTS}
    fn, p = resolve(name, params, common=common)
    mask = torch.ones_like(logp) if mask is None else mask.to(D)
    return fn(logp, old, adv, mask, p)


def hand(name, **params):
    return run(name, t([LP]), t([OLD]), t([ADV]), **params)[0][0].tolist()


# ---- the pre-registry implementation, verbatim from algorithms/policy.py (the independent reference)

def _k3_kl_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float, clip_high: float, level: str = "token", normalisation: str = "token",
                max_new_tokens: int | None = None, ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss and detached statistics. `denominator` overrides the token / constant
    normalisation's divisor (the whole update's token count when the batch is split into passes)."""
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]  # [N, 1]
    delta = (logp - old_logp) * mask
    if level == "token":
        ratio = torch.exp(delta)
    elif level == "sequence":
        n = mask.sum(1, keepdim=True).clamp(min=1)
        seq = torch.exp(delta.sum(1, keepdim=True) / n)  # [N, 1]
        ratio = seq.detach() * torch.exp(logp - logp.detach())  # value s, gradient of p_t / sg[p_t]
    else:
        raise ValueError(f"unknown importance_sampling_level {level!r}")
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_logp is not None and beta:
        kl = _k3_kl_reference(logp, ref_logp)
        per_token = per_token + beta * kl
    per_token = per_token * mask
    if normalisation == "token":
        loss = per_token.sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    elif normalisation == "constant":
        if max_new_tokens is None:
            raise ValueError("normalisation 'constant' needs max_new_tokens")
        loss = per_token.sum() / (denominator if denominator is not None else mask.shape[0] * max_new_tokens)
    elif normalisation == "sequence":
        per_seq = per_token.sum(1) / mask.sum(1).clamp(min=1)
        loss = per_seq.sum() / (denominator if denominator is not None else mask.shape[0])
    else:
        raise ValueError(f"unknown normalisation {normalisation!r}")
    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        is_clipped = ((ratio > 1 + clip_high) & (adv > 0)) | ((ratio < 1 - clip_low) & (adv < 0))
        r = ratio.detach()
        stats = {"clip_fraction": (is_clipped.to(mask.dtype) * mask).sum() / n_tok,
                 "ratio_mean": (r * mask).sum() / n_tok,
                 "ratio_max": r.masked_fill(mask == 0, float("-inf")).max(),
                 "ratio_min": r.masked_fill(mask == 0, float("inf")).min(),
                 "tokens": mask.sum()}
        if kl is not None:
            stats["kl"] = (kl.detach() * mask).sum() / n_tok
    return loss, stats


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalisation", ["token", "constant", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("denominator", [None, 17.0])
def test_same_numbers_as_the_pre_registry_policy_loss(level, normalisation, beta, denominator):
    torch.manual_seed(7)
    old = -torch.rand(4, 6, dtype=D) * 3
    shift = torch.tensor([[0.3], [-0.35], [0.1], [0.0]], dtype=D)  # sequence ratios beyond both bounds too
    logp = old + shift + 0.4 * torch.randn(4, 6, dtype=D)  # token ratios 0.3..3: both clip sides are hit
    ref = old + 0.2 * torch.randn(4, 6, dtype=D)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1, 0, 0, 0, 0, 0], [0] * 6], dtype=D)
    adv = torch.tensor([0.8, -1.3, 2.0, 0.5], dtype=D)
    kw = dict(max_new_tokens=6, denominator=denominator)

    x_old = logp.clone().requires_grad_()
    want, want_st = policy_loss(x_old, old, adv, mask, clip_low=0.2, clip_high=0.28, level=level,
                                normalisation=normalisation, ref_logp=ref, beta=beta, **kw)
    want.backward()
    for c in (0.0, 3.0):  # no ratio here reaches 3, so the dual clip never changes a number
        x = logp.clone().requires_grad_()
        per_token, st = run("clip" if level == "token" else "gspo", x, old, adv[:, None].expand(4, 6), mask,
                            clip_low=0.2, clip_high=0.28, clip_ratio_c=c)
        if beta:
            per_token = per_token + beta * k3_kl(x, ref)
        got = aggregate(per_token * mask, mask, normalisation, **kw)
        got.backward()
        assert torch.equal(got, want), (float(got), float(want))
        assert torch.allclose(x.grad, x_old.grad, rtol=0, atol=1e-15)
        for k in ("clip_fraction", "ratio_mean", "ratio_max", "ratio_min", "tokens"):
            assert torch.equal(st[k], want_st[k]), k
    assert 0 < float(want_st["clip_fraction"]) < 1  # the comparison did cover clipped tokens


# ---- aggregate and k3 --------------------------------------------------------------------------

def test_k3():
    assert float(k3_kl(t(-1.0), t(-1.0))) == 0.0
    assert float(k3_kl(t(-1.0), t(-2.0))) == pytest.approx(math.exp(-1) + 1 - 1)


def test_normalisations_by_hand():
    per_token = -torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=D)  # ratio 1: -A on every token
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(per_token, mask, "token")) == pytest.approx(-(3 + 2) / 4)
    assert float(aggregate(per_token, mask, "constant", max_new_tokens=5)) == pytest.approx(-(3 + 2) / 10)
    assert float(aggregate(per_token, mask, "sequence")) == pytest.approx(-(1 + 2) / 2)
    # the whole update's count replaces the pass's own divisor
    assert float(aggregate(per_token, mask, "token", denominator=10)) == pytest.approx(-5 / 10)
    assert float(aggregate(per_token, mask, "sequence", denominator=4)) == pytest.approx(-3 / 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate(per_token, mask, "constant")
    with pytest.raises(ValueError, match="token, constant, sequence"):
        aggregate(per_token, mask, "mean")


# ---- hand values -------------------------------------------------------------------------------

HAND = {
    # r0 = 1.2214 < 1.28, A > 0: -r0 A; r1 = 0.6065 < 0.8, A < 0: max(2 r1, 2 * 0.8) = 1.6 (clipped
    # side; the dual-clip cap -A c = 6 is above it); r2 = 1: -0.5
    "clip": [-1.2214028, 1.6, -0.5],
    # s = exp(mean d) = exp(-0.1) = 0.9048374 inside [0.8, 1.28]: -A s
    "gspo": [-0.9048374, 1.8096748, -0.4524187],
    # weights clip(r) = [1.2214028, 0.8, 1]; -w A lp = [1.2214028, -0.8 * -2 * -2, -0.5 * -0.5]
    "cispo": [1.2214028, -3.2, 0.25],
    # -A sigmoid(tau (r - 1)) 4 / tau, tau = [1, 1.05, 1]:
    # [-4 sigmoid(0.2214028), 2 * 4/1.05 * sigmoid(-0.4131428), -2 sigmoid(0)]
    "sapo": [-2.2205028, 3.0335907, -1.0],
    "importance_sampling": [-1.2214028, 1.2130613, -0.5],  # -r A
    # -(lp A - 0.025 d^2) = [-(-1 - 0.025 * 0.04), -(4 - 0.025 * 0.25), -(-0.25)]
    "dro": [1.001, -3.99375, 0.25],
    # Cov = (A - (-1/6))(lp - (-7/6)) = [0.1944, 1.5278, 0.4444]; k = max(1, floor(3 * 2e-4)) = 1: token 1
    # gets + 0.1 |d| = 0.05 on top of -A r = 1.2130613
    "kl_cov": [-1.2214028, 1.2630613, -0.5],
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_values(name):
    assert hand(name) == pytest.approx(HAND[name], abs=1e-6)


def test_hand_values_with_own_parameters():
    # kl_cov with k = floor(3 * 0.7) = 2: tokens 1 and 2 by covariance; token 2 has d = 0, so + 0
    assert hand("kl_cov", kl_cov_ratio=0.7, kl_cov_coef=1.0) == pytest.approx([-1.2214028, 1.7130613, -0.5])
    # dro with beta 0.1: -(lp A - 0.05 d^2)
    assert hand("dro", beta=0.1) == pytest.approx([1.002, -3.9875, 0.25])
    # sapo with tau 2 everywhere: -A sigmoid(2 (r - 1)) 2
    assert hand("sapo", tau_pos=2.0, tau_neg=2.0) == pytest.approx(
        [-2 * (1 / (1 + math.exp(-2 * 0.2214028))), 4 * (1 / (1 + math.exp(2 * 0.3934693))), -0.5], abs=1e-6)
    # clip and cispo with Tinker's ppo bounds [0.8, 1.2]: r0 = 1.2214 > 1.2 is clipped to 1.2
    assert hand("clip", clip_high=0.2) == pytest.approx([-1.2, 1.6, -0.5])
    assert hand("cispo", clip_high=0.2) == pytest.approx([1.2, -3.2, 0.25])
    # TRL's upper-only cispo cap epsilon_high = 1.1: clip_low 1 (no lower bound), clip_high 0.1
    assert hand("cispo", clip_low=1.0, clip_high=0.1) == pytest.approx([1.1, -0.6065307 * 4, 0.25], abs=1e-6)


def test_gspo_ratio_uses_only_the_masked_tokens_but_every_token_gets_it():
    mask = t([[1.0, 0.0, 1.0]])
    per_token, st = run("gspo", t([LP]), t([OLD]), t([ADV]), mask)
    s = math.exp((0.2 + 0.0) / 2)  # = 1.1051709: token 1's -0.5 is left out
    assert per_token[0].tolist() == pytest.approx([-1.1051709, 2.2103418, -0.5525855])
    assert float(st["ratio_mean"]) == pytest.approx(s) and float(st["tokens"]) == 2


def test_sequence_ratio_is_the_geometric_mean():
    old = torch.zeros(1, 4, dtype=D)
    logp = t([[0.1, 0.2, 0.3, 9.0]])
    mask = t([[1, 1, 1, 0]])
    _, st = run("gspo", logp, old, t([1.0]), mask, clip_low=1, clip_high=10)
    assert float(st["ratio_mean"]) == pytest.approx(math.exp(0.2))


def test_clip_cov_by_hand():
    # token 1 is clipped (r1 = 0.6065 < 0.8 with A < 0), so never eligible; Cov = [0.194, 1.528, 0.444]:
    # with lb 0.1 tokens 0 and 2 are eligible, k = max(1, floor(3 * 2e-4)) = 1 of them is zeroed
    per_token = hand("clip_cov", clip_cov_lb=0.1)
    assert per_token[1] == pytest.approx(1.6)
    assert per_token in (pytest.approx([0.0, 1.6, -0.5]), pytest.approx([-1.2214028, 1.6, 0.0]))
    # k = floor(3 * 0.7) = 2: both eligible tokens zeroed, the clipped one kept
    assert hand("clip_cov", clip_cov_lb=0.1, clip_cov_ratio=0.7) == pytest.approx([0.0, 1.6, 0.0])
    # default bounds (1, 5): no eligible token, the plain clipped loss without dual clip
    assert hand("clip_cov") == pytest.approx([-1.2214028, 1.6, -0.5])


def test_gmpo_by_hand_and_the_sequence_normalisation_is_the_plain_mean():
    # seq 0: A = 1, d = [0.2, -0.5, 0]: for A > 0 only the upper bound 0.28 binds: mean d' = -0.1,
    #        value -1 * e^-0.1 = -0.9048374
    # seq 1: A = -2, d = [0.5, -0.5]: for A < 0 d' = max(d, clamp(d, -0.2, 0.28)) = [0.5, -0.2]:
    #        mean 0.15, value 2 * e^0.15 = 2.3236685
    logp = t([[-1.0, -2.0, -0.5], [-1.0, -2.0, 0.0]])
    old = t([[-1.2, -1.5, -0.5], [-1.5, -1.5, 0.0]])
    adv = t([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    per_token, st = run("gmpo", logp, old, adv, mask)
    a, b = -math.exp(-0.1), 2 * math.exp(0.15)
    assert per_token[0].tolist() == pytest.approx([a, a, a]) and per_token[1].tolist() == pytest.approx([b, b, 0.0])
    assert float(aggregate(per_token * mask, mask, "sequence")) == pytest.approx((a + b) / 2)
    assert float(st["clip_fraction"]) == pytest.approx(1 / 5)  # only seq 1's second token is clipped
    assert float(st["seq_ratio_mean"]) == pytest.approx((math.exp(-0.1) + math.exp(0.15)) / 2)


# ---- clipping and dual clip --------------------------------------------------------------------

def _one(name, r, a, **params):
    logp = t([[math.log(r)]], grad=True)
    per_token, st = run(name, logp, torch.zeros(1, 1, dtype=D), t([a]), **params)
    per_token.sum().backward()
    return float(per_token.detach()), float(logp.grad), st


def test_clipping_by_hand():
    # A > 0, ratio 1.5 beyond 1 + 0.28: objective 1.28 * A, no gradient
    loss, grad, st = _one("clip", 1.5, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0 and float(st["clip_fraction"]) == 1.0
    # A < 0, ratio 0.5 below 1 - 0.2: objective 0.8 * A, no gradient
    loss, grad, _ = _one("clip", 0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0
    # A < 0, ratio 1.5: not clipped (pessimistic side), gradient -A * ratio
    loss, grad, st = _one("clip", 1.5, -1.0)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5) and float(st["clip_fraction"]) == 0


def test_dual_clip_flattens_large_ratios_with_negative_advantages():
    loss, grad, st = _one("clip", 5.0, -1.0)  # r = 5 > c = 3: -A c, no gradient
    assert loss == pytest.approx(3.0) and grad == 0.0 and float(st["dual_clip_fraction"]) == 1.0
    loss, grad, st = _one("clip", 5.0, -1.0, clip_ratio_c=0)  # off: -A r, gradient -A r
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0) and float(st["dual_clip_fraction"]) == 0
    loss, grad, _ = _one("clip", 5.0, -1.0, clip_ratio_c=10)  # r below c: untouched
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)
    loss, grad, _ = _one("clip", 5.0, 1.0)  # A > 0: the ordinary clip, never the dual one
    assert loss == pytest.approx(-1.28) and grad == 0.0
    for name in ("gspo", "clip_cov"):  # no dual clip, as verl
        loss, grad, _ = _one(name, 5.0, -1.0)
        assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _one("clip", 1.0, 1.0, clip_ratio_c=0.5)


# ---- gradients ---------------------------------------------------------------------------------

def _batch(seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, dtype=D, generator=g) * 2 - 0.2
    logp = old + scale * torch.randn(3, 5, dtype=D, generator=g)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    adv = torch.randn(3, 5, dtype=D, generator=g)  # token-level advantages
    return logp, old, adv, mask


SMOOTH = {"clip": {"clip_low": 0.5, "clip_high": 0.5}, "sapo": {}, "importance_sampling": {}, "dro": {},
          "gmpo": {"clip_low": 0.5, "clip_high": 0.5}, "kl_cov": {"kl_cov_ratio": 0.3},
          "clip_cov": {"clip_low": 0.5, "clip_high": 0.5, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0,
                       "clip_cov_ratio": 0.3}}


@pytest.mark.parametrize("name", sorted(SMOOTH))
def test_jacobian_matches_finite_differences(name):
    """The whole per-token Jacobian, at points inside the clip bands (where these losses are smooth)."""
    logp, old, adv, mask = _batch(1)
    per_token = run(name, logp, old, adv, mask, **SMOOTH[name])[0]
    if name in ("kl_cov", "clip_cov"):  # the points do exercise the covariance selection
        plain = run("importance_sampling" if name == "kl_cov" else "clip", logp, old, adv, mask,
                    **({} if name == "kl_cov" else {"clip_low": 0.5, "clip_high": 0.5}))[0]
        assert ((per_token != plain) & (mask > 0)).sum() == 3  # k = floor(10 valid * 0.3) = 3
    assert torch.autograd.gradcheck(lambda x: run(name, x, old, adv, mask, **SMOOTH[name])[0],
                                    (logp.clone().requires_grad_(),))


def _jacobian(name, logp, old, adv, mask, **params):
    return torch.autograd.functional.jacobian(lambda x: run(name, x, old, adv, mask, **params)[0], logp)


def test_gspo_gradient_is_its_definition():
    """GSPO-token: d l_t / d lp_t = -A_t sg[s] inside the band, 0 where clipped; nothing across tokens."""
    logp, old, adv, mask = _batch(2, scale=0.3)
    jac = _jacobian("gspo", logp, old, adv, mask, clip_low=0.1, clip_high=0.1)  # [3, 5, 3, 5]
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))[:, None]  # [3, 1]
    clipped = ((s > 1.1) & (adv > 0)) | ((s < 0.9) & (adv < 0))
    want = torch.where(clipped, torch.zeros_like(adv), -adv * s)
    assert torch.allclose(torch.einsum("ijij->ij", jac), want, atol=1e-12)
    assert torch.allclose(jac.abs().sum(), want.abs().sum(), atol=1e-12)  # diagonal only
    assert clipped.any() and (~clipped).any()


def test_cispo_weight_carries_no_gradient():
    """d l_t / d lp_t = -sg[clip(r_t)] A_t, also where r is outside the band (PPO's would be 0)."""
    logp, old, adv, mask = _batch(3, scale=0.5)
    jac = _jacobian("cispo", logp, old, adv, mask)
    w = torch.exp((logp - old) * mask).clamp(0.8, 1.28)
    assert torch.allclose(torch.einsum("ijij->ij", jac), -w * adv, atol=1e-12)
    assert torch.allclose(jac.abs().sum(), (w * adv).abs().sum(), atol=1e-12)
    assert ((w == 0.8) | (w == 1.28)).any()  # some weights were clipped


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("normalisation", ["token", "constant", "sequence"])
def test_at_ratio_one_the_loss_is_the_policy_gradient(name, normalisation):
    """On-policy (r = 1) every loss's gradient is -A dlp, normalised (gmpo too: its per-sequence value
    sits on each of the L_i tokens and has gradient -A_i / L_i on each)."""
    torch.manual_seed(0)
    logp = (-torch.rand(3, 4, dtype=D) * 3).requires_grad_()
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = t([0.7, -0.2, 1.5])[:, None].expand(3, 4)
    params = {"clip_cov_lb": 1e6} if name == "clip_cov" else {}  # no token is zeroed
    per_token, _ = run(name, logp, logp.detach(), adv, mask, **params)
    aggregate(per_token * mask, mask, normalisation, max_new_tokens=4).backward()
    pg = -adv * mask
    want = {"token": pg / mask.sum(), "constant": pg / (3 * 4), "sequence": pg / mask.sum(1, keepdim=True) / 3}
    assert torch.allclose(logp.grad, want[normalisation], atol=1e-12)


def test_sapo_gradient_at_ratio_one_is_minus_the_advantage():
    for a, tau in ((2.0, 1.0), (-3.0, 1.05), (-0.5, 4.0)):
        _, grad, _ = _one("sapo", 1.0, a, tau_pos=tau, tau_neg=tau)
        assert grad == pytest.approx(-a)
    _, grad, _ = _one("sapo", 2.0, 1.0)  # away from r = 1 the gate softens it: sigmoid'(1) * 4 * r < 1 * r
    assert 0 > grad > -2.0


def test_gradient_with_kl_matches_finite_differences():
    """The loop's whole pipeline (clip + beta k3, token normalisation); GSPO against its definition."""
    torch.manual_seed(1)
    old = -torch.rand(3, 5, dtype=D) * 2
    ref = old + 0.1 * torch.randn(3, 5, dtype=D)
    logp = (old + 0.05 * torch.randn(3, 5, dtype=D)).requires_grad_()  # ratios inside the clip band
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    adv = t([0.5, -1.0, 2.0])

    def f(x, name):
        per_token = run(name, x, old, adv, mask, clip_low=0.3, clip_high=0.3)[0] + 0.05 * k3_kl(x, ref)
        return aggregate(per_token * mask, mask, "token")
    assert torch.autograd.gradcheck(lambda x: f(x, "clip"), (logp,))
    f(logp, "gspo").backward()
    s = torch.exp(((logp.detach() - old) * mask).sum(1) / mask.sum(1))
    k3_grad = 0.05 * (1 - torch.exp(ref - logp.detach()))
    want = (-(s * adv)[:, None] + k3_grad) * mask / mask.sum()
    assert torch.allclose(logp.grad, want, atol=1e-12)


# ---- the covariance losses ---------------------------------------------------------------------

def _cov_batch():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 8, dtype=D, generator=g) * 4
    logp = old + 0.3 * torch.randn(4, 8, dtype=D, generator=g)
    mask = (torch.arange(8)[None, :] < torch.tensor([8, 6, 5, 3])[:, None]).to(D)  # 22 valid tokens
    adv = (3 * torch.randn(4, 1, dtype=D, generator=g)).expand(4, 8)
    return logp, old, adv, mask


def _cov(adv, logp, mask):
    v = mask > 0
    return (adv - adv[v].mean()) * (logp - logp[v].mean())


def test_kl_cov_touches_exactly_the_top_k_covariance_tokens():
    logp, old, adv, mask = _cov_batch()
    per_token, st = run("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.15, kl_cov_coef=0.5)  # k = floor(3.3) = 3
    plain = -adv * torch.exp((logp - old) * mask)
    touched = (per_token != plain) & (mask > 0)
    assert int(touched.sum()) == 3 and float(st["cov_fraction"]) == pytest.approx(3 / 22)
    assert torch.allclose(per_token[touched], (plain + 0.5 * (logp - old).abs())[touched])
    cov = _cov(adv, logp, mask).masked_fill(mask == 0, float("-inf"))
    assert cov[touched].min() > cov[~touched & (mask > 0)].max()
    # the smallest ratio still touches one token; padding is never picked
    per_token, _ = run("kl_cov", logp, old, adv, mask)
    assert int(((per_token != plain) & (mask > 0)).sum()) == 1
    assert torch.equal(per_token[mask == 0], plain[mask == 0])
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        run("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.0)


def test_clip_cov_zeroes_exactly_k_eligible_tokens_the_same_for_the_same_seed():
    logp, old, adv, mask = _cov_batch()
    clipped = run("clip", logp, old, adv, mask, clip_ratio_c=0)[0]
    cov = _cov(adv, logp, mask)
    r = torch.exp((logp - old) * mask)
    unclipped = ~(((r > 1.28) & (adv > 0)) | ((r < 0.8) & (adv < 0)))
    eligible = (mask > 0) & unclipped & (cov > 0.5) & (cov < 20.0)
    assert int(eligible.sum()) > 4  # the pick is a real choice
    params = dict(clip_cov_ratio=0.15, clip_cov_lb=0.5, clip_cov_ub=20.0)  # k = floor(22 * 0.15) = 3
    picks = []
    for seed in (0, 0, 1, 2, 3):
        per_token, st = run("clip_cov", logp, old, adv, mask, seed=seed, **params)
        zeroed = (per_token == 0) & (clipped != 0) & (mask > 0)
        assert int(zeroed.sum()) == 3 and not (zeroed & ~eligible).any()
        assert float(st["cov_fraction"]) == pytest.approx(3 / 22)
        assert torch.equal(per_token[~zeroed], clipped[~zeroed])
        picks.append(zeroed)
    assert torch.equal(picks[0], picks[1])
    assert any(not torch.equal(picks[0], p) for p in picks[2:])
    before = torch.get_rng_state()
    run("clip_cov", logp, old, adv, mask, **params)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG stream is untouched


def test_gmpo_equals_a_plain_python_reimplementation():
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(4, 6, dtype=D, generator=g) * 3
    logp = old + 0.4 * torch.randn(4, 6, dtype=D, generator=g)  # beyond both bounds somewhere
    adv = torch.randn(4, 6, dtype=D, generator=g)
    mask = t([[1] * 6, [1] * 4 + [0] * 2, [1, 1, 0, 0, 0, 0], [0] * 6])
    lo, hi = 0.25, 0.3
    got = run("gmpo", logp, old, adv, mask, clip_low=lo, clip_high=hi)[0]
    clipped_any = False
    for i in range(4):
        valid = [j for j in range(6) if mask[i, j] > 0]
        total, a_sum = 0.0, 0.0
        for j in valid:
            d, a = float(logp[i, j] - old[i, j]), float(adv[i, j])
            sgn = (a > 0) - (a < 0)
            dc = min(max(d, -lo), hi)
            d2 = sgn * min(sgn * d, sgn * dc)
            clipped_any |= d2 != d
            total, a_sum = total + d2, a_sum + a
        value = -(a_sum / len(valid)) * math.exp(total / len(valid)) if valid else 0.0
        for j in range(6):
            assert float(got[i, j]) == pytest.approx(value if j in valid else 0.0, rel=1e-12, abs=1e-15)
    assert clipped_any


# ---- robustness and shapes ---------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTINS)
def test_padding_never_overflows(name):
    """Outside the mask the log-ratio is 0: a padded old log-prob of -100 (exp(100) overflows float32)
    leaves every value and gradient finite."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -100.0], [-0.4, -100.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    per_token, st = run(name, logp, old, torch.tensor([1.0, -1.0]), mask)
    aggregate(per_token * mask, mask, "token").backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in st.values())
    assert float(st["tokens"]) == 3 and 0.8 < float(st["ratio_mean"]) < 1.2


@pytest.mark.parametrize("name", BUILTINS)
def test_sequence_advantages_broadcast_and_stats_are_detached(name):
    logp, old, _, mask = _batch(4)
    adv = t([0.3, -1.0, 2.0])
    a, st = run(name, logp.clone().requires_grad_(), old, adv, mask)
    b, _ = run(name, logp, old, adv[:, None].expand(3, 5), mask)
    assert torch.equal(a.detach(), b) and a.shape == (3, 5)
    assert {"clip_fraction", "ratio_mean", "ratio_max", "ratio_min", "tokens"} <= set(st)
    assert all(v.dim() == 0 and not v.requires_grad for v in st.values())


# ---- registry ----------------------------------------------------------------------------------

def test_registered_names_aliases_and_defaults():
    assert POLICY_LOSSES.names() == BUILTINS
    assert POLICY_LOSSES.get("ppo") is POLICY_LOSSES.get("vanilla") is POLICY_LOSSES.get("clip")
    assert POLICY_LOSSES.get("geo_mean") is POLICY_LOSSES.get("gmpo")
    defaults = {d["name"]: d["defaults"] for d in POLICY_LOSSES.describe()}
    assert defaults["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert defaults["kl_cov"] == {"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1}
    assert defaults["clip_cov"] == {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "seed": 0}
    assert defaults["dro"] == {"beta": 0.05} and defaults["clip"] == {}
    fn, params = resolve("ppo", common={"clip_high": 0.2})
    assert fn is POLICY_LOSSES.get("clip") and params == {"clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": 3.0}


def test_unknown_name_lists_the_builtins():
    with pytest.raises(PluginError, match="unknown policy_loss 'grpo'.*clip, gspo, cispo, sapo, gmpo"):
        resolve("grpo")


def test_unread_parameters_are_refused():
    with pytest.raises(PluginError, match=r"\['tau'\] not read by 'sapo'.*tau_pos, tau_neg"):
        merged_params(POLICY_LOSSES.entry("sapo"), {"tau": 1.0}, "[algorithm.policy_loss]")
    with pytest.raises(PluginError, match="not read by 'clip'"):
        resolve("clip", {"beta": 0.1})
    with pytest.raises(PluginError, match="not common policy-loss settings"):
        resolve("clip", common={"epsilon": 0.2})


def test_a_plugin_loss_by_dotted_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "my_rp_losses.py").write_text(
        "import torch\n"
        "def reinforce(logp, old_logp, advantages, mask, params):\n"
        "    '''Plain REINFORCE: -A lp.'''\n"
        "    return -advantages * logp * params.get('scale', 1.0), {'tokens': mask.sum()}\n")
    monkeypatch.delitem(sys.modules, "my_rp_losses", raising=False)
    fn, params = resolve("my_rp_losses:reinforce", {"scale": 2.0}, search_path=tmp_path)
    assert params["scale"] == 2.0 and params["clip_low"] == 0.2  # a plugin gets its table as written
    per_token, st = fn(t([LP]), t([OLD]), t([ADV]), torch.ones(1, 3, dtype=D), params)
    assert per_token[0].tolist() == pytest.approx([2.0, -8.0, 0.5]) and float(st["tokens"]) == 3
    assert POLICY_LOSSES.entry("my_rp_losses.reinforce", tmp_path).help == "Plain REINFORCE: -A lp."
    with pytest.raises(PluginError, match="cannot import"):
        resolve("my_rp_losses:missing", search_path=tmp_path)
