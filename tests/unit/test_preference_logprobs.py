"""Preference scoring with the prompt shared: a pair's chosen and rejected sides run their common
prompt once (and a pass's pairs their common prefix once) through the KV cache, and give the values
and gradients of one row per side, unlabelled tokens after a response included."""
import torch

from retrograd.data.preference import Pair, prompt_length
from retrograd.data.sft import IGNORE, Example
from retrograd.models.load import load_model
from retrograd.models.layout import shared_prefix_length
from retrograd.models.logprobs import MIN_SCORED_PREFIX_SAVING, Scorer
from retrograd.train.preference import pair_logprobs
from tiny import random_lora

SYSTEM = list(range(3, 63))  # a chat template's system prompt: every prompt starts with it, long enough to run once


def side(prompt: list[int], response: list[int], trailing: list[int] = ()) -> Example:
    ids = prompt + response + list(trailing)
    labels = [IGNORE] * len(prompt) + response + [IGNORE] * len(trailing)
    return Example(ids, labels, "test")


def pairs() -> list[Pair]:
    p0, p1 = SYSTEM + [40, 41, 42], SYSTEM + [50]
    return [Pair(side(p0, [60, 61, 62], [7]), side(p0, [63]), "a:1", 0),
            Pair(side(p1, [70, 71]), side(p1, [72, 73, 74, 75], [7, 8]), "a:2", 1)]


def test_shared_prompt_pair_logprobs_equal_one_row_per_side(tiny_model):
    loaded, model = random_lora(tiny_model, seed=0)
    scorer, pad = Scorer(model), loaded.tokenizer.pad_token_id
    assert scorer.shares_prompts  # a llama model with a plain head
    prompts = [p.chosen.input_ids[:prompt_length(p.chosen)] for p in pairs()]  # as pair_logprobs cuts them
    assert shared_prefix_length(prompts, MIN_SCORED_PREFIX_SAVING) == len(SYSTEM)  # the pairs share its pass
    coef = torch.tensor([1.0, -2.0, 0.5, 3.0])

    flat_scorer = Scorer(model)
    flat_scorer.shares_prompts = False  # one padded row per side
    flat = pair_logprobs(flat_scorer, pairs(), pad, "cpu")
    (flat * coef).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    shared = pair_logprobs(scorer, pairs(), pad, "cpu")
    (shared * coef).sum().backward()

    assert shared.shape == (4,)
    assert torch.allclose(shared, flat, atol=1e-5), (shared, flat)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert (p.grad - want[name]).norm() <= 1e-5 * want[name].norm(), name


def test_pair_logprobs_score_only_labelled_response_tokens(tiny_model):
    """Each side's sum by hand from a full-logit forward of its own row."""
    model = load_model(str(tiny_model), log=lambda *_: None).model
    scorer = Scorer(model)
    with torch.no_grad():
        got = pair_logprobs(scorer, pairs(), 0, "cpu")
        want = []
        for pair in pairs():
            for e in (pair.chosen, pair.rejected):
                logp = torch.log_softmax(model(input_ids=torch.tensor([e.input_ids])).logits[0].float(), -1)
                want.append(sum(float(logp[t - 1, e.input_ids[t]]) for t in range(1, len(e.labels))
                                if e.labels[t] != IGNORE))
    assert torch.allclose(got, torch.tensor(want), atol=1e-4), (got, want)
