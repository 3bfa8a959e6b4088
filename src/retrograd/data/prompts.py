"""Prompts for RL: JSONL rows -> prompt token ids + the row's other fields (the reward's columns).

Row formats:
  {"messages": [..., {"role": "user", "content": ...}], "answer": ..., ...}   must end on a user turn
  {"prompt": [messages] | "text", "answer": ..., ...}
Message prompts are rendered with the chat template and the assistant generation prompt; a text
prompt is used as it is. Rewards receive the last user message as `prompt` and every other field
of the row as a column (TRL's convention).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from retrograd.data.jsonl import read_jsonl
from retrograd.data.sft import _messages, resolve_data_path
from retrograd.errors import DataError


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # the last user message (what a reward sees as the prompt)
    columns: dict = field(default_factory=dict)
    where: str = ""


def render_prompt(tok, row: dict, where: str, ctx: int, max_new_tokens: int, template_variables: dict,
                  cut_answers: bool = False) -> Prompt:
    if "messages" in row:
        messages, key = _messages(where, row["messages"], "messages"), "messages"
    elif "prompt" in row:
        messages, key = row["prompt"], "prompt"
        if isinstance(messages, list):
            messages = _messages(where, messages, "prompt")
        elif not isinstance(messages, str):
            raise DataError(f"{where}: 'prompt' must be a string or a list of messages")
    else:
        raise DataError(f"{where}: a prompt row needs 'messages' or 'prompt' (found keys: {', '.join(sorted(row))})")
    if isinstance(messages, str):
        ids, text = tok(messages, add_special_tokens=False)["input_ids"], messages
    else:
        if cut_answers:  # an SFT row: the prompt is everything before its final assistant turn(s)
            while messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not messages:
                raise DataError(f"{where}: the row has no turn before its assistant answer")
        if messages[-1]["role"] != "user":
            raise DataError(f"{where}: the prompt must end on a user turn (it ends on {messages[-1]['role']!r})")
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_variables)
        ids, text = tok(rendered, add_special_tokens=False)["input_ids"], messages[-1]["content"]
    if len(ids) + max_new_tokens > ctx:
        raise DataError(f"{where}: the prompt has {len(ids)} tokens; with max_new_tokens = {max_new_tokens} it "
                        f"exceeds training.ctx = {ctx}")
    return Prompt(ids, text, {k: v for k, v in row.items() if k != key}, where)


def load_prompts(path: str, tok, ctx: int, max_new_tokens: int, template_variables: dict | None = None,
                 cut_answers: bool = False) -> list[Prompt]:
    """`cut_answers`: chat rows may end on assistant turns, which are left out (distillation reads SFT data;
    the student writes its own answer)."""
    p = resolve_data_path(path)
    out = [render_prompt(tok, row, f"{p}:{n}", ctx, max_new_tokens, template_variables or {}, cut_answers)
           for n, row in read_jsonl(p)]
    if not out:
        raise DataError(f"{p}: no prompts")
    keys = set(out[0].columns)
    for pr in out:
        if set(pr.columns) != keys:
            raise DataError(f"{pr.where}: fields {sorted(pr.columns)} differ from the first row's {sorted(keys)}; "
                            "every row must carry the same reward columns")
    return out
