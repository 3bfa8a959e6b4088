"""Tinker's built-in losses (algorithms/tinker_losses.py): hand-computed values, gradients by
finite differences, config validation; and the protobuf wire round trip through the SDK's own
encoder / decoder."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from retrograd.algorithms.tinker_losses import LossInputError, datum_loss, resolve_config

LP = [-1.0, -2.0, -0.5]
Q = [-1.2, -1.5, -0.5]
ADV = [1.0, -2.0, 0.5]


def _loss(name, lp=LP, config=None, **extra):
    inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.tensor(ADV, dtype=torch.float64)}
    inputs.update({k: torch.tensor(v, dtype=torch.float64) for k, v in extra.items()})
    lp = lp if isinstance(lp, torch.Tensor) else torch.tensor(lp, dtype=torch.float64)
    return datum_loss(name, lp, inputs, resolve_config(name, config))


def test_hand_values():
    r = [math.exp(a - b) for a, b in zip(LP, Q)]  # e^0.2, e^-0.5, 1
    assert float(_loss("cross_entropy", weights=[1.0, 0.0, 2.0])) == pytest.approx(-(-1.0 + 2 * -0.5))
    assert float(_loss("importance_sampling")) == pytest.approx(-(r[0] * 1 + r[1] * -2 + r[2] * 0.5))
    # ppo, default bounds 0.8 / 1.2: r0 = 1.2214 clipped to 1.2 (A > 0: min picks 1.2); r1 = 0.6065 with
    # A < 0: min(-1.213, -1.6) = -1.6 (the clipped side); r2 = 1
    assert float(_loss("ppo")) == pytest.approx(-(1.2 * 1 + 0.8 * -2 + 1 * 0.5))
    # cispo (0 / 4): weights are the (unclipped here) ratios, times lp * A
    assert float(_loss("cispo")) == pytest.approx(-(r[0] * -1.0 * 1 + r[1] * -2.0 * -2 + 1 * -0.5 * 0.5))
    beta = 0.1
    assert float(_loss("dro", config={"beta": beta})) == pytest.approx(
        -sum(a * adv - 0.5 * beta * (a - q) ** 2 for a, q, adv in zip(LP, Q, ADV)))
    # gspo: one sequence ratio exp(mean(lp - q)) = exp(-0.1) for every token, then PPO's clip
    s = math.exp(np.mean(np.subtract(LP, Q)))
    assert float(_loss("gspo")) == pytest.approx(-sum(min(s * a, min(max(s, 0.8), 1.2) * a) for a in ADV))
    s2 = math.exp((LP[0] - Q[0] + LP[2] - Q[2]) / 2)  # only the masked tokens set the ratio
    assert float(_loss("gspo", sequence_ratio_mask=[1.0, 0.0, 1.0])) == pytest.approx(
        -sum(min(s2 * a, min(max(s2, 0.8), 1.2) * a) for a in ADV))


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "dro", "gspo"])
def test_gradients_match_finite_differences(name):
    lp = torch.tensor([-1.0, -2.0, -0.7], dtype=torch.float64, requires_grad=True)
    extra = {"weights": [0.5, 1.0, 2.0]} if name == "cross_entropy" else {}
    f = lambda x: _loss(name, x, **extra)  # noqa: E731
    (g,) = torch.autograd.grad(f(lp), lp)
    eps = 1e-6
    for i in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[i] = eps
        fd = (float(f(lp.detach() + e)) - float(f(lp.detach() - e))) / (2 * eps)
        if name == "gspo":  # the sequence ratio is a stop-gradient: d/dlp_t = -sg(s) * A_t inside the clip
            continue
        assert float(g[i]) == pytest.approx(fd, rel=1e-5, abs=1e-8), (name, i)
    if name == "gspo":
        s = math.exp(float((lp.detach() - torch.tensor(Q, dtype=torch.float64)).mean()))
        inside = 0.8 <= s <= 1.2
        assert torch.allclose(g, torch.tensor([-(s * a if inside else 0.0) for a in ADV], dtype=torch.float64))


def test_cispo_gradient_is_the_clipped_weight_times_advantage():
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(_loss("cispo", lp, config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}), lp)
    r = np.clip(np.exp(np.subtract(LP, Q)), 0.7, 1.1)
    np.testing.assert_allclose(g.numpy(), -r * np.array(ADV))


def test_config_validation():
    with pytest.raises(LossInputError, match="not read by ppo"):
        resolve_config("ppo", {"beta": 1.0})
    with pytest.raises(LossInputError, match="not supported"):
        resolve_config("no_such_loss", None)
    assert resolve_config("ppo", {"clip_low_threshold": 0.5}) == {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2}


def test_wire_round_trip_through_the_sdk_codecs():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
    from tinker.types.forward_backward_input import ForwardBackwardInput
    from tinker.types.forward_backward_request import ForwardBackwardRequest

    from retrograd.service import wire
    targets = torch.tensor([[1, 2], [3, 4], [5, 6]])
    d1 = types.Datum(model_input=types.ModelInput.from_ints([7, 8, 9]),
                     loss_fn_inputs={"target_tokens": [8, 9, 10], "advantages": [0.5, -1.0, 2.0]})
    d2 = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                     "weights": types.TensorData.from_torch(torch.tensor([[1.0, 0], [0, 1], [0.5, 0.5]]))})
    req = ForwardBackwardRequest(forward_backward_input=ForwardBackwardInput(
        data=[d1, d2], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "name": "x"}), model_id="m", seq_id=4)
    got = wire.decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("m", 4, "ppo", False)
    assert got.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "name": "x"}
    assert got.data[0].tokens == [7, 8, 9] and got.data[0].inputs["target_tokens"].tolist() == [8, 9, 10]
    np.testing.assert_allclose(got.data[0].inputs["advantages"], [0.5, -1.0, 2.0])
    assert got.data[1].inputs["target_tokens"].tolist() == targets.tolist()
    np.testing.assert_allclose(got.data[1].inputs["weights"], [[1.0, 0], [0, 1], [0.5, 0.5]])

    out = deserialize_forward_backward_output(wire.encode_forward_backward_output(
        [np.array([-1.0, -2.0]), np.array([-3.0, -4.0, -5.0])], {"loss:sum": 1.5}))
    assert out.metrics == {"loss:sum": 1.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0, -4.0, -5.0]]
    soft = deserialize_forward_backward_output(wire.encode_forward_backward_output([np.zeros((3, 2))], {}))
    assert soft.loss_fn_outputs[0]["logprobs"].shape == [3, 2]

    resp = deserialize_sample_response(wire.encode_sample_response(
        [{"tokens": [4, 5], "logprobs": [-0.5, -0.25], "stopped": True},
         {"tokens": [6], "logprobs": [-1.0], "stopped": False}], np.array([np.nan, -2.0], dtype=np.float32)))
    assert [s.tokens for s in resp.sequences] == [[4, 5], [6]]
    assert [s.stop_reason for s in resp.sequences] == ["stop", "length"]
    assert resp.prompt_logprobs == [None, -2.0]
