"""Preference losses: hand-computed values, finite differences, a straightforward re-implementation
and TRL's own implementations of the same formulas (CPO's sigmoid/ipo/simpo, ORPO's odds ratio)."""
import math
from types import SimpleNamespace

import pytest
import torch

from retrograd.algorithms.preference import PreferenceParams, preference_loss

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
S_C, S_R, R_C, R_R, N_C, N_R = T(-10.0), T(-15.0), T(-12.0), T(-14.0), T(4.0), T(5.0)


def softplus(x):
    return math.log1p(math.exp(x))


def test_hand_values():
    loss, st = preference_loss(PreferenceParams("dpo", 0.1), S_C, S_R, N_C, N_R, R_C, R_R)
    assert float(loss) == pytest.approx(softplus(-0.3), abs=1e-12)  # m = 0.1 * (2 - (-1))
    assert float(st["chosen_reward"]) == pytest.approx(0.2) and float(st["rejected_reward"]) == pytest.approx(-0.1)
    assert float(st["margin"]) == pytest.approx(0.3) and float(st["accuracy"]) == 1.0
    loss, _ = preference_loss(PreferenceParams("dpo", 0.1, label_smoothing=0.2), S_C, S_R, N_C, N_R, R_C, R_R)
    assert float(loss) == pytest.approx(0.8 * softplus(-0.3) + 0.2 * softplus(0.3), abs=1e-12)
    loss, _ = preference_loss(PreferenceParams("ipo", 0.1), S_C, S_R, N_C, N_R, R_C, R_R)
    assert float(loss) == pytest.approx((2 / 4 + 1 / 5 - 5.0) ** 2, abs=1e-12)  # 18.49
    loss, _ = preference_loss(PreferenceParams("simpo", 2.0, gamma_beta_ratio=0.5), S_C, S_R, N_C, N_R)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-12)  # l_c - l_r = 0.5 = gamma/beta
    loss, st = preference_loss(PreferenceParams("orpo", 0.1), S_C, S_R, N_C, N_R)
    logodds = lambda l: l - math.log(1 - math.exp(l))  # noqa: E731
    z = logodds(-2.5) - logodds(-3.0)
    assert float(loss) == pytest.approx(2.5 + 0.1 * softplus(-z), abs=1e-12)
    assert float(st["nll"]) == pytest.approx(2.5) and float(st["log_odds"]) == pytest.approx(z)


def test_dpo_at_initialisation_is_ln2_with_accuracy_half():
    s = T(-7.0, -3.0, -20.0)
    loss, st = preference_loss(PreferenceParams("dpo", 0.1), s, s - 1, T(3, 3, 3), T(3, 3, 3), s, s - 1)
    assert torch.allclose(loss, torch.full_like(loss, math.log(2)))
    assert float(st["accuracy"].mean()) == 0.5


def test_orpo_clamps_a_mean_logprob_of_zero():
    loss, st = preference_loss(PreferenceParams("orpo", 0.1), T(0.0), T(-3.0), T(2.0), T(2.0))
    assert torch.isfinite(loss).all() and float(st["orpo_clamped"]) == 0.5


@pytest.mark.parametrize("params", [PreferenceParams("dpo", 0.3, 0.1), PreferenceParams("ipo", 0.5),
                                    PreferenceParams("simpo", 2.0, gamma_beta_ratio=0.3),
                                    PreferenceParams("orpo", 0.2)])
def test_gradients_match_finite_differences(params):
    torch.manual_seed(0)
    sc = (-torch.rand(4, dtype=torch.float64) * 20).requires_grad_()
    sr = (-torch.rand(4, dtype=torch.float64) * 20).requires_grad_()
    n_c, n_r = T(3, 7, 12, 5), T(4, 2, 9, 6)
    rc, rr = sc.detach() + torch.randn(4, dtype=torch.float64), sr.detach() + torch.randn(4, dtype=torch.float64)
    f = lambda a, b: preference_loss(params, a, b, n_c, n_r, rc, rr)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (sc, sr))


def reimplementation(loss, beta, eps, gamma_ratio, sc, sr, nc, nr, rc, rr):
    """One pair at a time, from the papers' formulas, with plain floats."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    if loss == "dpo":
        m = beta * ((sc - rc) - (sr - rr))
        return -(1 - eps) * math.log(sig(m)) - eps * math.log(sig(-m))
    if loss == "ipo":
        return ((sc - rc) / nc - (sr - rr) / nr - 1 / (2 * beta)) ** 2
    if loss == "simpo":
        return -math.log(sig(beta * (sc / nc) - beta * (sr / nr) - gamma_ratio * beta))
    lc, lr = min(sc / nc, -1e-6), min(sr / nr, -1e-6)
    odds = lambda p: p / (1 - p)  # noqa: E731
    return -lc - beta * math.log(sig(math.log(odds(math.exp(lc)) / odds(math.exp(lr)))))


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo"])
def test_matches_a_pair_by_pair_reimplementation(loss):
    torch.manual_seed(1)
    sc, sr = -torch.rand(6, dtype=torch.float64) * 30, -torch.rand(6, dtype=torch.float64) * 30
    nc, nr = T(10, 11, 12, 13, 14, 15), T(9, 20, 3, 13, 8, 30)
    rc, rr = sc + torch.randn(6, dtype=torch.float64), sr + torch.randn(6, dtype=torch.float64)
    p = PreferenceParams(loss, 0.25, 0.15 if loss == "dpo" else 0.0, 0.7)
    got, _ = preference_loss(p, sc, sr, nc, nr, rc, rr)
    want = [reimplementation(loss, 0.25, p.label_smoothing, 0.7, *map(float, row))
            for row in zip(sc, sr, nc, nr, rc, rr)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-10)


def _trl_self(**kw):
    return SimpleNamespace(**{"accelerator": SimpleNamespace(device="cpu"), "alpha": 0.0, "label_smoothing": 0.0, **kw})


def test_matches_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    torch.manual_seed(2)
    sc, sr = -torch.rand(5, dtype=torch.float64) * 30 - 1, -torch.rand(5, dtype=torch.float64) * 30 - 1
    nc, nr = T(10, 11, 12, 13, 14), T(9, 20, 3, 13, 8)
    rc, rr = sc + torch.randn(5, dtype=torch.float64), sr + torch.randn(5, dtype=torch.float64)

    # DPO (+ conservative): TRL's sigmoid loss on the policy/reference log-ratios
    ours, _ = preference_loss(PreferenceParams("dpo", 0.1, 0.2), sc, sr, nc, nr, rc, rr)
    trl, _, _ = CPOTrainer.cpo_loss(_trl_self(beta=0.1, loss_type="sigmoid", simpo_gamma=0.0, label_smoothing=0.2),
                                    sc - rc, sr - rr)
    assert torch.allclose(ours, trl.double(), atol=1e-6)
    # IPO: TRL's ipo loss on length-normalised log-ratios
    ours, _ = preference_loss(PreferenceParams("ipo", 0.1), sc, sr, nc, nr, rc, rr)
    trl, _, _ = CPOTrainer.cpo_loss(_trl_self(beta=0.1, loss_type="ipo", simpo_gamma=0.0), (sc - rc) / nc, (sr - rr) / nr)
    assert torch.allclose(ours, trl.double(), atol=1e-6)
    # SimPO: TRL's gamma is absolute (gamma = gamma_beta_ratio * beta)
    ours, st = preference_loss(PreferenceParams("simpo", 2.0, gamma_beta_ratio=0.5), sc, sr, nc, nr)
    trl, trl_rc, _ = CPOTrainer.cpo_loss(_trl_self(beta=2.0, loss_type="simpo", simpo_gamma=1.0), sc / nc, sr / nr)
    assert torch.allclose(ours, trl.double(), atol=1e-6)
    assert torch.allclose(st["chosen_reward"], trl_rc.double(), atol=1e-6)
    # ORPO: TRL returns beta * logsigmoid(log_odds) and subtracts it from the NLL
    ours, st = preference_loss(PreferenceParams("orpo", 0.1), sc, sr, nc, nr)
    trl, _, _, _, trl_log_odds = ORPOTrainer.odds_ratio_loss(_trl_self(beta=0.1), sc / nc, sr / nr)
    assert torch.allclose(ours, -(sc / nc) - trl.double(), atol=1e-6)
    assert float(st["log_odds"].mean()) == pytest.approx(float(trl_log_odds), abs=1e-5)

