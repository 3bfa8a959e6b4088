"""The sampler on a tiny random model: its log-probabilities equal a teacher-forced forward of the
same tokens (T = 1, left-padded prompts, shared prefill), the same seed gives the same completions,
EOS stops a sequence exactly, and top-k / top-p keep the right tokens."""
import math

import pytest
import torch

from retrograd.models.load import load_model
from retrograd.models.layout import shared_prefix_length
from retrograd.rl.sampler import GroupStreams, filter_logits, sample


def _setup(tiny_model):
    loaded = load_model(str(tiny_model), log=lambda *_: None)
    tok = loaded.tokenizer
    return loaded.model, tok, [tok("hello there")["input_ids"], tok("a much longer prompt here")["input_ids"]]


@pytest.mark.parametrize("common_prefix", [False, True])
def test_logprobs_equal_a_teacher_forced_forward(tiny_model, common_prefix):
    model, tok, prompts = _setup(tiny_model)
    if common_prefix:  # a shared start (a chat template's system prompt), prefilled once for both
        prompts = [list(range(5, 25)) + p for p in prompts]
        assert shared_prefix_length(prompts) >= 20
    s = sample(model, prompts, 3, 10, eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id,
               generator=torch.Generator().manual_seed(0))
    assert s.prompt_index == [0, 0, 0, 1, 1, 1]
    for i, c in enumerate(s.completion_ids):
        p = prompts[s.prompt_index[i]]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].float(), -1)
        forced = [float(lp[len(p) - 1 + j, t]) for j, t in enumerate(c)]
        assert max(abs(a - b) for a, b in zip(forced, s.behaviour_logprobs[i])) < 1e-5


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_entropies_are_those_of_the_sampled_distribution(tiny_model, temperature, top_k):
    """entropy=True: per sampled token, -sum p log p of the distribution it was drawn from
    (temperature and top-k applied), computed here from a teacher-forced forward; the draws are
    the same as without it."""
    model, tok, prompts = _setup(tiny_model)
    kw = dict(eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id, temperature=temperature, top_k=top_k)
    s = sample(model, prompts, 2, 8, generator=torch.Generator().manual_seed(3), entropy=True, **kw)
    plain = sample(model, prompts, 2, 8, generator=torch.Generator().manual_seed(3), **kw)
    assert s.completion_ids == plain.completion_ids and plain.entropies is None
    for i, c in enumerate(s.completion_ids):
        p = prompts[s.prompt_index[i]]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:len(p) - 1 + len(c)].float() / temperature
        if top_k:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        want = [-sum(float(q) * math.log(float(q)) for q in row if q > 0) for row in probs]
        assert len(s.entropies[i]) == len(c)
        assert max(abs(a - b) for a, b in zip(want, s.entropies[i])) < 1e-4


def test_same_seed_same_completions_and_greedy(tiny_model):
    model, tok, prompts = _setup(tiny_model)
    kw = dict(eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id)
    a = sample(model, prompts, 4, 8, generator=torch.Generator().manual_seed(5), **kw)
    b = sample(model, prompts, 4, 8, generator=torch.Generator().manual_seed(5), **kw)
    c = sample(model, prompts, 4, 8, generator=torch.Generator().manual_seed(6), **kw)
    assert a.completion_ids == b.completion_ids != c.completion_ids
    g = sample(model, prompts, 2, 8, generator=None, temperature=0.0, **kw)
    assert g.completion_ids[0] == g.completion_ids[1]  # greedy: the group agrees
    with torch.no_grad():
        first = int(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].argmax())
    assert g.completion_ids[0][0] == first


def test_a_group_samples_the_same_whatever_shares_its_batch(tiny_model):
    # per-group streams: what a torchrun rank draws for group 1 alone is what one process draws for it
    # beside group 0 (the decode batch, its shared prefix and the finished rows all differ)
    model, tok, prompts = _setup(tiny_model)
    kw = dict(eos_ids={tok.eos_token_id, 40, 41, 42}, pad_id=tok.pad_token_id)
    both = sample(model, prompts, 3, 10, generator=GroupStreams(7, [0, 1], 3), **kw)
    alone = sample(model, prompts[1:], 3, 10, generator=GroupStreams(7, [1], 3), **kw)
    assert both.completion_ids[3:] == alone.completion_ids
    for a, b in zip(both.behaviour_logprobs[3:], alone.behaviour_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    other = sample(model, prompts[1:], 3, 10, generator=GroupStreams(7, [0], 3), **kw)
    assert other.completion_ids != alone.completion_ids  # the stream is the group's place, not the prompt's


def test_eos_stops_each_sequence(tiny_model):
    model, tok, prompts = _setup(tiny_model)
    # a bias on the head makes token 42 overwhelmingly likely after anything; call it EOS
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.weight.shape[0]))
    with torch.no_grad():
        head.bias[42] = 100.0
    s = sample(model, prompts, 2, 6, eos_ids={42}, pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    assert all(c == [42] for c in s.completion_ids) and s.truncated == [False] * 4


def test_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    k = filter_logits(logits, 1.0, 2, 1.0)
    assert torch.isinf(k[0, 2:]).all() and torch.isfinite(k[0, :2]).all()
    p = torch.softmax(logits, -1)[0]
    keep = filter_logits(logits, 1.0, 0, float(p[0] + 0.01))  # needs the top two tokens to reach top_p
    assert torch.isfinite(keep[0, :2]).all() and torch.isinf(keep[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, 1.0, 0, float(p[0]) - 0.01)[0, :1]).all()
    assert math.isclose(float(filter_logits(logits, 2.0, 0, 1.0)[0, 0]), 1.0)


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    from retrograd.rl.sampler import draw_from_logits
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).repeat(20000, 1)
    got, logp = draw_from_logits(probs.log() + 3.0, torch.Generator().manual_seed(0))  # any shift
    freq = torch.bincount(got, minlength=4).double() / len(got)
    assert freq[1] == 0 and torch.allclose(freq, probs[0].double(), atol=0.015)
    assert torch.allclose(logp, probs[0].log()[got], atol=1e-6)
    again, _ = draw_from_logits(probs.log(), torch.Generator().manual_seed(0))
    assert torch.equal(got, again)
    # the last token masked out: a uniform that rounds up to the total still lands on a real token
    masked = torch.tensor([[0.0, 0.0, float("-inf")]]).repeat(5000, 1)
    assert int(draw_from_logits(masked, torch.Generator().manual_seed(1))[0].max()) <= 1


def test_folded_lora_samples_like_the_adapter_and_restores_the_weights(tiny_model):
    from retrograd.models.lora import attach_lora
    from retrograd.rl.sampler import lora_folded
    model, tok, prompts = _setup(tiny_model)
    model, _ = attach_lora(model, 4, 8, ["auto"], 0.0, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id)
    plain = sample(model, prompts, 3, 8, generator=torch.Generator().manual_seed(1), **kw)
    with lora_folded(model):
        folded = sample(model, prompts, 3, 8, generator=torch.Generator().manual_seed(1), **kw)
    assert folded.completion_ids == plain.completion_ids
    assert max(abs(a - b) for x, y in zip(folded.behaviour_logprobs, plain.behaviour_logprobs)
               for a, b in zip(x, y)) < 1e-5
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # bit for bit


def test_sampling_copy_casts_the_folded_weights_and_leaves_the_model_alone(tmp_path):
    from retrograd.models.lora import attach_lora
    from retrograd.rl.sampler import lora_folded, sampling_copy
    from tiny import make_model_dir
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(make_model_dir(tmp_path / "m"))
    model, _ = attach_lora(base, 4, 8, ["q", "v"], 0.0, 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a non-zero adapter, so folding matters
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[3, 9, 4, 7, 1, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with lora_folded(model), sampling_copy(model, torch.bfloat16) as low:
            assert all(p.dtype == torch.bfloat16 for p in low.parameters())
            got = low(input_ids=ids).logits.float()
            head = low.get_output_embeddings().weight
            assert head.data_ptr() == low.get_input_embeddings().weight.data_ptr()  # tied stays tied
        with sampling_copy(model, torch.float32) as same:
            assert same is model
    assert torch.allclose(got, want, atol=0.05, rtol=0.05) and not torch.equal(got, want)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n
