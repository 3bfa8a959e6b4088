"""The packed forward (models/packed.py) against transformers' own forward: padded batches run their real
tokens only, and every reading the scorer makes from them (hidden states, log-probabilities, the shared-
prompt passes, their gradients) equals the plain forward's to float32 rounding."""
import pytest
import torch
import torch.nn.functional as F

from retrograd.models.load import load_model
from retrograd.models.lora import attach_lora
from retrograd.models.logprobs import Scorer
import retrograd.models.packed as packed
from retrograd.models.packed import (_to_grid, attention_bias, causal_half_biases, causal_halves_attention, causal_split,
                                     grid_slots, matmul_attention, packed_index, scatter_rows, sdpa_grouped)
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


def assert_packed_logprobs_equal_plain(model, packed_scorer: Scorer, batch: dict) -> None:
    """token_logprobs of `batch` and the LoRA gradients of a random weighting of them: packed_scorer against
    the same model through transformers' forward."""
    coef = torch.randn(batch["input_ids"].shape[0], 4)
    want = plain(Scorer(model)).token_logprobs(batch, 4)
    (want * coef).sum().backward()
    want_grads = grads(model)
    got = packed_scorer.token_logprobs(batch, 4)
    (got * coef).sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    assert_close_grads(grads(model), want_grads)


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
    assert_packed_logprobs_equal_plain(model, packed_scorer, batch)
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


def test_unpadded_batches_run_packed_and_left_padded_ones_keep_the_plain_forward(tiny_model, monkeypatch):
    """Rows without padding (SFT's) run packed, with transformers' values and gradients, the whole model
    trained included (the norms' own backward); left padding keeps the plain forward (causal attention
    alone would not mask it)."""
    loaded, model = random_lora(tiny_model)
    ids = torch.randint(3, 200, (2, 6))
    labels = ids.clone().index_fill_(1, torch.tensor([0, 1]), -100)  # 4 labelled tokens a row
    unpadded = {"input_ids": ids, "attention_mask": None, "labels": labels}
    assert_packed_logprobs_equal_plain(model, Scorer(model), unpadded)
    for p in model.parameters():  # every weight trained: the RMSNorms' weights get gradients too
        p.requires_grad_(True)
    assert_packed_logprobs_equal_plain(model, Scorer(model), unpadded)
    scorer = Scorer(model)
    calls = []
    run = scorer.packer.run
    monkeypatch.setattr(scorer.packer, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    scorer.hidden(unpadded)
    assert calls == [1]
    left = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    scorer.hidden({"input_ids": ids, "attention_mask": left})
    assert calls == [1]


def test_packing_steps_aside_for_checkpointing_and_runs_eager_models_with_matmul_attention(tiny_model):
    """Gradient checkpointing keeps the plain forward; a model set to eager attention (what
    device.attention_for_length does to short bf16 passes) packs, with matmul attention in every layer,
    and its values and gradients are transformers' eager forward's."""
    from retrograd.device import attention_for_length
    loaded, model = random_lora(tiny_model)
    scorer = Scorer(model)
    assert scorer.packs and not scorer.packer.matmul_attention_for(40)  # float32 SDPA model: SDPA
    model.config._attn_implementation = "eager"
    assert scorer.packs and scorer.packer.matmul_attention_for(4096)
    batch = collate([([5, 6, 7, 8, 9], [10, 11, 12]), ([20, 21], [22])], loaded.tokenizer.pad_token_id)
    assert_packed_logprobs_equal_plain(model, scorer, batch)
    model.config._attn_implementation = "sdpa"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert not scorer.packs  # the plain forward checkpoints its layers; the packed one would not
    bf16 = load_model(str(tiny_model), "bfloat16", log=lambda *_: None).model
    assert Scorer(bf16).packer.matmul_attention_for(512) and not Scorer(bf16).packer.matmul_attention_for(513)
    with attention_for_length(bf16, 24):  # short bf16 passes take the eager attention: still packed
        assert Scorer(bf16).packs


def test_matmul_attention_equals_sdpa_with_grouped_heads_masks_and_past():
    """matmul_attention against SDPA with the key-value heads repeated (transformers' pairing), in float64,
    values and gradients: causal, and an additive mask over past keys in which one query (a padding cell)
    may attend nothing: its output is finite, and the rest is SDPA's when that cell is left out of the loss,
    as a padding cell's output is never read."""
    torch.manual_seed(0)
    rows, heads, kv_heads, width, past, dim = 2, 6, 2, 5, 3, 4
    groups = heads // kv_heads
    q = torch.randn(rows, heads, width, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, past + width, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    coef = torch.randn(rows, heads, width, dim, dtype=torch.float64)
    allowed = torch.rand(rows, width, past + width) < 0.6
    allowed[:, :, 0] = True
    allowed[1, -1] = False
    mask = torch.zeros(rows, 1, width, past + width, dtype=torch.float64).masked_fill(~allowed[:, None], float("-inf"))
    read_attending = allowed.any(-1)[:, None, :, None].expand_as(coef).double()
    cases = [(None, width, torch.ones_like(coef)), (mask, past + width, read_attending)]
    for mask, keys, read in cases:
        ks, vs = k[:, :, -keys:], v[:, :, -keys:]
        bias = attention_bias(mask, rows, width, keys, kv_heads, groups, torch.float64)
        results = []
        for attend in (lambda: matmul_attention(q, ks, vs, bias, 0.3),
                       lambda: F.scaled_dot_product_attention(q, ks.repeat_interleave(groups, 1),
                                                              vs.repeat_interleave(groups, 1), attn_mask=mask,
                                                              is_causal=mask is None, scale=0.3)):
            q.grad = k.grad = v.grad = None
            out = attend()
            (out * coef * read).sum().backward()
            results.append((out.detach() * read, q.grad.clone(), k.grad.clone(), v.grad.clone()))
        assert torch.isfinite(results[0][0]).all()
        for got, want in zip(*results):
            assert torch.allclose(got, want, atol=1e-12)
    with torch.no_grad():
        bias = attention_bias(cases[1][0], rows, width, past + width, kv_heads, groups, torch.float64)
        assert torch.isfinite(matmul_attention(q, k, v, bias, 0.3)).all()


@pytest.mark.parametrize("width", [7, 8])
def test_causal_halves_attention_equals_one_causal_product(width):
    """The causal attention in two halves of the queries (the first half never reads the second half of the
    keys) against one causal matmul_attention, in float64: values and gradients of q, k and v, an odd
    width included (3 + 4 queries)."""
    torch.manual_seed(1)
    rows, heads, kv_heads, dim = 2, 6, 2, 4
    groups = heads // kv_heads
    q = torch.randn(rows, heads, width, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, width, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    coef = torch.randn(rows, heads, width, dim, dtype=torch.float64)
    split = width // 2
    biases = causal_half_biases(rows, width, split, kv_heads, groups, torch.float64)
    assert [tuple(b.shape) for b in biases] == [(groups * split, split), (groups * (width - split), width)]
    results = []
    for attend in (lambda: causal_halves_attention(q, k, v, biases, 0.3),
                   lambda: matmul_attention(q, k, v, attention_bias(None, rows, width, width, kv_heads, groups,
                                                                    torch.float64), 0.3)):
        q.grad = k.grad = v.grad = None
        out = attend()
        (out * coef).sum().backward()
        results.append((out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for got, want in zip(*results):
        assert torch.allclose(got, want, atol=1e-12)


def test_causal_split_threshold_and_the_packed_forward_through_the_halves(tiny_model, monkeypatch):
    """Passes of at least CAUSAL_SPLIT_MIN_WIDTH causal queries split them; a model on matmul attention (eager)
    then runs every layer's attention in halves, with transformers' values and gradients."""
    assert causal_split(packed.CAUSAL_SPLIT_MIN_WIDTH - 1) == 0
    assert causal_split(packed.CAUSAL_SPLIT_MIN_WIDTH + 1) == packed.CAUSAL_SPLIT_MIN_WIDTH // 2
    monkeypatch.setattr(packed, "CAUSAL_SPLIT_MIN_WIDTH", 4)
    calls = []
    halves = packed.causal_halves_attention
    monkeypatch.setattr(packed, "causal_halves_attention", lambda *a: calls.append(1) or halves(*a))
    loaded, model = random_lora(tiny_model)
    model.config._attn_implementation = "eager"
    ids = torch.randint(3, 200, (2, 9))
    labels = ids.clone().index_fill_(1, torch.arange(5), -100)  # 4 labelled tokens a row
    unpadded = {"input_ids": ids, "attention_mask": None, "labels": labels}
    assert_packed_logprobs_equal_plain(model, Scorer(model), unpadded)
    assert len(calls) == model.config.num_hidden_layers


def test_attention_bias_by_hand():
    bias = attention_bias(None, 1, 2, 3, 1, 2, torch.float32)  # 2 queries after 1 past key, 2 heads a group
    low = torch.finfo(torch.float32).min
    assert bias.tolist() == [[0, 0, low], [0, 0, 0]] * 2
    mask = torch.tensor([[[[0.0, float("-inf")]]], [[[float("-inf"), 0.0]]]])  # [R 2, 1, W 1, K 2]
    bias = attention_bias(mask, 2, 1, 2, 2, 1, torch.float32)
    assert bias.shape == (4, 1, 2) and bias[:, 0].tolist() == [[0, low], [0, low], [low, 0], [low, 0]]


def test_unpadded_bf16_rows_run_packed_for_the_matmul_attention(tiny_model):
    """In bf16 on a CPU the packed forward's matmul attention is the faster one, so unpadded rows (an SFT
    pass of full rows) run packed too: the same hidden states as transformers' forward, to bf16 rounding."""
    model = load_model(str(tiny_model), "bfloat16", log=lambda *_: None).model
    scorer = Scorer(model)
    batch = {"input_ids": torch.randint(3, 200, (2, 24)), "attention_mask": None}
    calls = []
    run = scorer.packer.run
    scorer.packer.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    with torch.no_grad():
        got = scorer.hidden(batch).float()
        want = plain(Scorer(model)).hidden(batch).float()
    assert calls == [1]
    assert torch.allclose(got, want, atol=0.05), (got - want).abs().max()


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


def datum_reference(model, tokens: list[int], targets: torch.Tensor) -> torch.Tensor:
    """One Tinker datum alone, through the model's full logits (no packing, no fused head): [n] or [n, K]."""
    logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    return logp.gather(1, targets[:, None])[:, 0] if targets.ndim == 1 else logp.gather(1, targets)


@pytest.mark.parametrize("packs", [True, False])
def test_target_logprobs_equal_each_datum_alone_in_values_and_gradients(tiny_model, monkeypatch, packs):
    """The service's per-datum log-probabilities: one right-padded pass (packed, or transformers' forward read
    at the real positions), the one-target datums through one fused-head call. Values and LoRA gradients of
    a random weighting equal each datum scored alone through the full logits, soft [n, K] targets included."""
    import retrograd.models.fused_head as fused_head
    import retrograd.models.logprobs as logprobs
    _, model = random_lora(tiny_model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    rows = []
    for n in (9, 2, 13, 5, 1, 7):
        tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
        targets = torch.randint(3, vocab, (n, 3) if n == 5 else (n,), generator=gen)  # datum 3: soft targets
        rows.append((tokens, targets))
    coef = [torch.randn(t.shape, generator=gen) for _, t in rows]
    want = [datum_reference(model, tokens, targets) for tokens, targets in rows]
    sum((w * c).sum() for w, c in zip(want, coef)).backward()
    want_grads = grads(model)
    calls = []
    monkeypatch.setattr(logprobs, "linear_token_logprobs",
                        lambda h, *a, **k: calls.append(h.shape[0]) or fused_head.linear_token_logprobs(h, *a, **k))
    scorer = Scorer(model) if packs else plain(Scorer(model))
    got = scorer.target_logprobs(rows)
    sum((g * c).sum() for g, c in zip(got, coef)).backward()
    assert calls == [9 + 2 + 13 + 1 + 7]  # every one-target datum in one head call, the soft one beside it
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert torch.allclose(g, w, atol=1e-5)
    assert_close_grads(grads(model), want_grads)


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


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_sdpa_equals_attention_over_keys_copied_per_query_head(masked):
    """sdpa_grouped lets each key/value head serve its query heads inside the kernel; against SDPA over
    keys and values repeated per query head (transformers' repeat_kv): same output, same gradients of q,
    k and v to float32 rounding (the kernel sums a group's key gradients in another order)."""
    torch.manual_seed(0)
    R, H, KV, W, P, D = 2, 6, 2, 9, 4, 8
    q = torch.randn(R, H, W, D, requires_grad=True)
    k = torch.randn(R, KV, P + W, D, requires_grad=True)
    v = torch.randn(R, KV, P + W, D, requires_grad=True)
    mask = None
    if masked:  # every query sees the P past keys and its own causal prefix; row 1 also hides key 2
        allowed = torch.ones(W, P + W, dtype=torch.bool).tril(P)
        mask = torch.zeros(R, 1, W, P + W).masked_fill(~allowed, float("-inf"))
        mask[1, :, :, 2] = float("-inf")
    else:
        k, v = (t[:, :, P:].detach().requires_grad_() for t in (k, v))
    weight = torch.randn(R, H, W, D)

    def run(attend):
        q.grad = k.grad = v.grad = None
        out = attend()
        (out * weight).sum().backward()
        return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    got = run(lambda: sdpa_grouped(q, k, v, mask, 0.3))
    copies = H // KV
    want = run(lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(copies, 1), v.repeat_interleave(copies, 1),
                                                      attn_mask=mask, is_causal=mask is None, scale=0.3))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_grid_without_padding_is_a_view_of_the_tokens():
    """Full rows (SFT's) scatter nothing: the grid is the tokens' own memory, so no zeros are written and
    backward gathers nothing; with padding the real tokens land at their slots and padding is zero."""
    t = torch.randn(6, 2, 4)
    full = torch.ones(2, 3, dtype=torch.bool)
    grid = _to_grid(t, grid_slots(full), 2, 3, True)
    assert grid.shape == (2, 2, 3, 4) and grid.data_ptr() == t.data_ptr()
    torch.testing.assert_close(grid, t.view(2, 3, 2, 4).transpose(1, 2), rtol=0, atol=0)
    # a graph compiled for symbolic lengths takes the padding path for a full grid too: the same values
    scattered = _to_grid(t, grid_slots(full), 2, 3, False)
    assert scattered.data_ptr() != t.data_ptr()
    assert torch.equal(scattered, grid)
    padded = torch.tensor([[True, True, False], [True, True, True]])
    grid = _to_grid(t[:5], grid_slots(padded), 2, 3, False)
    assert grid.data_ptr() != t.data_ptr()
    assert torch.equal(grid[0, :, 2], torch.zeros(2, 4))
    assert torch.equal(grid[1, :, 2], t[4])
