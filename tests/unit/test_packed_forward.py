"""The packed forward (models/packed.py) against transformers' own forward: padded batches run their real
tokens only, and every reading the scorer makes from them (hidden states, log-probabilities, the shared-
prompt passes, their gradients) equals the plain forward's to float32 rounding."""
import pytest
import torch

from retrograd.models.load import load_model
from retrograd.models.lora import attach_lora
from retrograd.models.logprobs import Scorer
from retrograd.models.packed import grid_slots, packed_index, scatter_rows
from retrograd.train.policy_update import collate
from tiny import random_lora

SYSTEM = list(range(3, 63))  # a 60-token system prompt: two prompts share it in a scoring pass


def plain(scorer: Scorer) -> Scorer:
    """The same model scored through transformers' forward: the reference."""
    scorer.packer = None
    return scorer


def grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def assert_close_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(got) > 0
    for name in want:
        assert (got[name] - want[name]).norm() <= 1e-5 * want[name].norm() + 1e-9, name


def test_layout_helpers_by_hand():
    real = torch.tensor([[True, True, False], [True, False, False]])
    slots = grid_slots(real)
    assert slots.tolist() == [0, 1, 3]
    assert packed_index(slots, 6).tolist() == [0, 1, 3, 2, 3, 3]
    h = torch.tensor([[1.0], [2.0], [3.0]])
    with pytest.raises(IndexError):  # a padding cell's state is never read: no wrap to the last token
        h[packed_index(slots, 6)[torch.tensor([0, 2])]]
    assert scatter_rows(h, slots, 2, 3)[..., 0].tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]


def test_right_padded_rows_run_packed_with_the_plain_values_and_gradients(tiny_model):
    loaded, model = random_lora(tiny_model)
    packed_scorer, reference = Scorer(model), plain(Scorer(model))
    assert packed_scorer.packs
    pad = loaded.tokenizer.pad_token_id
    seqs = [([5, 6, 7, 8, 9], [10, 11, 12]), ([20, 21], [22]), ([30] * 9, [31, 32, 33, 34])]
    batch = collate(seqs, pad)
    assert batch["attention_mask"] is not None  # rows of different lengths: padded
    coef = torch.randn(3, 4)
    want = reference.token_logprobs(batch, 4)
    (want * coef).sum().backward()
    want_grads = grads(model)
    got = packed_scorer.token_logprobs(batch, 4)
    (got * coef).sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    assert_close_grads(grads(model), want_grads)
    # the hidden states of real positions are transformers' own; padding reads 0
    with torch.no_grad():
        h = packed_scorer.hidden(batch)
        decoder = model.get_base_model().model
        ref = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    real = batch["attention_mask"].bool()
    assert torch.allclose(h[real], ref[real], atol=1e-5)
    assert h[~real].abs().sum() == 0
    # and the summed SFT loss, through the fused head
    labels = batch["input_ids"].masked_fill(~real, -100)
    sft = {**batch, "labels": labels}
    assert torch.allclose(packed_scorer.loss_sum(sft), reference.loss_sum(sft), rtol=1e-6)


def test_unpadded_and_left_padded_batches_keep_the_plain_forward(tiny_model, monkeypatch):
    loaded, model = random_lora(tiny_model)
    scorer = Scorer(model)
    calls = []
    monkeypatch.setattr(scorer.packer, "run", lambda *a, **k: calls.append(1))
    ids = torch.randint(3, 200, (2, 6))
    scorer.hidden({"input_ids": ids, "attention_mask": None})  # nothing padded: one plain pass
    left = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    scorer.hidden({"input_ids": ids, "attention_mask": left})  # left padding: causal alone would not mask it
    assert calls == []


def test_packing_steps_aside_for_eager_attention_and_checkpointing(tiny_model):
    from retrograd.device import attention_for_length
    _, model = random_lora(tiny_model)
    scorer = Scorer(model)
    assert scorer.packs
    model.config._attn_implementation = "eager"
    assert not scorer.packs
    model.config._attn_implementation = "sdpa"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert not scorer.packs  # the plain forward checkpoints its layers; the packed one would not
    bf16 = load_model(str(tiny_model), "bfloat16", log=lambda *_: None).model
    with attention_for_length(bf16, 24):  # short bf16 passes take the eager attention
        assert not Scorer(bf16).packs


@pytest.mark.parametrize("system, split", [([], False), (SYSTEM, False), ([], True), (SYSTEM, True)],
                         ids=["prompt_led", "prompt_led_prefix", "split_rows", "split_rows_prefix"])
def test_shared_prompt_passes_packed_equal_the_plain_passes(tiny_model, monkeypatch, system, split):
    """Every layout of the shared-prompt pass (prompt-led rows or a prompts pass, with or without the common
    prefix apart), packed against the same layout through transformers' forward: values, states, gradients."""
    import retrograd.models.logprobs as logprobs
    if split:
        monkeypatch.setattr(logprobs, "PACK_ROW_TOKENS", 5)  # a prompt's completions overflow one row
    loaded, model = random_lora(tiny_model, seed=2)
    pad = loaded.tokenizer.pad_token_id
    prompts = [system + [30, 31, 32, 33], system + [40], system + [41, 42]]  # prompts of different lengths
    completions = [[10, 20, 30], [50, 60], [70, 80, 90, 95], [5], [6, 7], [8, 9, 11], [12, 13]]
    owner = [0, 0, 0, 1, 1, 1, 2]  # groups of different sizes: the prompt-led rows are padded
    coef = torch.randn(7, 4)
    results = []
    assert Scorer(model).packs  # else both sides below would be the plain forward
    for scorer in (plain(Scorer(model)), Scorer(model)):
        logp, states = scorer.shared_prompt_logprobs(prompts, completions, owner, 4, pad, states=True)
        (logp * coef).sum().backward()
        results.append((logp.detach(), states, grads(model)))
    (want, want_states, want_grads), (got, got_states, got_grads) = results
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got_states, want_states, atol=1e-5)
    assert_close_grads(got_grads, want_grads)
    # both equal one full row per completion through the model's full logits (no fused head, no packing)
    full = Scorer(model)
    full.fusable = False
    rows = full.token_logprobs(collate([(prompts[o], c) for o, c in zip(owner, completions)], pad), 4)
    assert torch.allclose(got, rows.detach(), atol=1e-5)


def test_target_logprobs_packed_equal_the_plain_forward(tiny_model):
    """The service's per-datum log-probabilities: one right-padded pass, packed."""
    _, model = random_lora(tiny_model)
    rows = [([5, 6, 7, 8], torch.tensor([6, 7, 8, 9])), ([10, 11], torch.tensor([11, 12]))]
    with torch.no_grad():
        got = Scorer(model).target_logprobs(rows)
        want = plain(Scorer(model)).target_logprobs(rows)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6)


def test_packed_forward_with_biases_rope_scaling_bf16_and_lora_dropout(tmp_path):
    """A Llama with attention and MLP biases and llama3 RoPE scaling, in float32 with LoRA dropout (eval:
    off) and in bf16: the packed hidden states of a right-padded batch are the plain forward's."""
    from tiny import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                      max_position_embeddings=128, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    ids = torch.randint(3, 200, (3, 40))
    attention = (torch.arange(40)[None] < torch.tensor([[40], [23], [7]])).long()
    batch = {"input_ids": ids, "attention_mask": attention}
    real = attention.bool()
    for dtype, atol in (("float32", 1e-5), ("bfloat16", 0.05)):
        model = load_model(str(tmp_path / "m"), dtype, log=lambda *_: None).model
        model, _ = attach_lora(model, 4, 8, ["auto"], 0.5, 0)  # dropout 0.5: off in eval
        model.eval()
        with torch.no_grad():
            scorer = Scorer(model)
            assert scorer.packs, dtype
            got = scorer.hidden(batch)[real].float()
            want = plain(Scorer(model)).hidden(batch)[real].float()
        assert torch.allclose(got, want, atol=atol), (dtype, (got - want).abs().max())
