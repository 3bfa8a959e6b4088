"""Generate the built-in preference dataset that ships inside the `retrograd` package.

Writes src/retrograd/data/builtin/chat_pref.jsonl (160 training pairs, seed 4321) and
chat_pref_eval.jsonl (48 held-out pairs, seed 8765, no question shared with training), from the
same six task families as the SFT data (scripts/make_builtin_data.py). Each row is
{"prompt": [user message], "chosen": [assistant], "rejected": [assistant]}:
  chosen    the correct answer in the house style ("Task: ...", working, "Answer: ...")
  rejected  half the time the same style with a wrong answer (a nearby number, a shuffled list,
            another capital), half the time a sloppy reply that hedges and gets it wrong.
Stdlib only, deterministic. Run:

    python3 scripts/make_builtin_pref_data.py
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_builtin_data import CAPITALS, FAMILIES, OUT  # noqa: E402

SLOPPY = ["Hmm, I think it's probably {a}, but I'm not sure.", "Good question! Maybe {a}?",
          "That's easy: {a}. Anyway, let me know if you need anything else!", "I believe the answer is {a}... or so."]


def wrong(ans, rng):
    """A plausible wrong answer of the same kind."""
    if isinstance(ans, int):
        v = ans + rng.choice([-10, -2, -1, 1, 2, 10])
        return v if v >= 0 else ans + 1
    if ans in CAPITALS.values():
        return rng.choice(sorted(set(CAPITALS.values()) - {ans}))
    if ", " in ans:
        items = ans.split(", ")
        while True:
            rng.shuffle(items)
            if ", ".join(items) != ans:
                return ", ".join(items)
    number, _, unit = ans.partition(" ")  # "12.4 miles"
    return f"{float(number) + rng.choice([-3, -1, 1, 3]):.1f} {unit}"


def make(n: int, seed: int, exclude: set[str]) -> list[dict]:
    rng = random.Random(seed)
    order = [FAMILIES[i % len(FAMILIES)] for i in range(n)]
    rng.shuffle(order)
    rows, seen = [], set(exclude)
    for fam in order:
        q, task, work, ans = fam(rng)
        while q in seen:
            q, task, work, ans = fam(rng)
        seen.add(q)
        head = [f"Task: {task}."] + ([work] if work else [])
        chosen = "\n".join(head + [f"Answer: {ans}"])
        bad = wrong(ans, rng)
        rejected = "\n".join(head + [f"Answer: {bad}"]) if rng.random() < 0.5 else rng.choice(SLOPPY).format(a=bad)
        rows.append({"prompt": [{"role": "user", "content": q}],
                     "chosen": [{"role": "assistant", "content": chosen}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def main() -> None:
    train = make(160, seed=4321, exclude=set())
    eval_ = make(48, seed=8765, exclude={r["prompt"][0]["content"] for r in train})
    for name, rows in [("chat_pref.jsonl", train), ("chat_pref_eval.jsonl", eval_)]:
        path = OUT / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8", newline="\n")
        print(f"wrote {path} ({len(rows)} rows, {path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
