"""Reward functions: extraction modes, format/length, custom Python, the retrograd-reward/1 command
in both modes, and the errors that must stop a run (raise, wrong count, NaN, timeout, bad output)."""
import sys
import textwrap

import pytest

from retrograd.errors import ConfigError
from retrograd.rl.rewards import RewardError, build_rewards, extract_answer


def score(specs, completions, tmp_path, answers=None, command=None):
    rewards = build_rewards(specs, tmp_path, command)
    cols = {"answer": answers or ["0"] * len(completions)}
    out = [r(["q"] * len(completions), completions, cols) for r in rewards]
    for r in rewards:
        if hasattr(r.fn, "close"):
            r.fn.close()
    return out


def test_extraction():
    assert extract_answer("so \\boxed{\\frac{1}{2}} and \\boxed{42}", "boxed") == "42"
    assert extract_answer("x \\boxed{a{b}c} y", "boxed") == "a{b}c"
    assert extract_answer("3 apples, then 1,250 more", "last_number") == "1,250"
    assert extract_answer("Task: add.\nAnswer: 17 apples\nthanks", "answer_line") == "17 apples"
    assert extract_answer("no answer", "boxed") is None


def test_builtin_rewards(tmp_path):
    comps = ["Answer: 12", "it is 12.0", "Answer: 13", "nothing"]
    match, = score([{"type": "match"}], comps, tmp_path, ["12"] * 4)
    assert match == [1.0, 1.0, 0.0, 0.0]
    line, = score([{"type": "match", "extract": "answer_line"}], comps, tmp_path, ["12"] * 4)
    assert line == [1.0, 0.0, 0.0, 0.0]
    fmt, = score([{"type": "format", "pattern": r"^Answer: \d+$", "fullmatch": True}], comps, tmp_path)
    assert fmt == [1.0, 0.0, 1.0, 0.0]
    length, = score([{"type": "length", "target": 5, "penalty": 2.0}], ["abc", "abcdefghij"], tmp_path)
    assert length == [0.0, -2.0]


def test_custom_python_and_its_errors(tmp_path):
    (tmp_path / "myrewards.py").write_text(textwrap.dedent("""
        def good(prompts, completions, answer, **kw):
            return [float(c == a) for c, a in zip(completions, answer)]
        def short(prompts, completions, **kw):
            return [1.0]
        def nan(prompts, completions, **kw):
            return [float('nan')] * len(completions)
        def boom(prompts, completions, **kw):
            raise ValueError('bad input')
    """))
    got, = score([{"type": "python", "function": "myrewards:good"}], ["7", "8"], tmp_path, ["7", "7"])
    assert got == [1.0, 0.0]
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        score([{"type": "python", "function": "myrewards:short"}], ["a", "b"], tmp_path)
    with pytest.raises(RewardError, match="returned nan for the completion of prompt 'q'"):
        score([{"type": "python", "function": "myrewards.nan"}], ["a"], tmp_path)
    with pytest.raises(RewardError, match="raised ValueError: bad input"):
        score([{"type": "python", "function": "myrewards:boom"}], ["a"], tmp_path)
    with pytest.raises(ConfigError, match="cannot import 'myrewards:missing'"):
        build_rewards([{"type": "python", "function": "myrewards:missing"}], tmp_path)
    with pytest.raises(ConfigError, match=r"grpo.rewards\[0\].type = 'magic'"):
        build_rewards([{"type": "magic"}], tmp_path)
    with pytest.raises(ConfigError, match=r"grpo.rewards\[0\] \(format\)"):
        build_rewards([{"type": "format", "patern": "x"}], tmp_path)


def test_a_hanging_python_reward_stops_with_its_name_and_prompt(tmp_path):
    (tmp_path / "hangrewards.py").write_text(textwrap.dedent("""
        import time
        def sleeps(prompts, completions, **kw):
            time.sleep(3600)
        def spins(prompts, completions, **kw):
            while True:
                try:
                    sum(range(1000))
                except Exception:  # a reward's own catch-all must not swallow the timeout
                    pass
        def quick(prompts, completions, **kw):
            return [1.0] * len(completions)
    """))
    import time
    for fn in ("sleeps", "spins"):
        t = time.monotonic()
        with pytest.raises(RewardError, match=rf"hangrewards:{fn}' did not return within 0.5 s.*prompt 'q'"):
            score([{"type": "python", "function": f"hangrewards:{fn}", "timeout_seconds": 0.5}], ["a"], tmp_path)
        assert time.monotonic() - t < 10
    got, = score([{"type": "python", "function": "hangrewards:quick", "timeout_seconds": 0.5}], ["a", "b"], tmp_path)
    assert got == [1.0, 1.0]
    time.sleep(0.8)  # no stray timeout fires after a call that returned in time
    with pytest.raises(ConfigError, match="timeout_seconds must be a positive"):
        build_rewards([{"type": "python", "function": "hangrewards:quick", "timeout_seconds": 0}], tmp_path)


PERSISTENT = """
import json, sys
hello = json.loads(sys.stdin.readline())
print(json.dumps(hello), flush=True)
for line in sys.stdin:
    row = json.loads(line)
    if "_retrograd_batch_end" in row:
        print(json.dumps(row), flush=True)
        continue
    MODE
"""


@pytest.mark.parametrize("body,error", [
    ('print(json.dumps({"reward": len(row["completion"]), "_retrograd_batch": row["_retrograd_batch"], '
     '"_retrograd_index": row["_retrograd_index"]}), flush=True)', None),
    ('print(json.dumps({"reward": "high", "_retrograd_batch": row["_retrograd_batch"], '
     '"_retrograd_index": row["_retrograd_index"]}), flush=True)', "expected {\"reward\": <finite number>}"),
    ("print('not json', flush=True)", "not JSON"),
    ("import time; time.sleep(30)", "no answer within 1 s"),
    ("sys.exit(3)", "exited (status 3)"),
])
def test_command_persistent(tmp_path, body, error):
    (tmp_path / "rw.py").write_text(PERSISTENT.replace("MODE", body))
    command = {"command": [sys.executable, "rw.py"], "mode": "persistent", "timeout_seconds": 1}
    if error is None:
        rewards = build_rewards([], tmp_path, command)
        assert rewards[0](["q", "q"], ["ab", "abcd"], {"answer": ["1", "2"]}) == [2.0, 4.0]
        assert rewards[0](["q"], ["xyz"], {"answer": ["1"]}) == [3.0]  # the same process, batch 2
        rewards[0].fn.close()
    else:
        with pytest.raises(RewardError, match=error.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")):
            score([], ["ab", "abcd"], tmp_path, command=command)


def test_command_oneshot(tmp_path):
    (tmp_path / "one.py").write_text("import json, sys\nfor line in sys.stdin:\n"
                                     "    r = json.loads(line)\n"
                                     "    print(json.dumps({'reward': float(r['completion'] == r['answer'])}))\n")
    got, = score([{"type": "command", "command": [sys.executable, "one.py"], "mode": "oneshot"}],
                 ["7", "8"], tmp_path, ["7", "7"])
    assert got == [1.0, 0.0]
    (tmp_path / "few.py").write_text("import sys\nsys.stdin.read()\nprint('{\"reward\": 1}')\n")
    with pytest.raises(RewardError, match="exited"):
        score([{"type": "command", "command": [sys.executable, "few.py"], "mode": "oneshot"}], ["a", "b"], tmp_path)


def test_math_reward_uses_math_verify(tmp_path):
    got, = score([{"type": "math"}], ["so the answer is $\\frac{1}{2}$", "x = 0.4", "\\boxed{0.5}"], tmp_path,
                 ["1/2", "1/2", "1/2"])
    assert got == [1.0, 0.0, 1.0]
