"""Planning-token detectors: the regex windows by hand and against a plain re-implementation;
the semantic detector with a fake embedder (no model)."""
import random
import re
import sys

import pytest
import torch

from retrograd.algorithms.planning import (EXECUTION_ANCHORS, PLANNING_ANCHORS, STRATEGIC_GRAMS, clean_token,
                                           regex_planning_mask, semantic_planning_mask,
                                           sentence_transformer_embedder, word_windows)


def test_grams_are_retrains_18():
    assert len(STRATEGIC_GRAMS) == 18 and len(set(STRATEGIC_GRAMS)) == 18
    assert {"wait let me", "let me check", "the key insight", "that's not right"} <= set(STRATEGIC_GRAMS)


def test_regex_by_hand():
    tokens = ["I", " wait", " let", " me", " check", " this", "."]
    # start 1: "wait let me" (tokens 1-3); start 2: "let me check" (2-4); not "I": a gram must begin
    # at the window's first token (retrain's search also marked the tokens before a gram)
    assert regex_planning_mask(tokens) == [False, True, True, True, True, False, False]
    assert regex_planning_mask(["wait", " let", " me", " check"]) == [True] * 4
    # "waiting" is not "wait": no whole-word match
    assert regex_planning_mask(["I", " am", " waiting", " let", " me", " go"]) == [False] * 6
    assert regex_planning_mask(["waiting", " for", " it"]) == [False] * 3
    # subword markers and case; "Let me check" spelled by SentencePiece pieces
    assert regex_planning_mask(["▁Let", "▁me", "▁check", "▁it"]) == [True, True, True, False]
    assert regex_planning_mask(["ĠDouble", "Ġcheck"]) == [True, True]
    # a word cut in two pieces is split by the space joining: "dou ble check" does not match
    assert regex_planning_mask(["dou", "ble", " check"]) == [False, False, False]
    assert regex_planning_mask([]) == []


def test_regex_marks_only_the_gram():
    # the tokens before and after a gram stay execution tokens
    tokens = [" x"] * 6 + [" let", " me", " think"] + [" y"] * 3
    assert regex_planning_mask(tokens) == [False] * 6 + [True] * 3 + [False] * 3


def test_regex_custom_grams_and_window():
    assert regex_planning_mask(["b", " c", " a"], ["b c"]) == [True, True, False]
    assert regex_planning_mask(["a", " b", " c"], ["b c"]) == [False, True, True]
    assert regex_planning_mask(["b", " c"], []) == [False, False]  # [] means the built-in grams
    # the window is 5 tokens (empty pieces count): a gram spread over 5 is found, over 6 not
    assert regex_planning_mask(["let", "", "", " me", " check"]) == [True] * 5
    assert regex_planning_mask(["let", "", "", "", " me", " check"]) == [False] * 6
    # a gram longer than 5 words widens the window
    assert regex_planning_mask(["a", "", "", "", "", " b c d e f"], ["a b c d e f"]) == [True] * 6


def test_regex_every_start_is_tried():
    # "let me think" and "let me check" overlap at "let me": each start finds its first match
    tokens = ["let", " me", " think", " let", " me", " check"]
    assert regex_planning_mask(tokens) == [True] * 6


def ref_regex(tokens, grams):
    words = max(5, max(len(g.split()) for g in grams))
    clean = [t.replace("▁", " ").replace("Ġ", " ").strip() for t in tokens]
    mask = [False] * len(tokens)
    for i in range(len(tokens)):
        for j in range(i, min(i + words, len(tokens))):
            text = " ".join(c for c in clean[i:j + 1] if c)
            if any(re.match(re.escape(g) + r"\b", text, re.IGNORECASE) for g in grams):
                for k in range(i, j + 1):
                    mask[k] = True
                break
    return mask


def test_regex_against_reference():
    rng = random.Random(0)
    vocab = ["wait", " let", " me", " check", " think", "ing", "▁Let", "Ġme", " the", " key", " is", " x", "=",
             " 3", "", " notice", " that", " double", " Check", " start", " over", "."]
    for _ in range(200):
        tokens = [rng.choice(vocab) for _ in range(rng.randint(0, 25))]
        assert regex_planning_mask(tokens) == ref_regex(tokens, list(STRATEGIC_GRAMS))
        assert regex_planning_mask(tokens, ["x = 3", "is"]) == ref_regex(tokens, ["x = 3", "is"])


def test_clean_token():
    assert clean_token("▁Hello") == "Hello" and clean_token("Ġworld ") == "world" and clean_token("▁") == ""


# -- semantic ---------------------------------------------------------------------------------

def fake_embed(texts):
    """Planning anchors -> e0, execution anchors -> e1, windows -> e0 when they say PLAN, else a
    vector leaning to execution; it counts its calls."""
    fake_embed.calls += 1
    out = []
    for t in texts:
        if t in PLANNING_ANCHORS or "PLAN" in t.split():
            out.append([3.0, 0.0, 0.0])
        elif t in EXECUTION_ANCHORS:
            out.append([0.0, 2.0, 0.0])
        else:
            out.append([0.2, 1.0, 0.5])
    return torch.tensor(out)


fake_embed.calls = 0


def test_word_windows_by_hand():
    tokens = [f" w{i}" for i in range(20)]
    texts, spans = word_windows(tokens)
    assert spans == [(0, 12), (6, 18), (12, 20)]
    assert texts[2] == " ".join(f"w{i}" for i in range(12, 20))
    # two words per token: spans are token ranges
    texts, spans = word_windows(["a b", " c d", " e f"], words=3, stride=2)
    assert texts == ["a b c", "c d e", "e f"] and spans == [(0, 2), (1, 3), (2, 3)]
    assert word_windows(["▁only", "▁two"]) == ([], [])


def test_semantic_by_hand():
    tokens = [f" w{i}" for i in range(20)]
    tokens[15] = " PLAN"
    # word 15 lies in windows [6, 18) and [12, 20): tokens 6..19
    assert semantic_planning_mask(tokens, fake_embed) == [False] * 6 + [True] * 14
    assert semantic_planning_mask([f" w{i}" for i in range(20)], fake_embed) == [False] * 20
    # a margin larger than any difference: nothing
    assert semantic_planning_mask(tokens, fake_embed, threshold=1.5) == [False] * 20
    assert semantic_planning_mask(["a", "b"], fake_embed) == [False, False]


def test_semantic_centroids_are_cached_per_embedder():
    def embed(texts):
        embed.calls += 1
        return fake_embed(texts)
    embed.calls = 0
    semantic_planning_mask([" a"] * 5, embed)
    semantic_planning_mask([" b"] * 5, embed)
    assert embed.calls == 4  # the two anchor sets once, then one call per completion


def test_embedder_hint_without_sentence_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'retrograd\[semantic\]'"):
        sentence_transformer_embedder("all-MiniLM-L6-v2")
