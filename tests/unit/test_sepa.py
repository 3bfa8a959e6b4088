"""SEPA's lambda schedule: hand values, endpoints, the sticky gate, the auto schedule against a
plain re-implementation, and the JSON state round trip."""
import json
import math
import random

import pytest
import torch

from retrograd.algorithms.sepa import SepaController, execution_surprisals


def test_linear_by_hand_and_endpoints():
    c = SepaController(steps=100, delay_steps=50, correct_rate_gate=0.0)
    assert [c.lambda_for(s) for s in (0, 49, 50, 51, 100, 150, 151, 10_000)] == [0.0, 0.0, 0.0, 0.01, 0.5, 1.0, 1.0, 1.0]
    # retrain's defaults over 500 steps: lambda only reaches 449 / 500 at the last step
    d = SepaController()
    d.observe([], 1.0)
    assert d.lambda_for(499) == pytest.approx(0.898)
    assert SepaController(steps=0, correct_rate_gate=0.0).lambda_for(1000) == 0.0


def test_gate_keeps_lambda_at_zero_until_reached_then_sticks():
    c = SepaController(steps=10, delay_steps=0, correct_rate_gate=0.3)
    assert not c.gate_open and c.lambda_for(20) == 0.0
    c.observe([], 0.29)
    assert c.lambda_for(20) == 0.0
    c.observe([], float("nan"))
    c.observe([], None)
    assert c.lambda_for(20) == 0.0
    c.observe([], 0.3)
    assert c.gate_open and c.lambda_for(5) == 0.5
    c.observe([], 0.0)  # sticky
    assert c.lambda_for(20) == 1.0


def test_auto_by_hand():
    c = SepaController(steps=0, schedule="auto", delay_steps=0, correct_rate_gate=0.0, ema_decay=0.5, warmup=2)
    c.observe([1.0, 3.0], None)  # population variance 1
    assert c.var_ema == 1.0 and c.var_0 is None and c.lambda_for(0) == 0.0
    c.observe([0.0, 4.0, 2.0, 2.0], None)  # variance 2 -> EMA 1.5; warm-up done: var_0 = 1.5
    assert c.var_ema == 1.5 and c.var_0 == 1.5 and c.lambda_for(0) == 0.0  # ratio 1 -> 1 - min(5, 1)
    c.observe([2.0, 2.0], None)  # variance 0 -> EMA 0.75, ratio 0.5 -> still 0
    c.observe([5.0, 5.0, math.inf, -1.0, float("nan")], None)  # invalid values dropped: variance 0
    assert c.var_ema == 0.375 and c.lambda_for(0) == 0.0  # ratio 0.25 / 0.2 > 1
    c.observe([1.0, 1.0], None)  # EMA 0.1875, ratio 0.125 -> lambda 1 - 0.625
    assert c.lambda_for(0) == pytest.approx(0.375)
    assert c.warmup_seen == 2
    c.observe([math.inf], None)  # nothing valid: no observation
    assert c.var_ema == 0.1875


def test_auto_takes_the_larger_of_auto_and_linear():
    c = SepaController(steps=10, schedule="auto", delay_steps=0, correct_rate_gate=0.0, warmup=1)
    c.observe([0.0, 2.0], None)
    assert c.lambda_for(3) == 0.3  # auto 0 (no variance drop yet), linear 0.3


def test_linear_ignores_observations():
    c = SepaController(steps=10, delay_steps=0, correct_rate_gate=0.0, warmup=1)
    c.observe([0.0, 2.0], None)
    assert c.var_ema is None and c.lambda_for(5) == 0.5


class RefController:
    """retrain's SEPAController definitions, one observation per step."""

    def __init__(self, steps, schedule, delay, gate, decay=0.99, thr=0.2, warmup=50, eps=1e-8):
        self.steps, self.schedule, self.delay, self.gate = steps, schedule, delay, gate
        self.decay, self.thr, self.warmup, self.eps = decay, thr, warmup, eps
        self.ema = self.v0 = None
        self.seen = 0
        self.open = gate <= 0

    def lam(self, step):
        lin = 0.0 if self.steps <= 0 or step - self.delay <= 0 else min((step - self.delay) / self.steps, 1.0)
        if not self.open:
            return 0.0
        if self.schedule != "auto":
            return lin
        auto = 0.0
        if self.ema is not None and self.v0 is not None:
            auto = 1.0 - min(max(0.0, self.ema / max(self.v0, self.eps)) / max(self.thr, self.eps), 1.0)
        return max(auto, lin)

    def observe(self, xs, rate):
        if not self.open and rate >= self.gate:
            self.open = True
        xs = [x for x in xs if math.isfinite(x) and x >= 0]
        if self.schedule != "auto" or not xs:
            return
        mu = sum(xs) / len(xs)
        v = sum((x - mu) ** 2 for x in xs) / len(xs)
        self.ema = v if self.ema is None else self.decay * self.ema + (1 - self.decay) * v
        if self.v0 is None:
            self.seen += 1
            if self.seen >= self.warmup:
                self.v0 = max(self.ema, self.eps)


@pytest.mark.parametrize("schedule", ["linear", "auto"])
def test_against_reference(schedule):
    rng = random.Random(7)
    kw = dict(steps=40, delay_steps=5, correct_rate_gate=0.2)
    c = SepaController(schedule=schedule, ema_decay=0.9, warmup=5, **kw)
    ref = RefController(40, schedule, 5, 0.2, decay=0.9, warmup=5)
    for step in range(80):
        assert c.lambda_for(step) == pytest.approx(ref.lam(step), abs=1e-12)
        spread = 3.0 * math.exp(-step / 10)  # execution uncertainty settling down
        xs = [rng.uniform(0, spread) for _ in range(rng.randint(0, 30))]
        rate = min(1.0, step / 50)
        c.observe(torch.tensor(xs, dtype=torch.float64), rate)
        ref.observe(xs, rate)
    assert c.lambda_for(80) > 0.5  # the test reached the interesting part


def test_state_round_trip_through_json():
    rng = random.Random(1)
    c = SepaController(steps=30, schedule="auto", delay_steps=3, correct_rate_gate=0.1, warmup=4)
    for step in range(10):
        c.observe([rng.random() * (10 - step) for _ in range(20)], 0.05 * step)
    restored = SepaController(steps=30, schedule="auto", delay_steps=3, correct_rate_gate=0.1, warmup=4)
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.state_dict() == c.state_dict()
    for step in range(10, 30):
        xs = [rng.random() for _ in range(10)]
        c.observe(xs, 0.5)
        restored.observe(xs, 0.5)
        assert restored.lambda_for(step) == c.lambda_for(step)
    fresh = SepaController(steps=30, schedule="auto", delay_steps=3, correct_rate_gate=0.1, warmup=4)
    assert fresh.state_dict()["var_ema"] is None and fresh.state_dict()["gate_open"] is False
    with pytest.raises(ValueError, match="gate_open"):
        fresh.load_state_dict({"gate_open": "yes"})
    with pytest.raises(ValueError, match="finite"):
        fresh.load_state_dict({"var_ema": float("inf")})


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="schedule"):
        SepaController(schedule="cosine")
    with pytest.raises(ValueError, match="correct_rate_gate"):
        SepaController(correct_rate_gate=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        SepaController(steps=-1)


def test_execution_surprisals():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -math.inf, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    plan = torch.tensor([[False, True, False], [False, False, False]])
    assert execution_surprisals(lp, mask, plan).tolist() == [1.0, 3.0, 4.0, math.inf]
    assert execution_surprisals(lp, mask).tolist() == [1.0, 2.0, 3.0, 4.0, math.inf]
