"""LLM judges as a reward source ([grpo.judge] / [ppo.judge]): what is asked, how replies become one
verdict in [0, 1] per completion, and what happens when the judge fails.

Modes (`mode`), each request asking for a JSON reply (sent as a JSON schema when the server takes
one, `structured_output`):
  pointwise  one request per completion: {"score": 0..10}; verdict = score / 10.
  listwise   one request per group and order: the G completions labelled R1..RG in a seeded
             permuted order, then the reverse of it, then further permutations,
             {"scores": [G integers 0..10]}; `listwise_orders` orders, averaged.
  pairwise   pairs of a group's completions ("A" / "B"), {"winner": "A" | "B" | "tie"}; with
             `both_orders` each pair is asked in both orders; verdict = the completion's win rate
             (a tie counts half). At most `max_pairs` pairs per group (seeded choice), else all.
Listwise and pairwise report `position_disagreement`: how much a verdict moved when only the order
of the completions changed (the judge's position bias).

A group whose requests fail (transport errors, timeouts or unreadable verdicts, after retries) is
judged failed: `judge_failure = "drop_group"` leaves the group out of the update (and the run stops
when more than `max_judge_dropped_fraction` of an update's groups fail); "fail" stops at the first
failure. The error names the request's group and the reason. Evaluation never calls the judge.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
from dataclasses import dataclass

import torch

from retrograd.errors import RetrogradError
from retrograd.rl.judge_client import JudgeClient, Reply

DEFAULT_RUBRIC = ("Judge how well the response answers the prompt: correct, complete, clear and concise. "
                  "Penalise wrong facts, missing parts and padding.")
SYSTEM = "You are a careful, impartial grader. You reply with JSON only."


class JudgeError(RetrogradError):
    pass


@dataclass
class Judgement:
    verdicts: torch.Tensor  # [N] float64 in [0, 1]; 0 where the group failed
    failed_groups: torch.Tensor  # [P] bool
    replies: list[Reply]  # every request's reply (judge_metrics reads them)
    spreads: list[float]  # per group, the verdicts' movement across orders (listwise / pairwise)


def _first_json_object(text: str):
    """The first {...} of a reply (models wrap JSON in prose or code fences)."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    m = re.search(r"\{.*\}", text, re.DOTALL)
    if not m:
        return None
    try:
        return json.loads(m.group(0))
    except ValueError:
        return None


def read_score(text: str) -> float | None:
    obj = _first_json_object(text)
    v = obj.get("score") if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 10:
        return None
    return float(v)


def read_scores(text: str, n: int) -> list[float] | None:
    obj = _first_json_object(text)
    v = obj.get("scores") if isinstance(obj, dict) else None
    if not isinstance(v, list) or len(v) != n:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 10 for x in v):
        return None
    return [float(x) for x in v]


def read_winner(text: str) -> str | None:
    obj = _first_json_object(text)
    v = obj.get("winner") if isinstance(obj, dict) else None
    return v if v in ("A", "B", "tie") else None


SCORE_SCHEMA = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 10}},
                "required": ["score"], "additionalProperties": False}
WINNER_SCHEMA = {"type": "object", "properties": {"winner": {"type": "string", "enum": ["A", "B", "tie"]}},
                 "required": ["winner"], "additionalProperties": False}


def scores_schema(n: int) -> dict:
    item = {"type": "integer", "minimum": 0, "maximum": 10}
    return {"type": "object", "properties": {"scores": {"type": "array", "items": item, "minItems": n, "maxItems": n}},
            "required": ["scores"], "additionalProperties": False}


# ---- the requests ----------------------------------------------------------------------------------
def pointwise_request(rubric: str, prompt: str, completion: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Rubric: {rubric}\n\n<prompt>\n{prompt}\n</prompt>\n\n<response>\n{completion}\n"
                                        "</response>\n\nScore the response against the rubric from 0 (worst) to 10 "
                                        '(best). Reply with JSON only: {"score": <integer 0-10>}'}]


def listwise_request(rubric: str, prompt: str, completions: list[str]) -> list[dict]:
    shown = "\n\n".join(f"<R{i + 1}>\n{c}\n</R{i + 1}>" for i, c in enumerate(completions))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Rubric: {rubric}\n\n<prompt>\n{prompt}\n</prompt>\n\n{len(completions)} "
                                        f"responses to this prompt:\n\n{shown}\n\nScore every response against the "
                                        "rubric from 0 (worst) to 10 (best), in the order R1, R2, ... Reply with JSON "
                                        'only: {"scores": [<integer 0-10>, ...]}'}]


def pairwise_request(rubric: str, prompt: str, a: str, b: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Rubric: {rubric}\n\n<prompt>\n{prompt}\n</prompt>\n\n<A>\n{a}\n</A>\n\n<B>\n{b}"
                                        "\n</B>\n\nWhich response satisfies the rubric better? Reply with JSON only: "
                                        '{"winner": "A" | "B" | "tie"}'}]


class Judge:
    """Scores groups of completions. `cfg`: the [grpo.judge] table (config/schema.JudgeTable)."""

    def __init__(self, cfg, *, weight: float, failure: str, max_dropped_fraction: float, seed: int):
        self.cfg, self.weight, self.failure, self.max_dropped = cfg, weight, failure, max_dropped_fraction
        self.seed = seed
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and key is None and cfg.api_key_env != "OPENAI_API_KEY":
            raise JudgeError(f"judge.api_key_env = {cfg.api_key_env!r}: that environment variable is not set")
        self.client = JudgeClient(cfg.base_url, cfg.model, api_key=key, timeout_s=cfg.timeout_seconds,
                                  max_retries=cfg.max_retries, max_concurrency=cfg.max_concurrency,
                                  temperature=cfg.temperature, max_tokens=cfg.max_tokens, cache_path=cfg.cache_path,
                                  structured_output=cfg.structured_output)

    def _rubric(self, row) -> str:
        r = row.columns.get("rubric") if hasattr(row, "columns") else None
        return r if isinstance(r, str) and r.strip() else (self.cfg.rubric or DEFAULT_RUBRIC)

    def group_scores(self, prompt: str, rubric: str, completions: list[str], salt: int, use_cache: bool = True):
        """(verdicts [G] in [0, 1] or None when the group failed, its replies, position disagreement or None)."""
        mode, G = self.cfg.mode, len(completions)
        if mode == "pointwise":
            replies = self.client.complete_all([(pointwise_request(rubric, prompt, c), SCORE_SCHEMA,
                                                 lambda t: read_score(t) is not None) for c in completions], use_cache)
            if any(r.text is None for r in replies):
                return None, replies, None
            return [read_score(r.text) / 10 for r in replies], replies, None
        rng = random.Random(self.seed * 1_000_003 + salt)
        if mode == "listwise":
            base = rng.sample(range(G), G)  # a seeded order, then its reverse (every position bias shows), then more
            orders = ([base, base[::-1]] + [rng.sample(range(G), G) for _ in range(self.cfg.listwise_orders - 2)]
                      )[:self.cfg.listwise_orders]
            replies = self.client.complete_all([(listwise_request(rubric, prompt, [completions[i] for i in o]),
                                                 scores_schema(G), lambda t: read_scores(t, G) is not None)
                                                for o in orders], use_cache)
            if any(r.text is None for r in replies):
                return None, replies, None
            per_order = []
            for o, r in zip(orders, replies):
                got = [0.0] * G
                for pos, i in enumerate(o):
                    got[i] = read_scores(r.text, G)[pos] / 10
                per_order.append(got)
            verdicts = [sum(s[i] for s in per_order) / len(per_order) for i in range(G)]
            spread = (sum(max(s[i] for s in per_order) - min(s[i] for s in per_order) for i in range(G)) / G
                      if len(per_order) > 1 else None)
            return verdicts, replies, spread
        pairs = list(itertools.combinations(range(G), 2))
        if self.cfg.max_pairs and len(pairs) > self.cfg.max_pairs:
            pairs = sorted(rng.sample(pairs, self.cfg.max_pairs))
        asked = pairs + ([(j, i) for i, j in pairs] if self.cfg.both_orders else [])
        replies = self.client.complete_all([(pairwise_request(rubric, prompt, completions[i], completions[j]),
                                             WINNER_SCHEMA, lambda t: read_winner(t) is not None) for i, j in asked],
                                           use_cache)
        if any(r.text is None for r in replies):
            return None, replies, None
        wins, games = [0.0] * G, [0] * G
        outcome = {}
        for (i, j), r in zip(asked, replies):
            w = read_winner(r.text)
            score_i = {"A": 1.0, "B": 0.0, "tie": 0.5}[w]  # i was shown as A
            outcome[(i, j)] = score_i
            wins[i] += score_i
            wins[j] += 1.0 - score_i
            games[i] += 1
            games[j] += 1
        verdicts = [wins[i] / games[i] if games[i] else 0.5 for i in range(G)]
        disagree = None
        if self.cfg.both_orders and pairs:  # the same pair, A/B swapped: consistent if i's result is unchanged
            disagree = sum(outcome[(i, j)] != 1.0 - outcome[(j, i)] for i, j in pairs) / len(pairs)
        return verdicts, replies, disagree

    def score(self, prompt_rows: list, texts: list[str], group_size: int, update: int) -> Judgement:
        """Verdicts for every completion of an update (group p owns texts[p*G:(p+1)*G])."""
        P, G = len(texts) // group_size, group_size
        verdicts = torch.zeros(len(texts), dtype=torch.float64)
        failed = torch.zeros(P, dtype=torch.bool)
        replies, spreads, errors = [], [], []
        for p in range(P):
            row = prompt_rows[p]
            v, rs, spread = self.group_scores(row.text, self._rubric(row), texts[p * G:(p + 1) * G],
                                              salt=update * 100_003 + p)
            replies += rs
            if v is None:
                failed[p] = True
                err = next(r.error for r in rs if r.text is None)
                errors.append(f"group {p + 1} of update {update + 1} (prompt {row.where or row.text[:60]!r}): {err}")
                if self.failure == "fail":
                    raise JudgeError(f"the judge failed on {errors[-1]} (judge_failure = \"fail\"; "
                                     "\"drop_group\" leaves such groups out instead)")
                continue
            verdicts[p * G:(p + 1) * G] = torch.tensor(v, dtype=torch.float64)
            if spread is not None:
                spreads.append(spread)
        dropped = float(failed.double().mean()) if P else 0.0
        if dropped > self.max_dropped:
            raise JudgeError(f"the judge failed on {int(failed.sum())} of {P} groups of update {update + 1}, more than "
                             f"max_judge_dropped_fraction = {self.max_dropped}; first: {errors[0]}")
        return Judgement(verdicts, failed, replies, spreads)


def judge_metrics(replies: list[Reply], verdicts: torch.Tensor, failed: torch.Tensor, G: int,
                  spreads: list[float]) -> dict:
    asked = [r for r in replies if not r.cached]
    judged = verdicts[~failed.repeat_interleave(G)] if len(failed) else verdicts
    arrived = sum(r.attempts for r in asked)
    m = {"judge/requests": len(replies), "judge/cache_hit_fraction": (len(replies) - len(asked)) / max(1, len(replies)),
         "judge/invalid_score_fraction": sum(r.invalid for r in asked) / max(1, arrived),
         "judge/failed_requests": sum(r.text is None for r in replies),
         "judge/dropped_group_fraction": float(failed.double().mean()) if len(failed) else 0.0,
         "judge/latency_seconds_mean": sum(r.latency_s for r in asked) / max(1, len(asked)),
         "judge/latency_seconds_max": max((r.latency_s for r in asked), default=0.0),
         "judge/score_mean": float(judged.mean()) if len(judged) else 0.0,
         "judge/score_std": float(judged.std()) if len(judged) > 1 else 0.0}
    if spreads:
        m["judge/position_disagreement"] = sum(spreads) / len(spreads)
    return m


def judge_from_config(table, *, seed: int, default_cache=None) -> Judge | None:
    """The Judge of a [grpo] / [ppo] table, or None without a [*.judge] table. Replies are cached in
    judge.cache_path, else in `default_cache` (the run folder's judge-cache.jsonl)."""
    if table.judge is None:
        return None
    cfg = table.judge
    if cfg.cache_path is None and default_cache is not None:
        cfg = dataclasses.replace(cfg, cache_path=str(default_cache))
    return Judge(cfg, weight=table.judge_weight, failure=table.judge_failure,
                 max_dropped_fraction=table.max_judge_dropped_fraction, seed=seed)
