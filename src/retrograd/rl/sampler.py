"""The in-process sampler: batched, KV-cached generation on the live policy.

All prompts of an update are prefilled together once (left-padded, explicit position ids; their
common prefix, such as a chat template's system prompt, once for all), the cache is then repeated
group_size times so a group shares its prompt's prefill, and every decode
step runs the batch one token forward. A sequence stops at its first EOS (or stop string) and
leaves the batch, so nothing after EOS is sampled or trained and later steps get cheaper. The
decode engines (a fast one for Llama-family models, transformers' forward for the rest) live in
rl/decoder.py.

Convention for the returned log-probabilities: `behaviour_logprobs` are under the distribution
that was actually sampled (temperature, top-k, top-p applied). Training uses the policy's plain
(T = 1) log-probabilities of the same tokens from a teacher-forced forward; with temperature 1 and
no top-k / top-p the two agree, which the tests check.

Randomness comes only from the `generator` passed in (seeded per update by the caller), so the
same seed gives the same completions and a resumed run samples exactly what the straight run did.
The training loops pass GroupStreams, one stream per prompt group: a group's completions then do
not depend on which other prompts share the batch, so a group samples the same whether one
process draws the whole update or each of N ranks draws its share.

A model sharded with FSDP2 (each rank holds 1/N of every weight) samples inside `whole_weights`,
which gathers the weights once for all of a phase's calls; `sample` refuses it otherwise.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from retrograd.models.layout import split_prompts


@dataclass
class Samples:
    prompt_index: list[int]  # which prompt each completion belongs to (groups are contiguous)
    completion_ids: list[list[int]]  # sampled tokens, up to and including EOS
    behaviour_logprobs: list[list[float]]
    truncated: list[bool]  # used every max_new_tokens without EOS / stop string
    generated_tokens: int  # tokens the batch decoded (what sampling tokens/s counts)
    entropies: list[list[float]] | None = None  # Shannon entropy of the sampled distribution, when asked


def eos_ids(tokenizer, model) -> set[int]:
    """The tokens that end a completion: the tokenizer's EOS and the generation config's."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | set(gen if isinstance(gen, list) else [gen])
    ids.discard(None)
    return ids


def stop_string_check(tokenizer, stops: list[str]):
    """A `stop` callback for `sample`: ends a completion (keeping every token so far) once its
    decoded tail contains one of `stops`; None when there are none."""
    if not stops:
        return None
    stops = list(stops)

    def check(ids: list[int]):
        text = tokenizer.decode(ids[-16:], skip_special_tokens=True)
        return len(ids) if any(st in text for st in stops) else None
    return check


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] raw logits -> logits of the sampling distribution (-inf outside top-k / top-p)."""
    if temperature == 1.0 and not top_k and top_p >= 1.0:  # the plain distribution: no pass over [B, V]
        return logits.float()
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly more likely than it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


@contextmanager
def lora_folded(model):
    """Sample from W + s * B @ A as one matrix instead of W x + s * B (A x): each adapted layer's
    base weight is replaced, for the duration, by a new merged tensor and the adapter is disabled;
    the original tensors are put back untouched afterwards (never W + D - D, so no drift). The
    adapter's two extra matmuls per layer cost ~12 % of a decode step."""
    if not hasattr(model, "disable_adapter"):
        yield
        return
    swaps = []
    with torch.no_grad():
        for module in model.modules():
            lora_a = getattr(module, "lora_A", None)
            if lora_a is None or "default" not in lora_a or not hasattr(module, "base_layer"):
                continue
            base = module.base_layer
            delta = module.scaling["default"] * (module.lora_B["default"].weight @ lora_a["default"].weight)
            swaps.append((base, base.weight.data))
            base.weight.data = base.weight.data + delta.to(base.weight.dtype)
    try:
        with (model.disable_adapter() if swaps else nullcontext()):
            yield
    finally:
        for base, original in swaps:
            base.weight.data = original


@contextmanager
def whole_weights(model):
    """Within: `model` with every weight whole, to sample and evaluate from. Under FSDP2 (retrograd/dist.py)
    each rank holds 1/N of every weight: they are gathered once on entry (a collective: every rank
    enters, one without prompts too) and freed on exit, and in between the model runs no collective, so
    ranks may decode different numbers of steps. On exit the decoder's prepared copies of the gathered
    weights are dropped: the next gathering refills the same tensor objects and keeps their version, so
    a kept copy could go stale unnoticed (rl/decoder.forget), and no whole copy outlives the phase. A
    no-op for a model that is not sharded."""
    from retrograd import dist
    if not dist.is_sharded(model):
        yield model
        return
    from retrograd.rl.decoder import forget
    with dist.unsharded(model):
        try:
            yield model
        finally:
            forget(list(model.parameters()))


@contextmanager
def sampling_copy(model, dtype: torch.dtype):
    """The model to sample with: `model` itself, or for another dtype a copy whose parameters are
    cast from the current ones (inside `lora_folded`, the merged weights), made per use and freed
    after. Buffers (rotary frequencies) stay shared and in float32; the original is untouched. A model
    with FSDP2 modules (inside whole_weights) is not deep-copied (their state holds the process group):
    its parameters are cast in place for the duration and put back untouched."""
    if all(p.dtype == dtype for p in model.parameters()):
        yield model
        return
    from retrograd import dist
    if dist.is_sharded(model):
        originals = [(p, p.data) for p in model.parameters()]
        try:
            for p, data in originals:
                p.data = data.to(dtype)
            yield model
        finally:
            for p, data in originals:
                p.data = data
        return
    import copy
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    low = copy.deepcopy(model, memo)
    try:
        yield low
    finally:
        del low, memo


def distribution_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] logits (-inf outside the support) -> [B] Shannon entropy in nats, -sum p log p."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


class GroupStreams:
    """One seeded random stream per prompt group: `group_ids` name the groups of the prompts passed to
    `sample` (their places in the whole update), so group g draws from the same stream whichever
    process samples it and whatever else is in its batch."""

    def __init__(self, seed: int, group_ids: list[int], group_size: int):
        self.group_size = group_size
        self.gens = [torch.Generator().manual_seed((seed * 1_000_033 + g) % (1 << 63)) for g in group_ids]

    def uniform(self, active: torch.Tensor) -> torch.Tensor:
        """One uniform per decoding row; `active` = the rows' completion indices, ascending."""
        groups = (active // self.group_size).tolist()
        out = torch.empty(len(groups), dtype=torch.float32)
        start = 0
        while start < len(groups):
            end = start
            while end < len(groups) and groups[end] == groups[start]:
                end += 1
            out[start:end] = torch.rand(end - start, generator=self.gens[groups[start]])
            start = end
        return out


def draw_from_logits(logits: torch.Tensor, generator, active: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-probability [B]) drawn from softmax(logits [B, V]) by inverse CDF: one
    uniform per row against the running sum of exp(logits - max). torch.multinomial draws an
    exponential per vocabulary entry (a sixth of a decode step at 49k tokens); this costs one exp and
    one cumsum, and no separate log_softmax pass. A token of probability 0 (-inf) is never drawn.
    `generator`: a torch.Generator (one stream for the batch) or GroupStreams (`active`: the rows'
    completion indices)."""
    logits = logits.float().cpu()
    top = logits.amax(-1, keepdim=True)  # the values alone: 35 vs 190 us at [16, 49152] on 2 threads
    cdf = (logits - top).exp_().cumsum_(-1)
    total = cdf[:, -1:]
    if isinstance(generator, GroupStreams):
        u = generator.uniform(active)[:, None].to(cdf.dtype) * total
    else:
        u = torch.rand(logits.shape[0], 1, generator=generator, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total after rounding
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1)
    chosen = logits.gather(1, tok[:, None])
    return tok, (chosen - top - total.log()).squeeze(1)


def decoder_for(model, dtype: torch.dtype = torch.float32):
    """(decoder, context): the fast Llama-family engine on the live tensors when it can run this model,
    else transformers' forward on the folded LoRA (and a `dtype` copy), which `context` sets up.
    RETROGRAD_SAMPLER=generic forces the generic path (for comparisons)."""
    from retrograd.rl.decoder import HFDecoder, LlamaDecoder, Unsupported
    if os.environ.get("RETROGRAD_SAMPLER", "") != "generic":
        try:
            return LlamaDecoder(model, dtype), nullcontext()
        except Unsupported:
            pass

    @contextmanager
    def generic():
        with lora_folded(model), sampling_copy(model, dtype) as m:
            yield HFDecoder(m)
    return None, generic()


@torch.no_grad()
def sample(model, prompts: list[list[int]], group_size: int, max_new_tokens: int, *, eos_ids: set[int],
           pad_id: int, generator: torch.Generator | None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           stop=None, dtype: torch.dtype | None = None, entropy: bool = False) -> Samples:
    """`stop(completion_ids) -> int | None`: optional stop-string check, returning how many tokens to keep.
    temperature = 0 decodes greedily (no generator needed). `entropy` also returns, per sampled token,
    the Shannon entropy of the distribution it was drawn from (temperature / top-k / top-p applied),
    from the step's [B, V] logits (one more pass over them; never a [B, T, V] copy). `dtype` is the precision of the big
    matmuls while sampling (see rl/decoder.py; default: bfloat16 for a bf16 model, else float32);
    the model itself is never changed."""
    param = next(model.parameters())
    _check_whole(model, param)
    if dtype is None:
        dtype = torch.bfloat16 if param.dtype == torch.bfloat16 else torch.float32
    was_training = model.training
    model.eval()
    try:
        fast, context = decoder_for(model, dtype)
        with context as generic:
            return _decode(fast or generic, prompts, group_size, max_new_tokens, eos_ids, pad_id, generator,
                           temperature, top_k, top_p, stop, param.device, entropy)
    finally:
        model.train(was_training)


def _check_whole(model, param) -> None:
    """Refuse to sample from a sharded (FSDP2) model's shards: its forwards would be collectives, one per
    decode step, which ranks decoding different numbers of steps never pair up."""
    from retrograd import dist
    if dist.is_sharded(model):
        from torch.distributed.tensor import DTensor
        if isinstance(param, DTensor):
            raise RuntimeError("sample(): the model's weights are sharded (FSDP2); sample inside "
                               "retrograd.rl.sampler.whole_weights(model), entered by every rank")


def _decode(decoder, prompts, group_size, max_new_tokens, eos_ids, pad_id, generator, temperature, top_k, top_p,
            stop, device, entropy=False) -> Samples:
    prefix, ids, attention, positions = split_prompts(prompts, pad_id, device)
    logits = decoder.prefill(ids, attention, positions, group_size, max_new_tokens, prefix=prefix)

    batch = len(prompts) * group_size
    tokens = torch.empty((batch, max_new_tokens), dtype=torch.long)
    logps = torch.empty((batch, max_new_tokens), dtype=torch.float32)
    entropies = torch.zeros((batch, max_new_tokens), dtype=torch.float32) if entropy else None
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    active = torch.arange(batch)  # the completion each row of the decoder's batch belongs to
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
    decoded = 0
    for t in range(max_new_tokens):
        if temperature == 0:  # greedy (evaluation): the most likely token, log-probability 0
            tok = logits.argmax(-1).cpu()
            logps[active, t] = 0.0
        else:
            filtered = filter_logits(logits, temperature, top_k, top_p)
            tok, logp = draw_from_logits(filtered, generator, active)
            logps[active, t] = logp
            if entropies is not None:
                entropies[active, t] = distribution_entropy(filtered).cpu()
        tokens[active, t] = tok
        decoded += len(active)
        finished = active[torch.isin(tok, eos)]
        lengths[finished], done[finished] = t + 1, True
        if stop is not None:
            for i in active[~done[active]].tolist():
                keep = stop(tokens[i, :t + 1].tolist())
                if keep is not None:
                    lengths[i], done[i] = keep, True
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        running = ~done[active]
        if not bool(running.all()):  # finished rows leave the batch: later steps are smaller
            rows = torch.nonzero(running).flatten()
            decoder.keep(rows.to(device))
            active, tok = active[rows], tok[rows]
        logits = decoder.step(tok.to(device))
    n = lengths.tolist()
    return Samples([i // group_size for i in range(batch)], [tokens[i, :n[i]].tolist() for i in range(batch)],
                   [logps[i, :n[i]].tolist() for i in range(batch)], (~done).tolist(), decoded,
                   [entropies[i, :n[i]].tolist() for i in range(batch)] if entropies is not None else None)
