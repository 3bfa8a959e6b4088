"""Rendering rows into tokens and loss masks, file:line errors, and the resumable order."""
import json

import pytest

from retrograd.data.sampler import epoch_order, evenly_spaced, steps_per_epoch
from retrograd.data.sft import IGNORE, Renderer, builtin_data_path, collate, load_examples
from retrograd.errors import DataError
from tiny import make_tokenizer


@pytest.fixture(scope="module")
def renderer():
    return Renderer(make_tokenizer(), ctx=256)


def trained_text(tok, ex):
    return tok.decode([t for t in ex.labels if t != IGNORE])


def test_assistant_only_mask(renderer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    ex = renderer.chat(msgs, "x:1")
    assert trained_text(renderer.tok, ex) == "yo<|im_end|>\nok<|im_end|>\n"
    assert renderer.tok.decode(ex.input_ids).startswith("<|im_start|>user\nhi")


def test_all_tokens_when_assistant_only_is_off():
    r = Renderer(make_tokenizer(), ctx=256, assistant_only=False)
    ex = r.chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "x:1")
    assert all(t != IGNORE for t in ex.labels)


def test_prompt_completion_rows(renderer):
    ex = renderer.row({"prompt": "2+2=", "completion": "4"}, "x:1")
    assert trained_text(renderer.tok, ex) == "4<|im_end|>"
    ex = renderer.row({"prompt": [{"role": "user", "content": "q"}],
                       "completion": [{"role": "assistant", "content": "a"}]}, "x:1")
    assert trained_text(renderer.tok, ex) == "a<|im_end|>\n"


def test_truncation_is_flagged(renderer):
    r = Renderer(renderer.tok, ctx=20)
    ex = r.chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y" * 50}], "x:1")
    assert ex.truncated and len(ex.input_ids) == 20


def test_jsonl_errors_name_file_and_line(tmp_path, renderer):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                 + "\n{not json\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        load_examples(str(p), "auto", renderer)
    p.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: messages\[0\] must be an object with 'role' and 'content'"):
        load_examples(str(p), "auto", renderer)
    p.write_text('\n{"question": "a"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: a row needs 'messages'"):
        load_examples(str(p), "auto", renderer)
    p.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: no assistant turn"):
        load_examples(str(p), "auto", renderer)
    with pytest.raises(DataError, match="data file not found"):
        load_examples(str(tmp_path / "missing.jsonl"), "auto", renderer)


def test_text_file_is_cut_into_ctx_windows(tmp_path):
    r = Renderer(make_tokenizer(), ctx=10, assistant_only=False)
    p = tmp_path / "book.txt"
    p.write_text("abcdefghij" * 3 + "xy")
    rows = load_examples(str(p), "auto", r)
    assert [len(e.input_ids) for e in rows] == [10, 10, 10, 2]


def test_collate_pads_right_and_drops_mask_when_not_needed(renderer):
    a = renderer.row({"text": "abc"}, "x:1")
    b = renderer.row({"text": "abcdef"}, "x:2")
    batch = collate([a, b], pad_id=0)
    assert batch["input_ids"].shape == (2, 6)
    assert batch["labels"][0, 3:].tolist() == [IGNORE] * 3
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0]
    assert collate([b, b], pad_id=0)["attention_mask"] is None


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(50, seed=7, epoch=0, shuffle=True)
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert a == epoch_order(50, seed=7, epoch=0, shuffle=True)
    assert a != epoch_order(50, seed=7, epoch=1, shuffle=True)
    assert epoch_order(5, 7, 0, shuffle=False) == [0, 1, 2, 3, 4]
    assert steps_per_epoch(10, 4) == 3
    assert evenly_spaced(10, 3) == [0, 3, 6] and evenly_spaced(3, None) == [0, 1, 2]


def test_builtin_dataset_names():
    with pytest.raises(DataError, match="unknown built-in dataset"):
        builtin_data_path("builtin:nope")


def test_split_by_tokens_keeps_whole_rows_within_the_budget():
    from retrograd.data.sft import Example, split_by_tokens
    rows = [Example([1] * n, [1] * n, f"x:{i}") for i, n in enumerate([100, 200, 250, 600, 50])]
    passes = split_by_tokens(rows, 512)
    assert [[len(e.input_ids) for e in p] for p in passes] == [[100, 200], [250], [600], [50]]
    assert split_by_tokens(rows, None) == [rows]
    assert [e for p in passes for e in p] == rows  # nothing lost, order kept
