"""Tinker 0.38 features through the unmodified SDK: the Dimuon optimizer, prompt log-probs of the
last N tokens only, publishing checkpoints to the server's other owners, copy_weights, an honest
train_unembed, and a tokenizer id that a client on another machine can resolve."""
from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from service_util import KEYS, client, datum, rest, running_service
from tiny import make_model_dir

TOKENS = [5 + (7 * i) % 40 for i in range(20)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    model = make_model_dir(tmp / "model")
    from retrograd.service.api import Limits
    with running_service(tmp / "state", {"tiny": model}, limits=Limits(models_per_owner=64)) as (svc, url):
        yield svc, url, {"alice": KEYS[url], "bob": svc.registry.create_key("bob")}


def test_dimuon_steps_are_orthogonalised_momentum(served):
    from retrograd.algorithms.optim import Dimuon, orthogonalised
    svc, url, keys = served
    tc = client(url).create_lora_training_client(base_model="tiny", rank=4, seed=0,
                                                 optimizer=types.DimuonOptimizerConfig()).result()
    assert tc.get_info().optimizer_config.type == "dimuon"
    run = svc.runs[tc.model_id]
    before = {n: p.detach().clone() for n, p in run.params.items()}
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    grads = {n: p.grad.detach().clone() for n, p in run.params.items() if p.grad is not None}
    tc.optim_step(types.DimuonParams(learning_rate=0.01, beta1=0.9)).result()
    for n, g in grads.items():  # first step: m = 0.1 g, and the step is -lr * polar(m)
        want = before[n] - 0.01 * orthogonalised(0.1 * g)
        assert torch.allclose(run.params[n].detach(), want, atol=1e-6), n
    b = next(n for n in grads if "lora_B" in n)  # (lora_A's gradient is 0 while B starts at 0)
    step = run.params[b].detach() - before[b]
    assert math.isclose(float(step.norm()), 0.01 * math.sqrt(4), rel_tol=1e-4)  # Frobenius lr * sqrt(rank)
    losses = []
    for _ in range(6):
        losses.append(tc.forward_backward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.DimuonParams(learning_rate=0.02)).result()
    assert losses[-1] < losses[0]
    with pytest.raises(tinker.BadRequestError, match="dimuon"):  # the optimizer is fixed at creation
        c = client(url).create_lora_training_client(base_model="tiny", rank=4, seed=0,
                                                    optimizer=types.DimuonOptimizerConfig()).result()
        c.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("dimuon").result().path  # the kind and its momentum travel in the checkpoint
    again = client(url).create_training_client_from_state_with_optimizer(path).result()
    assert again.get_info().optimizer_config.type == "dimuon"
    assert isinstance(svc.runs[again.model_id].ensure_optimizer(), Dimuon)


def test_prompt_logprobs_of_the_last_n_tokens(served):
    _, url, _ = served
    s = client(url).create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(TOKENS)
    full = s.compute_logprobs(prompt).result()
    last = s.compute_logprobs(prompt, prompt_logprobs_last_n=5).result()
    assert all(x is None for x in last[:-5]) and len(last) == len(full)
    assert np.allclose(last[-5:], full[-5:], atol=1e-5)
    out = s.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                   topk_prompt_logprobs=3, prompt_logprobs_last_n=4).result()
    top = out.topk_prompt_logprobs
    assert top is not None and len(top) == len(TOKENS)
    scored = [row for row in top[-4:]]
    assert all(len(row) == 3 for row in scored)
    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n"):
        s.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                 prompt_logprobs_last_n=len(TOKENS)).result()


def test_publish_and_copy_weights(served):
    svc, url, keys = served
    tc = client(url, keys["alice"]).create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    tc.forward_backward([datum(TOKENS)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("shared").result().path
    loss = tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
    bob, alice_rest, bob_rest = client(url, keys["bob"]), rest(url, keys["alice"]), rest(url, keys["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    alice_rest.publish_checkpoint_from_tinker_path(path).result()
    [c] = [c for c in alice_rest.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == path]
    assert c.public
    loaded = bob.create_training_client_from_state(path).result()  # published: bob may load it ...
    assert loaded.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)
    with pytest.raises(tinker.NotFoundError):  # ... but not delete it
        bob_rest.delete_checkpoint_from_tinker_path(path).result()
    copy = bob_rest.copy_weights(path, destination_project_id="bobs").result()  # and copy it into his own
    copied = copy.tinker_path if hasattr(copy, "tinker_path") else copy
    assert copied != path and copied.endswith("/weights/shared")
    assert copied in {c.tinker_path for c in bob_rest.list_user_checkpoints().result().checkpoints}
    alice_rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    alice_rest.delete_checkpoint_from_tinker_path(path).result()  # the copy is bob's own, unaffected
    again = bob.create_training_client_from_state(copied).result()
    assert again.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)


def test_train_unembed_is_reported_honestly_and_tokenizer_ids(served):
    from retrograd.service.registry import Caller
    svc, url, keys = served
    tc = client(url).create_lora_training_client(base_model="tiny", rank=2, seed=0, train_unembed=True).result()
    path = tc.save_state("u").result().path
    assert rest(url).get_weights_info_by_tinker_path(path).result().train_unembed is False
    svc.bases["tiny"].hub_id = "org/tiny-tokenizer"
    try:
        local = svc.get_info(Caller("local", "rollout-enabled"), {"model_id": tc.model_id})
        remote = svc.get_info(Caller("local", "rollout-enabled", local=False), {"model_id": tc.model_id})
    finally:
        svc.bases["tiny"].hub_id = None
    assert local["model_data"]["tokenizer_id"] == svc.bases["tiny"].tokenizer_dir  # a folder on this machine
    assert remote["model_data"]["tokenizer_id"] == "org/tiny-tokenizer"  # a name another machine resolves


def _is_loss(logprobs, logprobs_q, advantages):
    ratio = torch.exp(logprobs - logprobs_q)
    return -(ratio * advantages).sum(), {"custom/ratio_mean:mean": ratio.mean(), "custom/tokens:sum": (ratio * 0 + 1).sum()}


def test_server_side_custom_loss_equals_the_built_in(served):
    svc, url, _ = served
    sc = client(url)
    handle = sc.create_custom_loss(_is_loss, {"logprobs": 1, "logprobs_q": 1, "advantages": 1}).result()
    assert handle.loss_id  # stored on the server (client config custom_loss_server_side)
    tc = sc.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    rng = np.random.default_rng(0)
    q = (-rng.uniform(1, 4, len(TOKENS) - 1)).tolist()
    adv = rng.normal(size=len(TOKENS) - 1).tolist()
    d = [datum(TOKENS, logprobs_q=np.asarray(q, dtype=np.float32), advantages=adv)]
    builtin = datum(TOKENS, logprobs=q, advantages=adv)
    custom = tc.forward_backward_custom(d, handle).result()
    run = svc.runs[tc.model_id]
    g_custom = {n: p.grad.clone() for n, p in run.params.items() if p.grad is not None}
    run.model.zero_grad()
    ref = tc.forward_backward([builtin], "importance_sampling").result()
    g_ref = {n: p.grad.clone() for n, p in run.params.items() if p.grad is not None}
    assert "surrogate_loss:sum" not in custom.metrics  # run by the server, not by the SDK's client-side path
    assert custom.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert custom.metrics["custom/tokens:sum"] == len(TOKENS) - 1 and 0 < custom.metrics["custom/ratio_mean:mean"]
    assert g_ref.keys() == g_custom.keys() and g_ref
    for n in g_ref:  # the same gradient as the built-in loss
        assert torch.allclose(g_ref[n], g_custom[n], rtol=1e-4, atol=1e-8), n


@pytest.mark.parametrize("node,message", [
    ({"op": "call_function", "name": "x", "target": "os.system", "args": ["ls"]}, "not an allowed function"),
    ({"op": "call_module", "name": "x", "target": "lin", "args": []}, "not allowed"),
    ({"op": "get_attr", "name": "x", "target": "secret", "args": []}, "not allowed"),
    ({"op": "call_method", "name": "x", "target": "numpy", "args": [{"ref": "logprobs"}]}, "not allowed"),
    ({"op": "call_function", "name": "x", "target": "builtins.getattr", "args": [{"ref": "logprobs"}, "__class__"]},
     "getattr"),
    ({"op": "call_function", "name": "x", "target": "torch.exp", "args": [{"ref": "nowhere"}]}, "before it is defined"),
])
def test_custom_loss_graphs_are_rebuilt_from_an_allowlist(served, node, message):
    import json
    import urllib.request
    svc, url, _ = served
    sc = client(url)
    sc.create_sampling_client(base_model="tiny").result()  # makes the session
    session = list(svc.last_seen)[-1]
    graph = {"format": 1, "nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}, node,
                                    {"op": "output", "name": "output", "target": "output",
                                     "args": [{"tuple": [{"ref": "logprobs"}, {"dict": {}}]}]}]}
    req = urllib.request.Request(f"{url}/api/v1/create_custom_loss", data=json.dumps(
        {"session_id": session, "custom_loss_seq_id": 0, "name": "evil", "inputs": [{"name": "logprobs", "rank": 1}],
         "graph": graph}).encode(), headers={"X-API-Key": KEYS[url], "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and message in json.loads(e.value.read())["error"]


def test_stable_reinforce_uses_the_server_recorded_logprobs(served):
    svc, url, _ = served
    tc = client(url).create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = TOKENS[:6]
    out = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, seed=0)).result()
    seq = out.sequences[0]
    sampled, q = list(seq.tokens), list(seq.logprobs)
    assert seq.sequence_id in svc.sampling.recorded
    adv = [0.0] * (len(prompt) - 1) + [1.5] * len(sampled)
    d = types.Datum(model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
                    loss_fn_inputs={"target_tokens": prompt[1:] + sampled, "advantages": adv})
    spans_in = [types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(prompt)),
                types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(sampled) - 1)]
    spans_out = [types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
                 types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(sampled))]
    d = d.with_provenance(model_input=spans_in, loss_fn_inputs=spans_out)
    lp = np.asarray(tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    got = tc.forward([d], "stable_reinforce").result().metrics["loss:sum"]
    n = len(prompt) - 1
    ratio = np.exp(lp[n:] - np.asarray(q))
    assert got == pytest.approx(-(np.minimum(ratio, 2.0) * 1.5 * lp[n:]).sum(), rel=1e-4)
    # a client cannot substitute its own "sampler" log-probs, nor claim tokens that were not sampled
    forged = types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": prompt[1:] + [(t + 1) % 200 for t in sampled], "advantages": adv}).with_provenance(
        model_input=spans_in, loss_fn_inputs=spans_out)
    with pytest.raises(tinker.BadRequestError, match="are not the tokens"):
        client(url).create_lora_training_client(base_model="tiny", rank=2, seed=0).result().forward(
            [forged], "stable_reinforce").result()
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="provenance"):
        client(url).create_lora_training_client(base_model="tiny", rank=2, seed=0).result().forward(
            [datum(TOKENS, advantages=[1.0] * (len(TOKENS) - 1))], "stable_reinforce").result()


def test_a_pickled_sampling_client_joins_its_session(served):
    import pickle
    svc, url, _ = served
    tc = client(url).create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    clone = pickle.loads(pickle.dumps(sampler))  # e.g. handed to a rollout worker process
    out = clone.sample(types.ModelInput.from_ints(TOKENS[:4]), 2, types.SamplingParams(max_tokens=3)).result()
    assert len(out.sequences) == 2
    assert list(svc.sampling.clone_counters.values()) == [1]  # the server gave the copy its own counter
