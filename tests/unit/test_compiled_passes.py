"""[training] compile (models/packed.py: compile_training_passes, train/setup.py: compile_passes): training
passes run the packed forward through torch.compile with the eager pass's values and gradients, passes
without autograd stay eager, and where the packed forward does not run the key is refused with a reason."""
import types

import pytest
import torch

from retrograd.models import packed
from retrograd.models.lean_mlp import lean_mlp
from retrograd.models.logprobs import Scorer
from retrograd.train.setup import compile_passes
from tiny import make_model_dir, random_lora


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _batch(vocab: int) -> dict:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # one right-padded row: the packed grid has padding
    labels = ids.masked_fill(attention == 0, -100)
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def _pass(model, scorer, batch):
    model.zero_grad(set_to_none=True)
    loss = scorer.loss_sum(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _error(grads, reference) -> float:
    """The gradients' distance from the float32 reference, relative to its norm (all LoRA tensors at once)."""
    diff = sum(float((grads[n].double() - r.double()).norm() ** 2) for n, r in reference.items())
    return (diff / sum(float(r.double().norm() ** 2) for r in reference.values())) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_pass_has_the_eager_values_and_gradients(tmp_path, dtype, fresh_dynamo):
    """float32: the compiled pass's loss and LoRA gradients are the eager pass's up to summation order.
    bf16 weights: both round differently (inductor keeps fused intermediates in float32), so each is
    compared with the float32 model's gradients, and the compiled one must be no farther from them."""
    _, model = random_lora(make_model_dir(tmp_path / "m"))
    lean_mlp(model)
    model.train()
    batch = _batch(model.config.vocab_size)
    reference_loss, reference = _pass(model, Scorer(model), batch)  # float32, eager
    if dtype == torch.bfloat16:
        for name, p in model.named_parameters():  # bf16 weights, float32 adapters, as training keeps them
            if "lora_" not in name:
                p.data = p.data.to(dtype)
    scorer = Scorer(model)
    assert scorer.packs
    eager_loss, eager_grads = _pass(model, scorer, batch)
    decoder = scorer.decoder
    packed.compile_training_passes(decoder)
    calls = []
    compiled = packed._COMPILED[decoder]
    packed._COMPILED[decoder] = lambda *a: calls.append(torch.is_grad_enabled()) or compiled(*a)
    loss, grads = _pass(model, Scorer(model), batch)  # a new Scorer: the compiled body belongs to the decoder
    assert calls == [True]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # dynamo really built a graph
    assert eager_grads.keys() == grads.keys() == reference.keys() and len(grads) > 0
    if dtype == torch.float32:
        assert torch.allclose(loss, eager_loss, rtol=1e-5)
        assert _error(grads, eager_grads) < 1e-4
    else:
        assert torch.allclose(loss, reference_loss, rtol=1e-2)
        assert 0 < _error(grads, reference) <= max(1.5 * _error(eager_grads, reference), 0.01)
    with torch.no_grad():  # scoring without autograd runs eager: nothing more is compiled or called
        scorer.loss_sum(batch)
    assert calls == [True]
    unpadded = {"input_ids": batch["input_ids"], "attention_mask": None, "labels": batch["input_ids"]}
    _pass(model, scorer, unpadded)  # rows without padding run the compiled layers too (in float32 they would
    assert calls == [True, True]    # otherwise take transformers' forward)


def _rows(vocab: int, rows: int, width: int, padding: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (rows, width), generator=torch.Generator().manual_seed(seed))
    attention = torch.ones_like(ids)
    attention[-1, width - padding:] = 0
    return {"input_ids": ids, "attention_mask": attention, "labels": ids.masked_fill(attention == 0, -100)}


def test_passes_of_other_shapes_share_one_symbolic_graph(tmp_path, monkeypatch, fresh_dynamo):
    """The first pass's shape compiles static; the first pass of another shape compiles one graph with all
    its lengths symbolic, which then serves more rows, another width and a full grid (left to dynamo, each
    of those compiled a graph more: 4 graphs here instead of 2), every pass with the eager pass's values
    and gradients. A pass of the first shape again runs the static graph."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _, model = random_lora(make_model_dir(tmp_path / "m", layers=1))
    lean_mlp(model)
    model.train()
    vocab = model.config.vocab_size
    batches = [_rows(vocab, 2, 12, 3, 0), _rows(vocab, 2, 10, 2, 1), _rows(vocab, 3, 9, 1, 2),
               _rows(vocab, 2, 14, 0, 3), _rows(vocab, 2, 12, 3, 4)]
    eager = [_pass(model, Scorer(model), b) for b in batches]
    decoder = Scorer(model).decoder
    packed.compile_training_passes(decoder)
    try:
        compiled = [_pass(model, Scorer(model), b) for b in batches]
    finally:
        packed._COMPILED.pop(decoder)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    for (eager_loss, eager_grads), (loss, grads) in zip(eager, compiled):
        assert torch.allclose(loss, eager_loss, rtol=1e-5)
        assert grads.keys() == eager_grads.keys() and len(grads) > 0
        assert _error(grads, eager_grads) < 1e-4


def test_compile_passes_says_why_it_does_not_apply(tmp_path):
    _, model = random_lora(make_model_dir(tmp_path / "m"))
    settings = types.SimpleNamespace(gradient_checkpointing=False)
    said = []
    assert not compile_passes(model, settings, True, said.append)
    assert "fsdp2" in said[-1] and "training.compile is ignored" in said[-1]
    assert not compile_passes(model, types.SimpleNamespace(gradient_checkpointing=True), False, said.append)
    assert "gradient_checkpointing" in said[-1]
    model.get_base_model().config.model_type = "gpt2"  # not a model the packed forward runs
    assert not compile_passes(model, settings, False, said.append)
    assert "'gpt2'" in said[-1]
    assert model.get_base_model().model not in packed._COMPILED
    model.get_base_model().config.model_type = "llama"
    assert compile_passes(model, settings, False, said.append)
    assert model.get_base_model().model in packed._COMPILED
    packed._COMPILED.pop(model.get_base_model().model)


def _compile_a_pass(model, batch) -> tuple[dict, dict]:
    """One training pass through freshly compiled layers: (its LoRA gradients, AOTAutograd's cache counters)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    decoder = Scorer(model).decoder
    packed.compile_training_passes(decoder)
    try:
        _, grads = _pass(model, Scorer(model), batch)
    finally:
        packed._COMPILED.pop(decoder)
    return grads, dict(torch._dynamo.utils.counters["aot_autograd"])


def test_a_later_compile_reuses_the_cached_graph_and_a_changed_function_is_compiled_anew(tmp_path, monkeypatch,
                                                                                        fresh_dynamo):
    """The graph holds our autograd Functions (the LoRA node, the SiLU product) and AOTAutograd's on-disk
    cache still serves it to a later compile; a Function whose backward changed is a new key, so its
    gradients are the changed ones, never a stale artifact's."""
    from retrograd.models import lean_mlp as lean
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _, model = random_lora(make_model_dir(tmp_path / "m"))
    lean_mlp(model)
    model.train()
    batch = _batch(model.config.vocab_size)
    first, counted = _compile_a_pass(model, batch)
    assert counted.get("autograd_cache_saved", 0) >= 1 and not counted.get("autograd_cache_bypass")
    again, counted = _compile_a_pass(model, batch)
    assert counted.get("autograd_cache_hit", 0) >= 1 and not counted.get("autograd_cache_miss")
    assert all(torch.equal(first[n], again[n]) for n in first)

    plain_backward = lean._SiluGateProduct.backward

    def doubled_up_gradient(ctx, grad):
        grad_gate, grad_up = plain_backward(ctx, grad)
        return grad_gate, 2 * grad_up
    monkeypatch.setattr(lean._SiluGateProduct, "backward", staticmethod(doubled_up_gradient))
    changed, counted = _compile_a_pass(model, batch)
    assert counted.get("autograd_cache_miss", 0) >= 1 and not counted.get("autograd_cache_hit")
    _, eager_changed = _pass(model, Scorer(model), batch)
    assert _error(changed, eager_changed) < 1e-4 and _error(first, eager_changed) > 0.05
