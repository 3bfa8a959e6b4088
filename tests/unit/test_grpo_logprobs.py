"""GRPO's teacher-forced log-probabilities: a group's completions sharing one prompt forward, and
prompts sharing their common prefix's forward (through the KV cache, gradients included), give the
values and gradients of one row per completion."""
import pytest
import torch

from retrograd.models.load import load_model
from retrograd.models.layout import MIN_SHARED_PREFIX_SAVING, pack_completions, prompts_lead_rows, shared_prefix_length
from retrograd.models.logprobs import MIN_SCORED_PREFIX_SAVING, PACK_ROW_TOKENS, Scorer
from retrograd.train.policy_update import collate
from tiny import random_lora

# 60 tokens every prompt starts with, like a chat template's system prompt: enough that two prompts share it
# in a scoring pass (MIN_SCORED_PREFIX_SAVING)
SYSTEM = list(range(3, 63))
# a 20-token prefix: two prompts would share it in the sampler's prefill (MIN_SHARED_PREFIX_SAVING), not in a
# scoring pass, so the scorer's own prefix length must reach every piece of its layout
SHORT_SYSTEM = SYSTEM[:20]


def decoder_passes(scorer) -> list:
    """Counts the scorer's decoder passes: a list that gets each pass's number of tokens embedded (the
    packed forward embeds the real tokens only)."""
    tokens = []
    scorer.decoder.embed_tokens.register_forward_pre_hook(lambda _, args: tokens.append(args[0].numel()))
    return tokens


def test_shared_prefix_length():
    assert shared_prefix_length([SYSTEM + [30, 31], SYSTEM + [40]]) == 60
    assert shared_prefix_length([SYSTEM, SYSTEM + [40]]) == 59  # each prompt keeps a token of its own
    assert shared_prefix_length([SYSTEM + [30]]) == 0  # one prompt: nothing to share
    short = SYSTEM[:MIN_SHARED_PREFIX_SAVING - 1]
    assert shared_prefix_length([short + [30], short + [40]]) == 0  # too little saved for an extra pass
    assert shared_prefix_length([short + [30], short + [40], short + [50]]) == len(short)
    # a scoring pass (forward and backward) shares a prefix only where it saves more
    forty = SYSTEM[:40]
    assert shared_prefix_length([forty + [30], forty + [40]], MIN_SCORED_PREFIX_SAVING) == 0
    assert shared_prefix_length([forty + [30], forty + [40], forty + [50]], MIN_SCORED_PREFIX_SAVING) == 40


def one_row_per_completion(model) -> Scorer:
    """The reference: each completion in a row of its own with its prompt, through transformers' forward
    (no shared prompt, no packing)."""
    scorer = Scorer(model)
    scorer.packer = None
    return scorer


@pytest.mark.parametrize("system, passes", [([], 1), (SHORT_SYSTEM, 1), (SYSTEM, 2)],
                         ids=["distinct_prompts", "short_prefix_in_rows", "common_prefix_apart"])
def test_shared_prompt_forward_equals_one_row_per_completion(tiny_model, system, passes):
    loaded, model = random_lora(tiny_model, seed=0)
    scorer, pad = Scorer(model), loaded.tokenizer.pad_token_id
    prompts = [system + loaded.tokenizer(text)["input_ids"] for text in ("hello there friend", "hi")]
    completions = [[10, 20, 30, 40], [50, 60], [70, 80, 90], [5]]
    owner = [0, 1, 0, 1]  # two groups, prompts of different lengths
    coef = torch.randn(4, 4)
    rows, _ = pack_completions(owner, [len(c) for c in completions], PACK_ROW_TOKENS)
    assert prompts_lead_rows(rows)  # one row per prompt: each prompt leads its row in one pass

    rows_batch = collate([(prompts[o], c) for o, c in zip(owner, completions)], pad)
    plain = one_row_per_completion(model).token_logprobs(rows_batch, 4)
    (plain * coef).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    shapes = decoder_passes(scorer)
    shared = scorer.shared_prompt_logprobs(prompts, completions, owner, 4, pad)
    (shared * coef).sum().backward()

    # the common prefix runs apart only from MIN_SCORED_PREFIX_SAVING saved tokens (60 x 1, not 20 x 1),
    # then one pass of prompt-led rows: what is not shared, and no padding
    assert len(shapes) == passes, shapes
    prefix_apart = shared_prefix_length(prompts, MIN_SCORED_PREFIX_SAVING)  # what the prefix pass took, if it ran
    assert shapes[-1] == sum(len(p) - prefix_apart for p in prompts) + sum(len(c) for c in completions)
    assert torch.allclose(shared, plain, atol=1e-6)
    assert shared[1, 2:].abs().sum() == 0 and shared[3, 1:].abs().sum() == 0  # nothing past a completion
    for name, p in model.named_parameters():
        if p.requires_grad:
            # summed in another order: equal to float32 rounding, relative to the gradient's size
            assert (p.grad - want[name]).norm() <= 1e-5 * want[name].norm(), name


def test_short_bf16_passes_use_eager_attention_with_the_same_values(tiny_model):
    from retrograd.device import EAGER_ATTENTION_MAX_KEYS, attention_for_length
    model = load_model(str(tiny_model), "bfloat16", log=lambda *_: None).model
    cfg = model.config
    assert cfg._attn_implementation == "sdpa"
    ids = torch.randint(3, 200, (2, 24))
    with torch.no_grad():
        sdpa = model(input_ids=ids).logits.float()
        with attention_for_length(model, 24):
            assert cfg._attn_implementation == "eager"
            eager = model(input_ids=ids).logits.float()
        assert cfg._attn_implementation == "sdpa"  # restored
    assert torch.allclose(eager, sdpa, atol=0.03)
    with attention_for_length(model, EAGER_ATTENTION_MAX_KEYS + 1):  # long: SDPA stays
        assert cfg._attn_implementation == "sdpa"
    fp32 = load_model(str(tiny_model), log=lambda *_: None).model
    with attention_for_length(fp32, 24):  # float32 gains nothing: SDPA stays
        assert fp32.config._attn_implementation == "sdpa"


def test_pack_completions_by_hand():
    from retrograd.models.layout import pack_completions
    # prompt 0: lengths 4, 2, 3 (capacity 6): 4 first, then 2 beside it, 3 in a new row; prompt 1: 5 and 1
    rows, width = pack_completions([0, 1, 0, 0, 1], [4, 5, 2, 3, 1], 6)
    assert rows == [(0, [(0, 0), (2, 4)]), (0, [(3, 0)]), (1, [(1, 0), (4, 5)])]
    assert width == 6
    # a row never mixes prompts, and every completion is placed exactly once within the capacity
    owner, lengths = [2, 0, 1, 0, 2, 2, 1], [7, 3, 3, 8, 1, 2, 9]
    rows, width = pack_completions(owner, lengths, 9)
    placed = sorted(i for _, members in rows for i, _ in members)
    assert placed == list(range(7))
    for o, members in rows:
        assert all(owner[i] == o for i, _ in members)
        ends = [at + lengths[i] for i, at in members]
        assert max(ends) <= 9 and [at for _, at in members] == [0] + ends[:-1]  # side by side, no gaps
    assert width == max(sum(lengths[i] for i, _ in m) for _, m in rows)


def test_packed_attention_mask_by_hand():
    from retrograd.models.layout import packed_attention_mask
    prompt_keys = torch.tensor([[False, True, True]])  # one left-padded prompt position
    segment = torch.tensor([[0, 0, 1, -1]])  # completion 0 (2 tokens), completion 1 (1 token), padding
    mask = packed_attention_mask(prompt_keys, segment, torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    seen = mask[0, 0] == 0
    want = torch.tensor([[0, 1, 1, 1, 0, 0, 0],   # token 0 of completion 0: the prompt and itself
                         [0, 1, 1, 1, 1, 0, 0],   # token 1: also token 0
                         [0, 1, 1, 0, 0, 1, 0],   # completion 1: the prompt and itself, not completion 0
                         [0, 1, 1, 0, 0, 0, 0]],  # padding: the prompt only (never a row of nothing)
                        dtype=torch.bool)
    assert torch.equal(seen, want)
    assert float(mask.min()) == torch.finfo(torch.float32).min


def test_prompt_led_attention_mask_by_hand():
    from retrograd.models.layout import PADDING, PROMPT, prompt_led_attention_mask
    segment = torch.tensor([[PROMPT, PROMPT, 0, 0, 1, PADDING]])  # a 2-token prompt, completions 0 and 1, padding
    mask = prompt_led_attention_mask(1, segment, torch.float32)  # after a 1-token common prefix
    assert mask.shape == (1, 1, 6, 7)
    seen = mask[0, 0] == 0
    want = torch.tensor([[1, 1, 0, 0, 0, 0, 0],   # prompt token 0: the prefix and itself
                         [1, 1, 1, 0, 0, 0, 0],   # prompt token 1: also prompt token 0
                         [1, 1, 1, 1, 0, 0, 0],   # completion 0, token 0: the prefix, the prompt, itself
                         [1, 1, 1, 1, 1, 0, 0],   # completion 0, token 1: also its token 0
                         [1, 1, 1, 0, 0, 1, 0],   # completion 1: the prompt and itself, not completion 0
                         [1, 1, 1, 0, 0, 0, 0]],  # padding: the prefix and the prompt (never a row of nothing)
                        dtype=torch.bool)
    assert torch.equal(seen, want)
    assert float(mask.min()) == torch.finfo(torch.float32).min
    assert prompts_lead_rows([(0, [(0, 0)]), (1, [(1, 0), (2, 3)])])
    assert not prompts_lead_rows([(0, [(0, 0)]), (0, [(1, 0)])])  # prompt 0 spans two rows


@pytest.mark.parametrize("system, passes", [(SHORT_SYSTEM, 2), (SYSTEM, 3)],
                         ids=["short_prefix_in_prompts_pass", "common_prefix_apart"])
def test_completions_split_over_several_rows_per_prompt(tiny_model, monkeypatch, system, passes):
    """A prompt whose completions overflow one packed row gets several rows (each gathering its prompt's
    cache): still the values and gradients of one row per completion. With a 20-token prefix the prompts
    pass keeps the prefix (the sampler's prefill would split it off), at positions counted from 0."""
    import retrograd.models.logprobs as logprobs
    monkeypatch.setattr(logprobs, "PACK_ROW_TOKENS", 5)
    loaded, model = random_lora(tiny_model, seed=1)
    scorer, pad = Scorer(model), loaded.tokenizer.pad_token_id
    prompts = [system + [30, 31, 32], system + [40]]
    completions = [[10, 20, 30], [50, 60], [70, 80, 90, 95], [5], [6, 7], [8, 9, 11]]
    owner = [0, 0, 0, 1, 1, 1]
    rows, _ = pack_completions(owner, [len(c) for c in completions], 5)
    assert sum(o == 0 for o, _ in rows) >= 2  # the split this test is about
    assert not prompts_lead_rows(rows)  # so the prompts run in a pass of their own
    coef = torch.randn(6, 4)
    rows_batch = collate([(prompts[o], c) for o, c in zip(owner, completions)], pad)
    plain = one_row_per_completion(model).token_logprobs(rows_batch, 4)
    (plain * coef).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    shapes = decoder_passes(scorer)
    shared, states = scorer.shared_prompt_logprobs(prompts, completions, owner, 4, pad, states=True)
    (shared * coef).sum().backward()
    # [the prefix,] the prompts (what is not shared), the completion rows: real tokens only
    prefix_apart = len(system) if passes == 3 else 0
    assert len(shapes) == passes and shapes[-1] == sum(len(c) for c in completions), shapes
    assert shapes[-2] == sum(len(p) - prefix_apart for p in prompts)
    assert torch.allclose(shared, plain, atol=1e-6)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert (p.grad - want[name]).norm() <= 1e-5 * want[name].norm(), name
    # the states that predicted each token: those of a full row per completion, zero past its end
    _, full_states = one_row_per_completion(model).token_logprobs(rows_batch, 4, states=True)
    assert torch.allclose(states, full_states, atol=1e-5)


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_packed_completions_in_bf16_match_one_row_per_completion(tiny_model, eager):
    """The packed pass's additive mask in bf16, through SDPA and through the eager attention that
    short bf16 passes take on CPU: the values of one row per completion, to bf16 rounding."""
    from retrograd.device import attention_for_length
    model = load_model(str(tiny_model), "bfloat16", log=lambda *_: None).model
    scorer = Scorer(model)
    prompts = [SYSTEM + [30, 31, 32], SYSTEM + [40]]
    completions = [[10, 20, 30, 40], [50, 60], [70, 80, 90], [5]]
    owner = [0, 1, 0, 1]
    with torch.no_grad(), attention_for_length(model, 64 if eager else 10_000):
        assert (model.config._attn_implementation == "eager") == eager
        plain = scorer.token_logprobs(collate([(prompts[o], c) for o, c in zip(owner, completions)], 0), 4)
        packed = scorer.shared_prompt_logprobs(prompts, completions, owner, 4, 0)
    assert torch.isfinite(packed).all()
    assert torch.allclose(packed.float(), plain.float(), atol=0.05), (packed, plain)
