"""Generate the built-in chat SFT dataset that ships inside the `retrograd` package.

Writes src/retrograd/data/builtin/chat_sft.jsonl (320 training rows, seed 1234) and
chat_sft_eval.jsonl (48 held-out rows, seed 5678, no user question shared with training).
Each row is {"messages": [...]}: user + assistant, about 20% with a system message first.
Six template families with random parameters: arithmetic word problems, unit conversions
(km/miles, C/F), alphabetical sorting, counting a letter, reversing a list, capital cities.
All results are computed here. Replies share one house style: "Task: <restated task>.", an
optional working line, then "Answer: <result>". Stdlib only, deterministic. Run:

    python3 scripts/make_builtin_data.py
"""
from __future__ import annotations

import json
import random
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "retrograd" / "data" / "builtin"

SYSTEMS = ["You are a concise assistant.", "You are a helpful assistant. Keep answers short.",
           "Answer carefully and briefly.", "You are a precise tutor."]
NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Ivy", "Sam", "Nina", "Ben", "Lena", "Raj"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards", "shells"]
WORDS = ("apple river candle zebra mango tiger piano cloud lemon forest rocket violet garden "
         "honey island jacket kettle ladder mirror needle orange pepper quilt saddle tunnel "
         "umbrella velvet walnut yogurt anchor bridge castle dragon engine falcon guitar "
         "harbor igloo jungle koala meadow noodle otter pillow raven silver turnip wagon").split()
LONG_WORDS = ("strawberry banana mississippi committee balloon letter bookkeeper coffee "
              "engineer pepper library assessment parallel tomorrow happiness grammar "
              "raspberry elephant cinnamon bottle success mammal accommodate dinosaur").split()
REV_POOLS = [[str(n) for n in range(1, 100)],
             "red blue green yellow purple orange black white pink brown".split(),
             "cat dog horse sheep goat rabbit mouse duck owl fox".split()]
CAPITALS = {  # 40 well-known, uncontested capitals
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "the United Kingdom": "London", "Ireland": "Dublin",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Austria": "Vienna", "Greece": "Athens", "Hungary": "Budapest",
    "Belgium": "Brussels", "Russia": "Moscow", "Turkey": "Ankara", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Morocco": "Rabat", "Ghana": "Accra",
    "Ethiopia": "Addis Ababa", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "South Korea": "Seoul", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Canada": "Ottawa",
    "the United States": "Washington, D.C.", "Mexico": "Mexico City", "Brazil": "Brasília",
    "Argentina": "Buenos Aires", "Peru": "Lima", "Australia": "Canberra",
    "New Zealand": "Wellington", "Iran": "Tehran", "Saudi Arabia": "Riyadh",
}
assert len(CAPITALS) == 40


def r1(x: Decimal) -> str:  # round half up to one decimal
    return str(x.quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def arithmetic(rng):
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul", "div", "two"])
    if kind == "add":
        a, b = rng.randint(5, 60), rng.randint(3, 40)
        q = f"{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?"
        return q, f"add {b} to {a}", f"{a} + {b} = {a + b}", a + b
    if kind == "sub":
        a = rng.randint(15, 90); b = rng.randint(2, a - 1)
        q = f"{n} had {a} {it} and gave away {b}. How many {it} are left?"
        return q, f"subtract {b} from {a}", f"{a} - {b} = {a - b}", a - b
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = f"{n} buys {a} boxes with {b} {it} in each box. How many {it} is that in total?"
        return q, f"multiply {a} by {b}", f"{a} × {b} = {a * b}", a * b
    if kind == "div":
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        q = f"{n} shares {a * b} {it} equally among {b} friends. How many {it} does each friend get?"
        return q, f"divide {a * b} by {b}", f"{a * b} ÷ {b} = {a}", a
    a, b = rng.randint(10, 50), rng.randint(3, 30); c = rng.randint(2, a + b - 1)
    q = f"{n} has {a} {it}, buys {b} more, then gives away {c}. How many {it} does {n} have?"
    return q, f"add {b} to {a}, then subtract {c}", f"{a} + {b} - {c} = {a + b - c}", a + b - c


def conversion(rng):
    kind = rng.choice(["km", "mi", "c", "f"])
    if kind == "km":
        x = rng.randint(1, 200); v = x * Decimal("0.621371")
        q = rng.choice([f"Convert {x} km to miles.", f"How many miles is {x} kilometers?"])
        return q, f"convert {x} km to miles", f"{x} × 0.621371 = {v.normalize():f}", f"{r1(v)} miles"
    if kind == "mi":
        x = rng.randint(1, 150); v = x * Decimal("1.609344")
        q = rng.choice([f"Convert {x} miles to km.", f"How many kilometers is {x} miles?"])
        return q, f"convert {x} miles to km", f"{x} × 1.609344 = {v.normalize():f}", f"{r1(v)} km"
    if kind == "c":
        x = rng.randint(-30, 45); v = Decimal(x) * 9 / 5 + 32
        q = rng.choice([f"What is {x} °C in Fahrenheit?",
                        f"Convert {x} degrees Celsius to Fahrenheit."])
        return q, f"convert {x} °C to °F", f"{x} × 9/5 + 32 = {r1(v)}", f"{r1(v)} °F"
    x = rng.randint(-4, 110); v = Decimal(x - 32) * 5 / 9
    op = "=" if v == v.quantize(Decimal("0.1")) else "≈"
    q = rng.choice([f"What is {x} °F in Celsius?", f"Convert {x} degrees Fahrenheit to Celsius."])
    return q, f"convert {x} °F to °C", f"({x} - 32) × 5/9 {op} {r1(v)}", f"{r1(v)} °C"


def sorting(rng):
    w = rng.sample(WORDS, rng.randint(4, 6))
    q = rng.choice(["Sort these words alphabetically: ", "Put these words in alphabetical order: "])
    return q + ", ".join(w), f"sort {len(w)} words alphabetically", None, ", ".join(sorted(w))


def counting(rng):
    w = rng.choice(LONG_WORDS)
    absent = sorted(set("aeiostrn") - set(w))  # every word in LONG_WORDS misses one of these
    ch = rng.choice(sorted(set(w))) if rng.random() < 0.85 else rng.choice(absent)
    q = rng.choice([f"How many times does the letter '{ch}' appear in '{w}'?",
                    f"Count the letter '{ch}' in the word '{w}'."])
    return q, f"count the letter '{ch}' in '{w}'", "Spelling: " + "-".join(w), w.count(ch)


def reversing(rng):
    items = rng.sample(rng.choice(REV_POOLS), rng.randint(4, 7))
    q = rng.choice(["Reverse this list: ", "Write this list in reverse order: "]) + ", ".join(items)
    return q, f"reverse a list of {len(items)} items", None, ", ".join(reversed(items))


def capital(rng):
    c = rng.choice(sorted(CAPITALS))
    q = rng.choice([f"What is the capital of {c}?", f"Name the capital city of {c}.",
                    f"Which city is the capital of {c}?", f"Tell me the capital of {c}."])
    return q, f"name the capital of {c}", None, CAPITALS[c]


FAMILIES = [arithmetic, conversion, sorting, counting, reversing, capital]


def make(n: int, seed: int, exclude: set[str]) -> list[dict]:
    rng = random.Random(seed)
    order = [FAMILIES[i % len(FAMILIES)] for i in range(n)]
    rng.shuffle(order)
    rows, seen = [], set(exclude)
    for fam in order:
        q, task, work, ans = fam(rng)
        while q in seen:  # no repeated question within a split, none of training's in eval
            q, task, work, ans = fam(rng)
        seen.add(q)
        reply = "\n".join([f"Task: {task}."] + ([work] if work else []) + [f"Answer: {ans}"])
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.2:
            msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        rows.append({"messages": msgs})
    return rows


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    train = make(320, seed=1234, exclude=set())
    eval_ = make(48, seed=5678, exclude={r["messages"][-2]["content"] for r in train})
    for name, rows in [("chat_sft.jsonl", train), ("chat_sft_eval.jsonl", eval_)]:
        path = OUT / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8", newline="\n")
        print(f"wrote {path} ({len(rows)} rows, {path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
