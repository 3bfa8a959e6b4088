"""SFT examples: rows -> token ids + labels (-100 where no loss), and padded micro-batches.

Row formats (JSONL, one object per line):
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
  {"prompt": "text" | [messages], "completion": "text" | [messages]}
  {"text": "..."}                       (every token is trained)
A `.txt` file is one long text, cut into windows of `ctx` tokens; every token is trained.

Loss masks come from character spans: the conversation is rendered once with the model's chat
template, each assistant turn's span is found by rendering the conversation up to that turn, and
tokens whose first character falls in a span are trained. This works with any template whose
rendering of a prefix is a prefix of the full rendering (the check is explicit).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from retrograd.data.jsonl import read_jsonl
from retrograd.errors import DataError

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where no loss; otherwise equal to input_ids at that position
    where: str  # "file:line", for messages
    truncated: bool = False

    @property
    def n_targets(self) -> int:
        # a label at position t is predicted from position t-1, so position 0 never counts
        return sum(1 for lab in self.labels[1:] if lab != IGNORE)


def builtin_data_path(name: str) -> Path:
    """`builtin:chat-sft` -> the JSONL that ships inside the package."""
    files = resources.files("retrograd.data") / "builtin"
    stem = name.removeprefix("builtin:")
    candidate = files / f"{stem.replace('-', '_')}.jsonl"
    if not candidate.is_file():
        known = sorted(p.name.removesuffix(".jsonl").replace("_", "-") for p in files.iterdir()
                       if p.name.endswith(".jsonl"))
        raise DataError(f"unknown built-in dataset {name!r}; available: "
                        + ", ".join(f"builtin:{k}" for k in known))
    return Path(str(candidate))


def resolve_data_path(path: str) -> Path:
    p = builtin_data_path(path) if path.startswith("builtin:") else Path(path)
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    return p


def _messages(where: str, value, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{field}' must be a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: {field}[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {field}[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: {field}[{i}].content must be a string")
    return value


class Renderer:
    """Turns rows into Examples with one tokenizer, chat template and context length."""

    def __init__(self, tokenizer, ctx: int, assistant_only: bool = True, template_variables: dict | None = None):
        self.tok = tokenizer
        self.ctx = ctx
        self.assistant_only = assistant_only
        self.template_variables = dict(template_variables or {})
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("the tokenizer must be a fast (Rust) tokenizer to compute loss masks")

    def _template(self, messages, add_generation_prompt=False) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise DataError("the model's tokenizer has no chat template; use text rows "
                            '({"text": ...} or a .txt file) or prompt/completion strings')
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **self.template_variables)

    def _encode(self, text: str, spans: list[tuple[int, int]] | None, where: str) -> Example:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if spans is None:
            labels = list(ids)
        else:
            labels = [t if any(a <= s < b for a, b in spans) else IGNORE for t, (s, _e) in zip(ids, offsets)]
        truncated = len(ids) > self.ctx
        return Example(ids[: self.ctx], labels[: self.ctx], where, truncated)

    def chat(self, messages: list[dict], where: str, train_turns: set[int] | None = None) -> Example:
        """Render a conversation; train the assistant turns (or those in train_turns)."""
        full = self._template(messages)
        if not self.assistant_only:
            return self._encode(full, None, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or (train_turns is not None and i not in train_turns):
                continue
            before = self._template(messages[:i], add_generation_prompt=True) if i else ""
            upto = self._template(messages[: i + 1])
            if not (full.startswith(upto) and upto.startswith(before)):
                raise DataError(f"{where}: the chat template does not render turn {i} as a prefix of the "
                                "conversation, so the assistant span cannot be found; set "
                                "sft.assistant_only_loss = false to train on every token")
            spans.append((len(before), len(upto)))
        if not spans:
            raise DataError(f"{where}: no assistant turn to train on (sft.assistant_only_loss = true)")
        return self._encode(full, spans, where)

    def row(self, row: dict, where: str) -> Example:
        if "messages" in row:
            return self.chat(_messages(where, row["messages"], "messages"), where)
        if "prompt" in row or "completion" in row:
            for key in ("prompt", "completion"):
                if key not in row:
                    raise DataError(f"{where}: a prompt/completion row needs both 'prompt' and 'completion'")
            p, c = row["prompt"], row["completion"]
            if isinstance(p, str) and isinstance(c, str):
                text = p + c + (self.tok.eos_token or "")
                return self._encode(text, [(len(p), len(text))] if self.assistant_only else None, where)
            if isinstance(p, list) and isinstance(c, list):
                p, c = _messages(where, p, "prompt"), _messages(where, c, "completion")
                return self.chat(p + c, where, train_turns=set(range(len(p), len(p) + len(c))))
            raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both message lists")
        if "text" in row:
            if not isinstance(row["text"], str):
                raise DataError(f"{where}: 'text' must be a string")
            return self._encode(row["text"], None, where)
        raise DataError(f"{where}: a row needs 'messages', 'prompt' + 'completion', or 'text' "
                        f"(found keys: {', '.join(sorted(row)) or 'none'})")


def load_examples(path: str, data_format: str, renderer: Renderer) -> list[Example]:
    """Read and tokenize a whole dataset. Rows without a single trained token are an error."""
    p = resolve_data_path(path)
    fmt = data_format
    if fmt == "auto":
        fmt = "text" if p.suffix in (".txt", ".md") else "jsonl"
    if fmt == "text":
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        ids = renderer.tok(text, add_special_tokens=False)["input_ids"]
        ctx = renderer.ctx
        out = [Example(ids[i:i + ctx], ids[i:i + ctx], f"{p}:tokens {i}-{i + ctx}") for i in range(0, len(ids), ctx)]
        out = [e for e in out if len(e.input_ids) > 1]
    else:
        out = [renderer.row(row, f"{p}:{lineno}") for lineno, row in read_jsonl(p)]
    if not out:
        raise DataError(f"{p}: no examples")
    for e in out:
        if e.n_targets == 0:
            raise DataError(f"{e.where}: no trained token is left within training.ctx = {renderer.ctx} tokens; "
                            "raise ctx or shorten the row")
    return out


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch. attention_mask is None when nothing is padded (lets SDPA use its
    causal fast path)."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(examples), width), dtype=torch.long)  # [B, T]
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        attention[i, :n] = 1
    padded = bool((attention == 0).any())
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention if padded else None}


def split_by_tokens(examples: list[Example], max_tokens: int | None) -> list[list[Example]]:
    """Split a micro-batch into forward/backward passes of whole rows whose padded size
    (rows x longest row) stays within `max_tokens` (a row longer than that gets a pass alone).
    The summed loss, hence the update, is the same; peak activation memory scales with a pass."""
    if not max_tokens:
        return [examples]
    passes, current, width = [], [], 0
    for e in examples:
        w = max(width, len(e.input_ids))
        if current and w * (len(current) + 1) > max_tokens:
            passes.append(current)
            current, w = [], len(e.input_ids)
        current.append(e)
        width = w
    if current:
        passes.append(current)
    return passes
