"""USL back pressure: the fit recovers λ, σ, κ and the peak concurrency of a known curve (the
linearised least squares, by Cramer's rule, against the closed form), the controller's warm-up sweep,
its decisions on either side of the peak, and its state round trip."""
import math

import pytest

from retrograd.algorithms.backpressure import BackPressure, fit_usl


def usl(p, lam=100.0, sigma=0.1, kappa=0.01):
    return lam * p / (1 + sigma * (p - 1) + kappa * p * (p - 1))


def test_fit_recovers_a_known_curve():
    fit = fit_usl([(p, usl(p)) for p in (1, 2, 4, 8, 16, 32)])
    assert fit.lam == pytest.approx(100.0, rel=1e-9) and fit.sigma == pytest.approx(0.1, rel=1e-9)
    assert fit.kappa == pytest.approx(0.01, rel=1e-9)
    assert fit.p_star == pytest.approx(math.sqrt(0.9 / 0.01), rel=1e-9)  # sqrt((1 - σ) / κ) ~ 9.49


def test_fit_needs_three_distinct_concurrencies_and_linear_scaling_has_no_peak():
    assert fit_usl([(1, 10.0), (2, 20.0)]) is None
    assert fit_usl([(2, 20.0), (2, 21.0), (2, 19.0)]) is None
    fit = fit_usl([(p, 7.0 * p) for p in (1, 2, 4, 8)])  # perfectly linear: no contention, no coherency cost
    assert fit.sigma == pytest.approx(0, abs=1e-9) and fit.kappa == pytest.approx(0, abs=1e-9)
    assert math.isinf(fit.p_star)


def test_controller_sweeps_then_settles_below_the_peak():
    bp = BackPressure(group_size=2, warmup_steps=4, ema_decay=0.0, min_batch_size=1, max_batch_size=16)
    assert [bp.warmup_size(s) for s in range(6)] == [1, 2, 4, 8, 16, 1]
    for _ in range(8):
        b = bp.next_batch_size()
        p = b * 2
        m = bp.observe(b, tokens=usl(p), seconds=1.0)  # throughput = the known curve
    p_star = math.sqrt(0.9 / 0.01)
    assert bp.batch_size == int(0.85 * p_star // 2)  # floor(throttle_margin x p* / group size) = 4
    assert m["backpressure/p_star"] == pytest.approx(p_star, rel=1e-6)
    bp2 = BackPressure(group_size=2, warmup_steps=0)
    bp2.load_state_dict(bp.state_dict())
    assert bp2.next_batch_size() == bp.next_batch_size() and bp2.points == bp.points


def test_throttle_past_the_peak_and_increase_far_below_it():
    bp = BackPressure(group_size=1, warmup_steps=0, ema_decay=0.0, max_batch_size=64)
    for p in (1, 2, 4, 8, 16):
        bp.observe(p, usl(p), 1.0)
    assert bp.observe(32, usl(32), 1.0)["backpressure/action"] == 3  # throttle: 32 > 0.85 x 9.49
    assert bp.observe(1, usl(1), 1.0)["backpressure/action"] == 2  # increase: 1 < 0.5 x 8.07
