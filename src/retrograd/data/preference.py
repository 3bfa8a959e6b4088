"""Preference pairs: JSONL rows -> (chosen, rejected) token sequences that share their prompt.

Row format (TRL's and retrograd-rs's):
  {"prompt": [messages] | "text", "chosen": [messages] | "text", "rejected": [messages] | "text"}
With a message-list prompt, a string response is one assistant message. Each side is rendered
with the chat template like an SFT prompt/completion row; only the response tokens are scored.

Refused with file:line: a missing or mistyped field, chosen identical to rejected, a pair whose two
sides do not start with the same prompt tokens (a tokenizer merging across the prompt/response
boundary would make the pair compare more than the responses), and a pair longer than
training.ctx (never truncated silently: that would score a different response).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrograd.data.jsonl import read_jsonl
from retrograd.data.sft import IGNORE, Example, Renderer, resolve_data_path
from retrograd.errors import DataError


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    where: str
    index: int = 0  # position in its file's pairs: the row of its cached reference scores

    @property
    def tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)


def prompt_length(e: Example) -> int:
    """Tokens before the first labelled one: the prompt, which both sides of a pair share."""
    return next(i for i, lab in enumerate(e.labels) if lab != IGNORE)


def _side(renderer: Renderer, prompt, response, where: str, key: str) -> Example:
    if isinstance(prompt, list) and isinstance(response, str):
        response = [{"role": "assistant", "content": response}]
    if isinstance(response, dict):
        response = [response]
    if not isinstance(response, (str, list)):
        raise DataError(f"{where}: '{key}' must be a string or a list of messages")
    try:
        return renderer.row({"prompt": prompt, "completion": response}, where)
    except DataError as e:
        raise DataError(str(e).replace("'completion'", f"'{key}'")) from None


def render_pair(renderer: Renderer, row: dict, where: str, index: int = 0) -> Pair:
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected'; missing "
                        f"{', '.join(repr(k) for k in missing)} (found keys: {', '.join(sorted(row)) or 'none'})")
    if row["chosen"] == row["rejected"]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are identical; the pair teaches nothing")
    chosen = _side(renderer, row["prompt"], row["chosen"], where, "chosen")
    rejected = _side(renderer, row["prompt"], row["rejected"], where, "rejected")
    for side, e in (("chosen", chosen), ("rejected", rejected)):
        if e.truncated:
            raise DataError(f"{where}: prompt + {side} is longer than training.ctx = {renderer.ctx} tokens; raise "
                            "ctx or shorten the pair (pairs are never truncated)")
        if e.n_targets == 0:
            raise DataError(f"{where}: the {side} response has no tokens")
    kc, kr = prompt_length(chosen), prompt_length(rejected)
    if chosen.input_ids[:kc] != rejected.input_ids[:kr]:
        raise DataError(f"{where}: the chosen and rejected sequences do not share the prompt token for token "
                        f"({kc} vs {kr} prompt tokens); the tokenizer merges text across the prompt/response "
                        "boundary, start the responses with a space or newline, or use message lists")
    return Pair(chosen, rejected, where, index)


def load_pairs(path: str, renderer: Renderer) -> list[Pair]:
    p = resolve_data_path(path)
    pairs = [render_pair(renderer, row, f"{p}:{lineno}", i) for i, (lineno, row) in enumerate(read_jsonl(p))]
    if not pairs:
        raise DataError(f"{p}: no preference pairs")
    return pairs


def flatten(pairs: list[Pair]) -> list[Example]:
    """[c0, r0, c1, r1, ...]: a pass always holds both sides of its pairs."""
    return [e for pair in pairs for e in (pair.chosen, pair.rejected)]


def split_pairs(pairs: list[Pair], max_tokens: int | None) -> list[list[Pair]]:
    """Passes of whole pairs whose padded size (2 x pairs x longest side) stays within max_tokens."""
    if not max_tokens:
        return [pairs]
    passes, current, width = [], [], 0
    for pair in pairs:
        w = max(width, len(pair.chosen.input_ids), len(pair.rejected.input_ids))
        if current and 2 * w * (len(current) + 1) > max_tokens:
            passes.append(current)
            current, w = [], max(len(pair.chosen.input_ids), len(pair.rejected.input_ids))
        current.append(pair)
        width = w
    if current:
        passes.append(current)
    return passes


def response_lengths(pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([p.chosen.n_targets for p in pairs], dtype=torch.float64),
            torch.tensor([p.rejected.n_targets for p in pairs], dtype=torch.float64))
