"""Planning-token detection: which completion tokens are "strategic" (re-planning, checking,
changing approach) rather than execution. HICRA amplifies them, SEPA leaves them alone.

Two detectors, both on the decoded token strings of one completion, returning one bool per token:

  regex     the tokens that spell one of the strategic grams as whole words
            (retrain's default detector, the same 18 grams)
  semantic  12-word windows embedded and compared with a planning and an execution centroid;
            the embedder is injected (`embed(list[str]) -> [n, d]`), so tests need no model.

Owns no tensors beyond the embeddings; the training loop turns the lists into the [N, T] mask.
"""
from __future__ import annotations

import re
import weakref
from typing import Callable

import torch

STRATEGIC_GRAMS = (
    "wait let me", "let me think", "on second thought", "let me check", "let me verify",
    "is this right", "double check", "try another approach", "go back and", "start over",
    "that's not right", "that doesn't work", "another way to", "or we could", "what if we",
    "notice that", "the key is", "the key insight",
)

MIN_WINDOW_TOKENS = 5
_SUBWORD_MARKERS = re.compile("[\u2581\u0120]")  # SentencePiece "▁", byte-level BPE "Ġ"


def clean_token(token: str) -> str:
    """A tokenizer piece as plain text: subword markers become spaces, then stripped."""
    return _SUBWORD_MARKERS.sub(" ", token).strip()


def _gram_pattern(grams: tuple[str, ...]) -> re.Pattern:
    """A gram at the very start of the window's text, ending on a word boundary."""
    return re.compile(r"^(?:" + "|".join(re.escape(g) for g in grams) + r")\b", re.IGNORECASE)


def regex_planning_mask(token_strings: list[str], grams: list[str] | None = None) -> list[bool]:
    """Mark the tokens that spell a strategic gram.

    For each start token, the window grows one token at a time (up to max(5, longest gram in
    words) tokens), the cleaned pieces joined by single spaces; the first window whose text is a
    gram as whole words (case-insensitive) marks its tokens start..end. Unlike retrain, the gram
    must begin at the window's first token: retrain searches anywhere in the window, which also
    marks up to 4 execution tokens before every gram (its intent is the gram's own tokens).
    Joining with spaces splits words that a tokenizer cut into pieces, as retrain does.
    `grams` None or empty means the built-in STRATEGIC_GRAMS (an empty config list means "the
    defaults")."""
    grams = tuple(grams) if grams else STRATEGIC_GRAMS
    n = len(token_strings)
    mask = [False] * n
    if n == 0:
        return mask
    pattern = _gram_pattern(grams)
    width = max(MIN_WINDOW_TOKENS, max(len(g.split()) for g in grams))
    cleaned = [clean_token(t) for t in token_strings]
    for start in range(n):
        text = ""
        for end in range(start, min(start + width, n)):
            if cleaned[end]:
                text = f"{text} {cleaned[end]}" if text else cleaned[end]
            if pattern.match(text):
                mask[start:end + 1] = [True] * (end + 1 - start)
                break
    return mask


# -- semantic detector -----------------------------------------------------------------------

# Our own anchor phrases (math-flavoured, like the rollouts the detector sees). What matters is
# the contrast: planning = deciding what to do or doubting what was done; execution = doing it.
PLANNING_ANCHORS = (
    "hold on, I should rethink how to attack this",
    "that result looks wrong, let me redo it",
    "I think I slipped up in the last step",
    "before moving on I will confirm this answer",
    "maybe a different method would be easier here",
    "the main trick is to notice the symmetry",
    "observe that the expression factors nicely",
    "we could substitute to make this simpler",
    "it helps to first look at a smaller case",
    "rather than brute force, let us find a pattern",
    "what happens if we consider the complement",
    "the strategy will be to bound it from both sides",
    "first I need to understand what is being asked",
    "let me set up the problem before computing",
    "our goal is to express everything in one variable",
    "so the plan is to find x and then plug it in",
    "is this really correct, let me double check",
    "starting over with a cleaner approach",
)
EXECUTION_ANCHORS = (
    "plugging x = 3 into the equation gives",
    "expanding the product we get x squared plus 5x plus 6",
    "dividing numerator and denominator by 4",
    "so the final answer is 12",
    "adding 7 and 9 gives 16",
    "pulling out a common factor of 2",
    "the derivative of 3x cubed is 9x squared",
    "using the quadratic formula the roots are",
    "multiplying both sides of the equation by 3",
    "hence x equals 5",
    "the area is one half times base times height",
    "summing the terms gives 45",
    "substituting these values yields 20",
    "moving all terms to the left side",
)
MIN_PLANNING_SIMILARITY = 0.25  # a window must also look like planning in absolute terms

# embedder -> (planning centroid, execution centroid): the anchors are embedded once per embedder
_centroid_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def _centroids(embed: Callable[[list[str]], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit planning and execution centroids [d], [d] (cached per embedder)."""
    try:
        return _centroid_cache[embed]
    except (KeyError, TypeError):
        pass
    plan = _unit(_unit(torch.as_tensor(embed(list(PLANNING_ANCHORS))).double()).mean(0))
    execution = _unit(_unit(torch.as_tensor(embed(list(EXECUTION_ANCHORS))).double()).mean(0))
    try:
        _centroid_cache[embed] = (plan, execution)
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return plan, execution


def word_windows(token_strings: list[str], words: int = 12,
                 stride: int = 6) -> tuple[list[str], list[tuple[int, int]]]:
    """Overlapping windows of `words` words every `stride` words, with the token span [start, end)
    each covers. Fewer than 3 words in the completion: no windows."""
    flat: list[str] = []
    owner: list[int] = []  # word index -> token index
    for i, token in enumerate(token_strings):
        for w in clean_token(token).split():
            flat.append(w)
            owner.append(i)
    if len(flat) < 3:
        return [], []
    texts, spans = [], []
    start = 0
    while True:
        end = min(start + words, len(flat))
        texts.append(" ".join(flat[start:end]))
        spans.append((owner[start], owner[end - 1] + 1))
        if end >= len(flat):
            break
        start += stride
    return texts, spans


def semantic_planning_mask(token_strings: list[str], embed: Callable[[list[str]], torch.Tensor],
                           threshold: float = 0.02) -> list[bool]:
    """Mark the tokens of every window that sits closer to the planning centroid than to the
    execution one by more than `threshold` (cosine) and has cosine > 0.25 to planning."""
    mask = [False] * len(token_strings)
    texts, spans = word_windows(token_strings)
    if not texts:
        return mask
    plan, execution = _centroids(embed)
    emb = _unit(torch.as_tensor(embed(texts)).double())  # [n_windows, d]
    sim_plan, sim_exec = emb @ plan, emb @ execution  # [n_windows]
    chosen = (sim_plan > sim_exec + threshold) & (sim_plan > MIN_PLANNING_SIMILARITY)
    for (start, end), yes in zip(spans, chosen.tolist()):
        if yes:
            mask[start:end] = [True] * (end - start)
    return mask


def sentence_transformer_embedder(model_name: str = "all-MiniLM-L6-v2") -> Callable[[list[str]], torch.Tensor]:
    """`embed(texts) -> [n, d]` backed by sentence-transformers (imported only here)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ImportError(f"the semantic planning detector needs sentence-transformers ({e}); "
                          "install it with: pip install 'retrograd[semantic]'") from None
    model = SentenceTransformer(model_name)

    def embed(texts: list[str]) -> torch.Tensor:
        out = model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True, batch_size=256)
        return torch.from_numpy(out).double()

    return embed
