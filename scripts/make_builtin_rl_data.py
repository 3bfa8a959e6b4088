"""Generate the built-in verifiable-reward prompts that ship inside the `retrograd` package.

  arithmetic.jsonl / arithmetic_eval.jsonl (400 / 64 prompts, seeds 11 / 12): "What is a + b?"
      with +, - and x on small numbers, "Reply with only the number.", and the exact `answer`.
  gsm_small.jsonl / gsm_small_eval.jsonl (240 / 48 prompts, seeds 21 / 22): GSM8K-style word
      problems of two or three steps from templates, with the exact integer `answer`.
No prompt of an eval file appears in its training file. Every row is
{"prompt": [{"role": "user", "content": ...}], "answer": <int>}; rewards read `answer`.
Stdlib only, deterministic. Run:

    python3 scripts/make_builtin_rl_data.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "retrograd" / "data" / "builtin"
NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Ivy", "Sam", "Nina", "Ben", "Lena", "Raj", "Tom", "Ana"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards", "shells", "stamps"]


def arithmetic(rng):
    op = rng.choice(["+", "+", "-", "x"])
    if op == "+":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"What is {a} + {b}?", a + b
    if op == "-":
        a = rng.randint(10, 99)
        b = rng.randint(1, a)
        return f"What is {a} - {b}?", a - b
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"What is {a} x {b}?", a * b


def word_problem(rng):
    n, m, it = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b, c = rng.randint(5, 40), rng.randint(2, 30), rng.randint(1, 20)
        c = min(c, a + b)
        return (f"{n} has {a} {it}. {n} buys {b} more and then gives {c} to {m}. "
                f"How many {it} does {n} have now?", a + b - c)
    if kind == 1:
        boxes, per, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 15)
        return (f"{n} has {boxes} boxes with {per} {it} in each box, and {extra} loose {it}. "
                f"How many {it} does {n} have in total?", boxes * per + extra)
    if kind == 2:
        per, friends = rng.randint(2, 9), rng.randint(2, 8)
        left = rng.randint(0, per - 1)
        total = per * friends + left
        return (f"{n} shares {total} {it} equally among {friends} friends and keeps what is left over. "
                f"How many {it} does each friend get?", per)
    if kind == 3:
        price, qty, paid = rng.randint(2, 15), rng.randint(2, 6), 0
        paid = price * qty + rng.randint(0, 20)
        return (f"One notebook costs {price} dollars. {n} buys {qty} notebooks and pays with {paid} dollars. "
                f"How much change does {n} get, in dollars?", paid - price * qty)
    a, b = rng.randint(3, 30), rng.randint(3, 30)
    return (f"{n} collected {a} {it} on Monday and twice as many on Tuesday. {m} collected {b} {it}. "
            f"How many {it} did they collect together?", a + 2 * a + b)


def make(fn, n: int, seed: int, suffix: str, exclude: set[str]) -> list[dict]:
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        q, ans = fn(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"prompt": [{"role": "user", "content": f"{q} {suffix}"}], "answer": ans})
    return rows


def write(name: str, rows: list[dict]) -> None:
    path = OUT / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8", newline="\n")
    print(f"wrote {path} ({len(rows)} rows)")


def main() -> None:
    only = "Reply with only the number."
    gsm = "Think briefly, then end with 'Answer: <number>'."
    a_eval = make(arithmetic, 64, 12, only, set())
    write("arithmetic_eval.jsonl", a_eval)
    write("arithmetic.jsonl", make(arithmetic, 400, 11, only, {r["prompt"][0]["content"].rsplit("?", 1)[0] + "?"
                                                                  for r in a_eval}))
    g_eval = make(word_problem, 48, 22, gsm, set())
    write("gsm_small_eval.jsonl", g_eval)
    write("gsm_small.jsonl", make(word_problem, 240, 21, gsm, {r["prompt"][0]["content"].rsplit("?", 1)[0] + "?"
                                                                for r in g_eval}))


if __name__ == "__main__":
    main()
