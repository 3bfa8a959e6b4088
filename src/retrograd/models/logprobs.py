"""Per-token scoring of a causal LM: what every training family and the service read from the model.

`Scorer(model)` runs the decoder and the LM head, through the fused chunked head
(models/fused_head.py: no [B, T, V] logits) when the head is a plain linear layer, else through the
model's own logits. One scorer, these readings:

  loss_sum(batch)            summed next-token cross-entropy of the labelled tokens (SFT)
  sequence_logprobs(batch)   [B] summed log-probabilities of each row's labelled tokens (preference)
  token_logprobs(batch, W)   [B, W] per-token log-probabilities of each row's completion (RL)
  shared_prompt_logprobs     the same [N, W], each prompt run once for all its completions and the
                             prompts' common prefix once for all prompts, through the KV cache (RL)
  shared_prompt_sums         [N] summed log-probabilities of chosen completion tokens, prompts shared
                             the same way (preference: a pair's chosen and rejected sides)
  target_logprobs(rows)      log p(target) per datum at every input position (the Tinker service)
  target_and_top1(batch)     log p(label) and whether it is the first choice, per labelled position (distill)
  compare(other, batch)      KL to another model and top-1 agreement at every labelled position (distill)

Padded passes run their real tokens only where the model allows it (models/packed.py: every layer but
attention on the [N] real tokens; a GRPO update's prompt-led rows are 12 % padding, SFT passes of rows of
different lengths right-padded); otherwise, and for unpadded passes, the model's own forward.

Where the tokens of a shared-prompt pass sit (the common prefix, packed rows, their masks) is
models/layout.py's.
"""
from __future__ import annotations

import torch

from retrograd.models.fused_head import (IGNORE, cross_entropy_sum_reference, linear_cross_entropy_sum,
                                         linear_token_logprobs, select_targets)
from retrograd.models.layout import (PADDING, PROMPT, additive_mask, pack_completions, packed_attention_mask,
                                     prompt_led_attention_mask, prompts_lead_rows, shared_prefix_length, split_prompts)
from retrograd.models.packed import PackedForward, grid_slots, packed_index, scatter_rows

# rows of logits alive at once in the fused head, nominally: 256 x 49k vocabulary x 4 B = 50 MB (1,024 rows
# cost ~250 MB more peak memory and were no faster); a call's chunks hold 0.75-1.5x this many rows
# (fused_head.even_chunk_rows), so at most 384 (75 MB)
CE_CHUNK_ROWS = 256
# configs that transform logits after the head; those models take the plain full-logits path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")
# a separate pass over the prompts' common prefix costs one more forward's fixed overhead; it pays once it
# saves this many prompt tokens (those after the first prompt's). The sampler's prefill runs forward only. A
# scoring pass also runs backward through it, at a few dozen rows per matmul. On SmolLM2 + LoRA on a 2-core
# CPU (interleaved A/Bs of a DPO step's and a GRPO update's scoring, benchmarks/ab_scoring_layout.py) the
# firm result is at a DPO step's 26 saved tokens: the prefix pass was slower in all three runs (by 1-10 %).
# From ~40 saved tokens the runs show no clear break-even (within -8 % ... +12 % either way), so 56 is a
# judgement that keeps the prefix in the rows where it is known to cost and splits it where it may pay
MIN_SCORED_PREFIX_SAVING = 56  # the sampler's forward-only prefill: layout.MIN_SHARED_PREFIX_SAVING
# a packed completions row holds up to this many tokens (or the longest completion, if longer): enough
# for a group of short RL completions in one row, short enough that attending across the row's other
# completions (masked, but computed) stays a small part of its cost
PACK_ROW_TOKENS = 256
# architectures whose forward on a KV cache was checked equal to one full row per completion
# (values and gradients: tests/unit/test_grpo_logprobs.py, test_preference_logprobs.py); others score one row per sequence
SHARED_PROMPT_MODELS = ("llama",)


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device) if v is not None else None) for k, v in batch.items()}


def base_and_decoder(model):
    """(the transformers model inside a PEFT wrapper, or the model itself; its decoder body)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base, getattr(base, base.base_model_prefix)


def datum_grid(rows: list[tuple[list[int], object]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input tokens, anything) per datum -> (ids [B, W], the attention mask [B, W], or None where no datum is
    padded): the datums right-padded to the longest."""
    width = max(len(tokens) for tokens, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (tokens, _) in enumerate(rows):
        ids[r, :len(tokens)] = torch.tensor(tokens)
        mask[r, :len(tokens)] = 1
    return ids, (mask if bool((mask == 0).any()) else None)


class Scorer:
    def __init__(self, model):
        base, self.decoder = base_and_decoder(model)
        self.head = base.get_output_embeddings()
        self.base = base
        plain_head = isinstance(self.head, torch.nn.Linear) and self.head.bias is None
        transforms = any(getattr(base.config, k, None) not in (None, 1.0) for k in _LOGIT_TRANSFORMS)
        # the head can run fused on the final hidden states (and hand those states to a value head)
        self.fusable = plain_head and not transforms
        from retrograd.dist import is_sharded
        self.sharded = is_sharded(base)
        # prompts may run once for all their completions (needs the fused head and a checked architecture)
        self.shares_prompts = (self.fusable and not self.sharded
                               and getattr(base.config, "model_type", None) in SHARED_PROMPT_MODELS)
        # padded passes run their real tokens only (models/packed.py), where the decoder allows it
        self.packer = PackedForward(self.decoder) if self.fusable and not self.sharded else None

    @property
    def fused(self) -> bool:
        """This call runs the fused head. A sharded (FSDP2) model gathers its weights inside its own forward
        only, so it scores through that forward, except inside dist.unsharded (the weights held whole)."""
        if not self.fusable:
            return False
        from retrograd.dist import is_whole
        return not self.sharded or is_whole(self.base)

    @property
    def packs(self) -> bool:
        """This pass runs its real tokens only, padding left out of every layer (models/packed.py)."""
        return self.packer is not None and self.packer.supported()

    # ---- the two forwards ------------------------------------------------------------------------
    def hidden(self, batch: dict) -> torch.Tensor:
        """[B, T, H] final hidden states; right-padded rows run packed (zeros at padding), where they can, and
        so do unpadded ones: there the grid is a view of the tokens, and the packed layers' RoPE and norms
        (models/lean_ops.py) run fewer kernels than transformers' forward (SmolLM2 fp32 on a 2-core Xeon,
        interleaved: 1.38 against 1.45 s for a [2, 256] LoRA pass forward + backward, 4.00 against 4.18 s
        for a [4, 256] pass training every weight)."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        packed = self._packed_pass(ids, attention)
        if packed is not None:
            h, slots = packed
            return scatter_rows(h, slots, *ids.shape)
        return self.decoder(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state  # [B, T, H]

    def real_hidden(self, ids: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        """[N, H] final hidden states of the real tokens of right-padded rows, one row after another (what
        hidden() holds at those positions). Where the pass packs, these are the packed forward's own states,
        with no [B, T, H] grid scattered and gathered back; else hidden()'s, read at the real positions."""
        packed = self._packed_pass(ids, attention)
        if packed is not None:
            return packed[0]  # slots run row by row, as the real tokens here
        h = self.hidden({"input_ids": ids, "attention_mask": attention})
        if attention is None:
            return h.reshape(-1, h.shape[-1])
        return h.reshape(-1, h.shape[-1]).index_select(0, grid_slots(attention.bool()))

    def _packed_pass(self, ids: torch.Tensor, attention: torch.Tensor | None):
        """(the real tokens' final hidden states [N, H], their grid slots [N]) through the packed forward, or
        None where this pass cannot pack (the model, or rows that are not right-padded)."""
        if not self.packs:
            return None
        rows, width = ids.shape
        columns = torch.arange(width, device=ids.device)
        if attention is None:
            real = torch.ones(rows, width, dtype=torch.bool, device=ids.device)
        else:
            real = attention.bool()
            if not torch.equal(real, columns[None] < real.sum(1, keepdim=True)):
                return None  # not right-padded: causal attention would not mask the padding
        h, slots, _ = self.packer.run(ids, columns.expand(rows, -1), real)
        return h, slots

    def logits(self, batch: dict) -> torch.Tensor:
        return self.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         use_cache=False).logits  # [B, T, V]

    def _shifted_logprobs(self, batch: dict) -> torch.Tensor:
        """Unfused path: [B, T-1] log p(labels[:, t+1]) from full logits (0 where unlabelled)."""
        labels = batch["labels"]
        lp = torch.log_softmax(self.logits(batch)[:, :-1].float(), -1)
        return lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1) * (labels[:, 1:] != IGNORE)

    # ---- readings --------------------------------------------------------------------------------
    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed next-token loss of the labelled tokens (a float32 scalar)."""
        if not self.fused:
            return cross_entropy_sum_reference(self.logits(batch), batch["labels"])
        h, y = select_targets(self.hidden(batch), batch["labels"])  # [N, H], [N]
        return linear_cross_entropy_sum(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)

    def sequence_logprobs(self, batch: dict) -> torch.Tensor:
        """[B] float32: each row's summed log-probability of its labelled (response) tokens."""
        labels = batch["labels"]
        if not self.fused:
            return self._shifted_logprobs(batch).sum(-1)
        keep = labels[:, 1:] != IGNORE
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(keep)[keep]
        h, y = select_targets(self.hidden(batch), labels)
        logp = linear_token_logprobs(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)  # [N]
        return torch.zeros(labels.shape[0], dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)

    def token_logprobs(self, batch: dict, width: int, states: bool = False, detach: bool = True):
        """[B, width]: log-probabilities of each row's labelled tokens, packed from column 0 (a
        completion's j-th token in column j), 0 beyond each row's count. With `states`, also the
        final hidden states that predicted them [B, width, H], detached unless `detach` is false (a
        value head's features; a critic model trains through them)."""
        labels = batch["labels"]
        keep = labels[:, 1:] != IGNORE  # [B, T-1]
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(keep)[keep]
        cols = (keep.cumsum(1) - 1)[keep]  # position within the completion
        if self.fused:
            h, y = select_targets(self.hidden(batch), labels)
            logp = linear_token_logprobs(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)
        else:
            if states:
                raise ValueError("hidden states are read from the fused head: it needs a plain linear LM head and, on a "
                                 "sharded model, the weights gathered whole (dist.unsharded)")
            logp = self._shifted_logprobs(batch)[keep]
        out = torch.zeros(labels.shape[0], width, dtype=logp.dtype, device=logp.device).index_put((rows, cols), logp)
        if not states:
            return out
        packed = h.new_zeros(labels.shape[0], width, h.shape[-1]).index_put((rows, cols), h.detach() if detach else h)
        return out, packed

    def shared_prompt_logprobs(self, prompts: list[list[int]], completions: list[list[int]], owner: list[int],
                               width: int, pad_id: int, states: bool = False):
        """The same [N, width] as `token_logprobs`, with each prompt run once for all its completions
        (completion i belongs to prompts[owner[i]]) and the prompts' common prefix (a chat template's
        system prompt) run once for all prompts. Three passes, each on the cache of the one before: the
        common prefix [1, c]; the prompts' remainders [P, *] left-padded; the completions [N, *]. Keys
        and values keep their graph when gathered for the next pass, so gradients reach every shared
        position and the result equals one row per completion (tested), at c + sum(P remainders) +
        completion tokens instead of N x (prompt + completion). Needs the fused head. With `states`, also
        the detached final hidden states that predicted each token [N, width, H]."""
        before, ids, keep = self._shared_prompt_hidden(prompts, completions, owner, pad_id)
        device = ids.device
        n, n_max = ids.shape
        logp = linear_token_logprobs(before, self.head.weight, ids[keep], chunk_size=CE_CHUNK_ROWS)
        r = torch.arange(n, device=device)[:, None].expand_as(keep)[keep]
        c = torch.arange(n_max, device=device)[None].expand_as(keep)[keep]
        out = torch.zeros(n, width, dtype=logp.dtype, device=device).index_put((r, c), logp)
        if not states:
            return out
        h = before.detach()
        return out, h.new_zeros(n, width, h.shape[-1]).index_put((r, c), h)

    def shared_prompt_sums(self, prompts: list[list[int]], completions: list[list[int]], owner: list[int],
                           scored: list[list[bool]], pad_id: int) -> torch.Tensor:
        """[N] float32: completion i's summed log-probability over its tokens where scored[i] is true,
        each prompt (and the prompts' common prefix) run once, as in `shared_prompt_logprobs`. Only the
        scored positions reach the head."""
        before, ids, keep = self._shared_prompt_hidden(prompts, completions, owner, pad_id)
        device = ids.device
        chosen = torch.zeros_like(keep)
        for i, mask in enumerate(scored):
            chosen[i, :len(mask)] = torch.tensor(mask, dtype=torch.bool, device=device)
        chosen &= keep
        logp = linear_token_logprobs(before[chosen[keep]], self.head.weight, ids[chosen], chunk_size=CE_CHUNK_ROWS)
        rows = torch.arange(ids.shape[0], device=device)[:, None].expand_as(chosen)[chosen]
        return torch.zeros(ids.shape[0], dtype=logp.dtype, device=device).index_add(0, rows, logp)

    def _shared_prompt_hidden(self, prompts, completions, owner, pad_id):
        """(before [M, H]: the final hidden state that predicts each completion token, completion by
        completion; ids [N, n_max] the completions right-padded; keep [N, n_max] where a token is, so
        that ids[keep] lines up with `before`).

        The completions run packed (pack_completions): a prompt's completions side by side in rows of
        up to max(longest, PACK_ROW_TOKENS) tokens, each attending to its prompt and causally to itself
        only (a 4D mask), at its own positions. Right-padding every completion to the longest instead
        cost ~22 % of a GRPO update's layer FLOPs (379 real of 512 tokens). The prompts' common prefix
        runs first, once, as the cache every row starts from, where that saves MIN_SCORED_PREFIX_SAVING
        tokens. When each prompt's completions fill one row (a DPO pair, a group of short RL
        completions), the prompt leads its row in the same pass (`_prompt_led_rows`); otherwise the
        prompts run in a pass of their own whose cache each of their rows gathers
        (`_cached_prompt_rows`), so no prompt is computed twice."""
        device = self.head.weight.device
        lengths = [len(c) for c in completions]
        n, n_max = len(completions), max(lengths)
        rows, _ = pack_completions(owner, lengths, max(n_max, PACK_ROW_TOKENS))
        common = shared_prefix_length(prompts, MIN_SCORED_PREFIX_SAVING)
        cache = self._prefix_pass(prompts[0][:common]) if common else None
        run = self._prompt_led_rows if prompts_lead_rows(rows) else self._cached_prompt_rows
        states, source = run(prompts, completions, rows, common, cache, pad_id)
        ids = torch.full((n, n_max), pad_id, dtype=torch.long, device=device)
        keep = torch.zeros((n, n_max), dtype=torch.bool, device=device)
        for i, c in enumerate(completions):
            ids[i, :len(c)] = torch.tensor(c, device=device)
            keep[i, :len(c)] = True
        return states[source.to(device)[keep]], ids, keep

    def _prefix_pass(self, prefix: list[int]):
        """The prompts' common prefix, once: its keys and values, per layer (packed: a list of (keys,
        values) [1, KV, c, D]; else transformers' cache)."""
        device, c = self.head.weight.device, len(prefix)
        ids, positions = torch.tensor(prefix, device=device), torch.arange(c, device=device)
        if self.packs:
            return self.packer.run(ids[None], positions[None], torch.ones(1, c, dtype=torch.bool, device=device),
                                   keep_kv=True)[2]
        return self.decoder(input_ids=ids[None], position_ids=positions[None], use_cache=True).past_key_values

    def _prompt_led_rows(self, prompts, completions, rows, common, cache, pad_id):
        """One pass over rows [prompt remainder | its completions side by side | padding], on the common
        prefix's cache. Saves the separate prompts pass: its fixed cost (a forward and a backward through
        every layer) and its matmuls at a few dozen rows, which ran at half the rate of the packed
        pass's on a 2-core CPU. -> (hidden states [R * W, H], source [N, n_max]: the state predicting
        each completion token)."""
        device = self.head.weight.device
        rest = [p[common:] for p in prompts]
        width = max(len(rest[o]) + sum(len(completions[i]) for i, _ in members) for o, members in rows)
        packed = torch.full((len(rows), width), pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        segment = torch.full((len(rows), width), PADDING, dtype=torch.long)
        source = torch.zeros((len(completions), max(len(c) for c in completions)), dtype=torch.long)
        for r, (o, members) in enumerate(rows):
            lp = len(rest[o])
            packed[r, :lp] = torch.tensor(rest[o])
            positions[r, :lp] = common + torch.arange(lp)
            segment[r, :lp] = PROMPT
            for i, at in members:
                k, start = len(completions[i]), lp + at
                packed[r, start:start + k] = torch.tensor(completions[i])
                positions[r, start:start + k] = common + lp + torch.arange(k)
                segment[r, start:start + k] = i
                source[i, 0] = r * width + lp - 1  # the prompt's last state predicts every first token
                source[i, 1:k] = r * width + start + torch.arange(k - 1)
        mask = prompt_led_attention_mask(common, segment.to(device), self.head.weight.dtype)
        if self.packs:  # the rows' padding left out; the prefix's keys expand to every row
            hidden, slots, _ = self.packer.run(packed.to(device), positions.to(device), segment.to(device) != PADDING,
                                               mask, past=cache)
            return hidden, packed_index(slots, len(rows) * width)[source.to(device)]
        if cache is not None:
            cache.reorder_cache(torch.zeros(len(rows), dtype=torch.long, device=device))  # differentiable
        hidden = self.decoder(input_ids=packed.to(device), attention_mask=mask, position_ids=positions.to(device),
                              past_key_values=cache, use_cache=False).last_hidden_state  # [R, W, H]
        return hidden.reshape(-1, hidden.shape[-1]), source

    def _cached_prompt_rows(self, prompts, completions, rows, common, cache, pad_id):
        """The prompts' remainders in a pass of their own ([P, *] left-padded, on the prefix's cache), then
        the packed completion rows, each gathering its prompt's keys and values. Keys and values keep
        their graph when gathered, so gradients reach every prompt position. -> as `_prompt_led_rows`."""
        device = self.head.weight.device
        _, ids_p, attention_p, positions_p = split_prompts(prompts, pad_id, device, common)
        row_owner = torch.tensor([r[0] for r in rows], device=device)
        prompt_keys = attention_p  # [P, K]: the keys a prompt's completions see (the prefix's, then its own)
        if cache is not None:
            prompt_keys = torch.cat([torch.ones_like(attention_p[:, :1]).expand(-1, common), attention_p], 1)
        if self.packs:
            last, cache = self._packed_prompts_pass(ids_p, attention_p, positions_p, cache, row_owner)
        else:
            if cache is not None:
                cache.reorder_cache(torch.zeros(len(prompts), dtype=torch.long, device=device))  # one row per prompt
            out = self.decoder(input_ids=ids_p, attention_mask=prompt_keys, position_ids=positions_p,
                               past_key_values=cache, use_cache=True)
            last = out.last_hidden_state[:, -1]  # [P, H]: predicts each prompt's completions' first token
            cache = out.past_key_values
            cache.reorder_cache(row_owner)  # index_select per layer: differentiable
        width = max(sum(len(completions[i]) for i, _ in members) for _, members in rows)
        packed = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
        positions = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        segment = torch.full((len(rows), width), PADDING, dtype=torch.long, device=device)
        source = torch.zeros((len(completions), max(len(c) for c in completions)), dtype=torch.long)
        for r, (o, members) in enumerate(rows):
            start = positions_p[o, -1].item() + 1
            for i, at in members:
                k = len(completions[i])
                packed[r, at:at + k] = torch.tensor(completions[i], device=device)
                positions[r, at:at + k] = torch.arange(start, start + k, device=device)
                segment[r, at:at + k] = i
                source[i, 0] = o  # the prompt's last state, then the completion's own states
                source[i, 1:k] = len(prompts) + r * width + at + torch.arange(k - 1)
        mask = packed_attention_mask(prompt_keys[row_owner].bool(), segment, self.head.weight.dtype)
        if self.packs:
            hidden, slots, _ = self.packer.run(packed, positions, segment >= 0, mask, past=cache)
            index = torch.cat([torch.arange(len(prompts), device=device),
                               len(prompts) + packed_index(slots, len(rows) * width)])
            return torch.cat([last, hidden]), index[source.to(device)]
        hidden = self.decoder(input_ids=packed, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=False).last_hidden_state  # [R, width, H]
        return torch.cat([last, hidden.reshape(-1, hidden.shape[-1])]), source

    def _packed_prompts_pass(self, ids, attention, positions, prefix, row_owner):
        """The prompts' pass of `_cached_prompt_rows`, packed: ([P, H] each prompt's last state, per layer
        (keys, values) [R, KV, c + W, D] of the prefix and each row's prompt). The prompts are left-padded:
        a token sees the prefix and its prompt up to itself, padding itself only (never a row of nothing)."""
        prompts, width = ids.shape
        real = attention.bool()
        own = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril() & real[:, None, :]
        own |= torch.eye(width, dtype=torch.bool, device=ids.device)
        common = 0 if prefix is None else prefix[0][0].shape[2]
        allowed = torch.cat([own.new_ones(prompts, width, common), own], dim=2)
        hidden, slots, kv = self.packer.run(ids, positions, real, additive_mask(allowed, self.head.weight.dtype),
                                            past=prefix, keep_kv=True)  # kv: the prefix's, then each prompt's
        last = hidden[packed_index(slots, prompts * width)[torch.arange(1, prompts + 1, device=ids.device) * width - 1]]
        return last, [(k[row_owner], v[row_owner]) for k, v in kv]

    def labelled_distributions(self, batch: dict, chunk: int = CE_CHUNK_ROWS):
        """Yield (float32 log-softmax [n, V], targets [n]) over the labelled positions, `chunk` rows at a
        time (the fused head never holds [B, T, V]; a model with logit transforms goes through its logits)."""
        if self.fused:
            h, y = select_targets(self.hidden(batch), batch["labels"])
            for s in range(0, h.shape[0], chunk):
                yield torch.log_softmax(h[s:s + chunk] @ self.head.weight.t(), -1, dtype=torch.float32), y[s:s + chunk]
            return
        keep = batch["labels"][:, 1:] != IGNORE
        logits, y = self.logits(batch)[:, :-1][keep], batch["labels"][:, 1:][keep]
        for s in range(0, logits.shape[0], chunk):
            yield torch.log_softmax(logits[s:s + chunk], -1, dtype=torch.float32), y[s:s + chunk]

    @torch.no_grad()
    def target_and_top1(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """At every labelled position: ([N] float32 log p(label), [N] bool: the label is the model's first choice)."""
        lp, top1 = [torch.zeros(0)], [torch.zeros(0, dtype=torch.bool)]
        for logp, y in self.labelled_distributions(batch):
            lp.append(logp.gather(-1, y[:, None]).squeeze(-1).cpu())
            top1.append((logp.argmax(-1) == y).cpu())
        return torch.cat(lp), torch.cat(top1)

    @torch.no_grad()
    def compare(self, other: "Scorer", batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """At every labelled position, this model against `other` over the whole vocabulary: ([N] float32
        KL(p_self || p_other), [N] bool: both put the same token first)."""
        kl, same = [torch.zeros(0)], [torch.zeros(0, dtype=torch.bool)]
        for (a, _), (b, _) in zip(self.labelled_distributions(batch), other.labelled_distributions(batch)):
            kl.append((a.exp() * (a - b.to(a.device))).sum(-1).cpu())
            same.append((a.argmax(-1) == b.to(a.device).argmax(-1)).cpu())
        return torch.cat(kl), torch.cat(same)

    def target_logprobs(self, rows: list[tuple[list[int], torch.Tensor]]) -> list[torch.Tensor]:
        """Tinker datums (input tokens, target_tokens [N] or [N, K]) -> log p(target) per datum: [N], or
        [N, K] for soft targets (their K log-probabilities at each position). One right-padded pass; the
        datums with one target a position share the fused head's chunks (CE_CHUNK_ROWS rows each) instead
        of one head call a datum: a thin call runs the [C, H] x [H, V] product below the matmul peak, and
        each datum's slice of a [B, T, H] grid cost its backward a [B, T, H] zero fill; the head reads its
        whole weight every call (113 MB for SmolLM2's). The same values up to float rounding: a row's
        log-softmax is its own. SmolLM2 fp32 LoRA forward + backward on a 2-core AVX-512 EPYC, interleaved
        (benchmarks/ab_target_logprobs.py): 64 datums of 8-24 tokens 4.06 against 5.60 s, 32 of 20-60 5.15
        against 5.83, 8 of 100-300 6.05 against 6.18; 4 of 255 (already one chunk each) 4.18 against 4.13."""
        lengths = [len(t) for t, _ in rows]
        every = self.real_hidden(*datum_grid(rows))  # [N, H], datum after datum
        states = every.split(lengths)
        out: list = [None] * len(rows)
        hard = [r for r, (_, targets) in enumerate(rows) if targets.ndim == 1]
        if hard:
            h = every if len(hard) == len(rows) else torch.cat([states[r] for r in hard])
            y = torch.cat([rows[r][1] for r in hard])
            lp = linear_token_logprobs(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)
            for r, part in zip(hard, lp.split([lengths[r] for r in hard])):
                out[r] = part
        for r, (_, targets) in enumerate(rows):
            if targets.ndim != 1:  # [N, K] soft targets: the K log-probs of each position
                out[r] = torch.log_softmax((states[r] @ self.head.weight.t()).float(), dim=-1).gather(1, targets)
        return out

    @torch.no_grad()
    def prompt_logprobs(self, prompt: list[int], topk: int = 0, last_n: int | None = None):
        """([n] log p(prompt[i] | prompt[:i]), NaN where unscored: position 0, and with `last_n` every
        position before the last n; optionally the top-k (ids [n, k], log-probs [n, k]) per position,
        unscored rows ids 0 / log-prob 0) as numpy arrays. Only the scored positions reach the head."""
        import numpy as np
        n = len(prompt)
        first = 1 if last_n is None else n - last_n  # the first scored position
        ids = torch.tensor([prompt])
        hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[0, first - 1:-1]
        logp = torch.log_softmax((hidden @ self.head.weight.t()).float(), dim=-1)  # [n - first, V]
        lp = logp.gather(1, ids[0, first:, None]).squeeze(1)
        values = np.concatenate([np.full(first, np.nan), lp.numpy()]).astype(np.float32)
        top = None
        if topk > 0:
            v, i = torch.topk(logp, topk, dim=-1)
            top = (np.concatenate([np.zeros((first, topk), np.int32), i.numpy().astype(np.int32)]),
                   np.concatenate([np.zeros((first, topk), np.float32), v.numpy()]))
        return values, top
