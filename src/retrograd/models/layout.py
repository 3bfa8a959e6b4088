"""Where the tokens of a shared-prompt pass sit: the prompts' common prefix, packed completion rows, masks.

The scorer (models/logprobs.py) and the sampler's prefill (rl/sampler.py) lay out an update's prompts
and completions with these pure functions:

  shared_prefix_length   the prompts' common prefix worth running once for all of them
  split_prompts          prompts as (prefix, left-padded remainders, positions): positions count from
                         each prompt's first token whether or not its prefix runs apart, so sampling
                         and scoring give the model the same positions
  pack_completions       a prompt's completions side by side in rows of a given capacity
  prompts_lead_rows      whether each prompt's completions fill one row (the prompt then leads it)
  prompt_led_attention_mask / packed_attention_mask
                         the additive 4D masks of the two row layouts
"""
from __future__ import annotations

import torch

# a separate pass over the prompts' common prefix pays once it saves this many prompt tokens (those after
# the first prompt's) in the sampler's forward-only prefill; a scoring pass, which also runs backward
# through it, uses logprobs.MIN_SCORED_PREFIX_SAVING
MIN_SHARED_PREFIX_SAVING = 16
# packed rows' segment ids besides a completion's index: padding, and (prompt-led rows) the row's prompt
PADDING, PROMPT = -1, -2


def shared_prefix_length(prompts: list[list[int]], min_saving: int = MIN_SHARED_PREFIX_SAVING) -> int:
    """Tokens at the start of every prompt worth running once for all of them: the longest common
    prefix, leaving each prompt at least one token of its own (whose hidden state predicts the first
    completion token); 0 when one prompt or when sharing saves fewer than `min_saving` tokens."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    common = 0
    while common < n and all(p[common] == first[common] for p in prompts):
        common += 1
    return common if common * (len(prompts) - 1) >= min_saving else 0


def split_prompts(prompts: list[list[int]], pad_id: int, device=None, common: int | None = None):
    """Prompts as (prefix [c] or None, ids [P, W], attention [P, W], positions [P, W]): their shared
    prefix apart (`common` tokens, by default shared_prefix_length's), and what follows it left-padded
    so every prompt ends in the last column, at positions counted after the prefix."""
    if common is None:
        common = shared_prefix_length(prompts)
    rest = [p[common:] for p in prompts]
    width = max(len(p) for p in rest)
    ids = torch.full((len(rest), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rest), width), dtype=torch.long)
    for i, p in enumerate(rest):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    positions = common + (attention.cumsum(-1) - 1).clamp(min=0)
    prefix = torch.tensor(prompts[0][:common], device=device) if common else None
    return prefix, ids.to(device), attention.to(device), positions.to(device)


def pack_completions(owner: list[int], lengths: list[int], capacity: int) -> tuple[list, int]:
    """Completions (of prompts `owner`, `lengths` tokens each) laid side by side in rows of at most
    `capacity` tokens, a row holding one prompt's completions only (they share its KV cache):
    ([(prompt, [(completion, start column), ...]) per row], the longest row). Each prompt's
    completions go longest first into the first of its rows with room (first-fit decreasing)."""
    rows: list[tuple[int, list]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (owner[i], -lengths[i], i)):
        r = next((r for r in range(len(rows)) if rows[r][0] == owner[i] and used[r] + lengths[i] <= capacity), None)
        if r is None:
            rows.append((owner[i], []))
            used.append(0)
            r = len(rows) - 1
        rows[r][1].append((i, used[r]))
        used[r] += lengths[i]
    return rows, max(used)


def prompts_lead_rows(rows: list) -> bool:
    """Each prompt's completions fill one packed row (pack_completions' rows), so each prompt can lead its
    row in the completions' own pass, computed once."""
    owners = [o for o, _ in rows]
    return len(set(owners)) == len(owners)


def prompt_led_attention_mask(prefix: int, segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask [R, 1, W, prefix + W] of prompt-led rows: every token sees the `prefix` keys of
    the common prefix's cache; within its row (`segment` [R, W]: PROMPT, a completion's index, or PADDING),
    a prompt token sees the prompt up to itself, a completion token the prompt and its own completion up to
    itself, and padding the prompt (never a row of nothing)."""
    rows, w = segment.shape
    causal = torch.ones(w, w, dtype=torch.bool, device=segment.device).tril()
    query, key = segment[:, :, None], segment[:, None, :]
    own = (key == PROMPT) | ((query == key) & (query >= 0))
    allowed = torch.cat([torch.ones(rows, w, prefix, dtype=torch.bool, device=segment.device), own & causal], dim=2)
    return additive_mask(allowed, dtype)


def packed_attention_mask(prompt_keys: torch.Tensor, segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask [R, 1, W, K + W] of a packed completions pass: each token sees its row's
    prompt keys where `prompt_keys` [R, K] is true, and the tokens of its own completion up to itself
    (`segment` [R, W]: the completion of each column, -1 for padding, which sees the prompt only)."""
    w = segment.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=segment.device).tril()
    own = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0) & causal  # [R, W, W]
    allowed = torch.cat([prompt_keys[:, None, :].expand(-1, w, -1), own], dim=2)
    return additive_mask(allowed, dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean [R, Q, K] 'may attend' as the additive [R, 1, Q, K] mask (0 / dtype's min) the model's
    attention adds to its scores; SDPA and the eager attention both take it, where only SDPA takes booleans."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
