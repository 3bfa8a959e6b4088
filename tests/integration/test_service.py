"""`retrograd serve` driven by the unmodified tinker SDK (pinned in the test extra) on a tiny model:
training, every built-in loss, custom losses, checkpoints, resume, sampling, the REST client,
request ordering, and the SDK giving the same loss curve as `retrograd train`."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
from tinker import types

from service_util import client, datum, rest, running_service
from tiny import make_model_dir, write_run

TOKENS = [5 + (7 * i) % 40 for i in range(24)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    model = make_model_dir(tmp / "model")
    with running_service(tmp / "state", {"tiny": model}) as (svc, url):
        yield svc, url, model


def _lp(out, i=0) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].data, dtype=np.float64)


def test_training_losses_checkpoints_and_sampling_through_the_sdk(served):
    svc, url, _ = served
    sc = client(url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    info = tc.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == 4 and info.is_lora
    assert tc.get_tokenizer().encode("red cat", add_special_tokens=False)  # the served tokenizer loads
    base_before = sc.create_sampling_client(base_model="tiny").result().compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()

    # SFT steps submitted ahead (forward_backward and optim_step before waiting): the loss falls
    d = [datum(TOKENS), datum(TOKENS[3:])]
    futures = [(tc.forward_backward(d, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=5e-3)))
               for _ in range(8)]
    losses = [fb.result().metrics["loss:sum"] for fb, op in futures]
    assert all(op.result().metrics["grad_norm:mean"] > 0 for _, op in futures)
    assert losses[-1] < 0.96 * losses[0], losses

    # every built-in loss against the formula on the returned learner log-probs
    base = tc.forward([datum(TOKENS)], "cross_entropy").result()
    lp = _lp(base)
    assert base.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)
    rng = np.random.default_rng(0)
    q = lp + rng.uniform(-0.4, 0.4, lp.shape)
    adv = rng.normal(size=lp.shape)
    r = np.exp(lp - q)
    expected = {
        "importance_sampling": (-(r * adv).sum(), {}),
        "ppo": (-np.minimum(r * adv, np.clip(r, 0.9, 1.1) * adv).sum(),
                {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        "cispo": (-(np.clip(r, 0.0, 4.0) * lp * adv).sum(), {}),
        "dro": (-(lp * adv - 0.5 * 0.3 * (lp - q) ** 2).sum(), {"beta": 0.3}),
    }
    for loss_fn, (value, cfg) in expected.items():
        dd = datum(TOKENS, logprobs=q.astype(np.float32).tolist(), advantages=adv.astype(np.float32).tolist())
        del dd.loss_fn_inputs["weights"]
        out = tc.forward([dd], loss_fn, cfg or None).result()
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-4, abs=1e-4), loss_fn
        np.testing.assert_allclose(_lp(out), lp, atol=1e-5)

    # forward_backward_custom: the SDK's client-side path (forward, then weights = -dL/dlp)
    custom = tc.forward_backward_custom([datum(TOKENS)], lambda data, lps: (-(lps[0] * 2.0).sum(), {}))
    assert custom.result().metrics["loss:sum"] == pytest.approx(-2 * lp.sum(), rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    # checkpoints: state (+ optimizer) and sampler weights
    state = tc.save_state("after-7").result().path
    assert state == f"tinker://{tc.model_id}/weights/after-7"
    sampler_path = tc.save_weights_for_sampler("after-7").result().path
    assert sampler_path.endswith("/sampler_weights/after-7")
    at_save = _lp(tc.forward([datum(TOKENS)], "cross_entropy").result())

    # sampling from the live weights: seeded, and its log-probs are the policy's (T = 1)
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, seed=11, temperature=1.0)
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    a = sampler.sample(prompt, 3, params).result()
    b = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len(a.sequences) == 3 and all(s.sequence_id for s in a.sequences)
    seq = a.sequences[0]
    full = TOKENS[:6] + list(seq.tokens)
    teacher = _lp(tc.forward([datum(full)], "cross_entropy").result())[5:]
    np.testing.assert_allclose(np.asarray(seq.logprobs), teacher[:len(seq.tokens)], atol=1e-4)
    cl = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert cl[0] is None
    np.testing.assert_allclose(np.asarray(cl[1:], dtype=np.float64), at_save, atol=1e-4)
    # stop tokens end a sequence (and are kept, stop_reason "stop")
    stop_tok = seq.tokens[1]
    st = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=8, seed=11, stop=[stop_tok])).result().sequences[0]
    assert st.tokens == seq.tokens[:2] and st.stop_reason == "stop"

    # resume: from the state with optimizer state, the next step matches the original client exactly
    resumed = sc.create_training_client_from_state_with_optimizer(state).result()
    np.testing.assert_allclose(_lp(resumed.forward([datum(TOKENS)], "cross_entropy").result()), at_save, atol=1e-6)
    fresh_opt = sc.create_training_client_from_state(state).result()
    for c in (tc, resumed, fresh_opt):
        c.forward_backward(d, "cross_entropy")
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = {c.model_id: _lp(c.forward([datum(TOKENS)], "cross_entropy").result()) for c in (tc, resumed, fresh_opt)}
    np.testing.assert_allclose(after[resumed.model_id], after[tc.model_id], atol=1e-5)
    assert np.abs(after[fresh_opt.model_id] - after[tc.model_id]).max() > 1e-3  # Adam moments matter
    with pytest.deprecated_call():  # the older spelling still works
        tc.load_state_with_optimizer(state).result()
    np.testing.assert_allclose(_lp(tc.forward([datum(TOKENS)], "cross_entropy").result()), at_save, atol=1e-6)

    # a sampling client on a saved sampler checkpoint (not a live run's weights)
    from_disk = sc.create_sampling_client(model_path=sampler_path).result()
    cl2 = from_disk.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(np.asarray(cl2[1:], dtype=np.float64), at_save, atol=1e-4)
    base_sampler = sc.create_sampling_client(base_model="tiny").result()
    assert len(base_sampler.sample(prompt, 2, params).result().sequences) == 2
    # runs share the served model's frozen tensors: training and sampling them left the base untouched
    base_after = base_sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert base_after == base_before

    # REST: list / get / delete
    rc = rest(url)
    listed = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert {state, sampler_path} <= set(listed)
    assert listed[state].checkpoint_type == "training" and listed[state].size_bytes > 0
    run = rc.get_training_run(tc.model_id).result()
    assert run.base_model == "tiny" and run.lora_rank == 4 and run.last_checkpoint is not None
    assert tc.model_id in {r.training_run_id for r in rc.list_training_runs().result().training_runs}
    info = rc.get_weights_info_by_tinker_path(state).result()
    assert info.lora_rank == 4 and info.base_model == "tiny"
    rc.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert sampler_path not in {c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, params).result()


def test_client_errors_are_clear(served):
    svc, url, _ = served
    sc = client(url)
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        sc.create_lora_training_client(base_model="nope", rank=4).result()
    tc = sc.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:5]),
                      loss_fn_inputs={"target_tokens": TOKENS[1:4], "weights": [1.0] * 3})
    with pytest.raises(tinker.RequestFailedError, match="datum 0.*shape"):
        tc.forward_backward([bad], "cross_entropy").result()
    tc2 = sc.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs"):
        tc2.forward([datum(TOKENS)], "ppo").result()
    tc3 = sc.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint name"):
        tc3.save_state("../escape").result()
    with pytest.raises(tinker.BadRequestError, match="not a valid tinker"):
        sc.create_training_client_from_state(f"tinker://{tc3.model_id}/weights/../../x").result()


def test_ops_of_a_model_run_in_seq_order_whatever_the_arrival_order():
    from retrograd.service.futures import Executor
    ex = Executor(log=lambda *_: None)
    ran = []
    ex.open_model("m", "o", 1)
    ids = {s: ex.submit_ordered("o", "m", s, lambda s=s: ran.append(s) or s) for s in (3, 5, 2, 4)}
    assert ran == []  # nothing may start before seq 1
    ids[1] = ex.submit_ordered("o", "m", 1, lambda: ran.append(1) or 1)
    assert ex.submit_ordered("o", "m", 4, lambda: ran.append(-1)) == ids[4]  # a resubmission is not re-run
    results = [ex.wait(ids[s], "o", 10).result for s in range(1, 6)]
    assert ran == [1, 2, 3, 4, 5] and results == [1, 2, 3, 4, 5]
    assert ex.wait(ids[1], "someone-else", 0) is None  # promises are owner-scoped too
    ex.close()


def test_sdk_gives_the_loss_curve_of_retrograd_train(tmp_path):
    """The same rows, order, LoRA init (seed), AdamW settings and token normalisation through
    `retrograd train` and through the SDK against `retrograd serve`: the same loss step by step."""
    from retrograd.config import load_config
    from retrograd.data.sft import IGNORE, Renderer, load_examples
    from retrograd.models.load import load_model
    from retrograd.service.api import LORA_ALPHA
    from retrograd.train.sft import train_sft

    model = make_model_dir(tmp_path / "model")
    cfg_path = write_run(tmp_path, model, f"""
[lora]
rank = 4
alpha = {LORA_ALPHA}
dropout = 0.0
seed = 7
[training]
lr = 0.01
max_grad_norm = 0.0
adam_beta2 = 0.95
adam_epsilon = 1e-8
batch_size = 2
gradient_accumulation = 1
[sft]
shuffle = false
""", steps=5)
    cfg = load_config(cfg_path)
    train_sft(cfg, log=lambda *_: None)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train_losses) == 5

    tok = load_model(str(model), log=lambda *_: None).tokenizer
    examples = load_examples(str(tmp_path / "train.jsonl"), "auto", Renderer(tok, cfg.training.ctx, True))
    with running_service(tmp_path / "state", {"tiny": model}) as (_, url):
        tc = client(url).create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
        sdk_losses = []
        for step in range(5):
            batch = examples[2 * step:2 * step + 2]
            n = sum(e.n_targets for e in batch)
            data = [datum(e.input_ids, [(1.0 / n if lab != IGNORE else 0.0) for lab in e.labels[1:]]) for e in batch]
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8))
            sdk_losses.append(fb.result().metrics["loss:sum"])
    np.testing.assert_allclose(sdk_losses, train_losses, rtol=2e-5)
    assert sdk_losses[-1] < sdk_losses[0]


def test_soft_targets_n_by_k(served):
    """[N, K] target_tokens / weights (the cookbook's top-K distillation form; the SDK sends them as
    sparse CSR): K log-probs per position, the loss weighted per entry."""
    import torch
    _, url, _ = served
    tc = client(url).create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    plain = _lp(tc.forward([datum(TOKENS)], "cross_entropy").result())
    alt = [(t + 1) % 40 + 5 for t in TOKENS[1:]]
    targets = torch.tensor([TOKENS[1:], alt]).T  # [N, 2]
    weights = torch.tensor([[0.75, 0.25]] * len(alt))
    d = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                    loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                    "weights": types.TensorData.from_torch(weights)})
    out = tc.forward([d], "cross_entropy").result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64).reshape(len(alt), 2)
    np.testing.assert_allclose(lp[:, 0], plain, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(-(lp * weights.numpy()).sum(), rel=1e-5)
