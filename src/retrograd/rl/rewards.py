"""Reward functions for RL with verifiable rewards, and their weighted sum.

Every reward has the signature TRL users know: fn(prompts, completions, **columns) -> list[float],
where prompts are the prompts' last user messages, completions the sampled texts and columns the
prompt rows' other fields (e.g. `answer`), one list entry per completion.

Built in (`[[grpo.rewards]]` tables, `type = ...`, each with an optional `weight`, default 1):
  match    1 when the extracted answer equals the row's `column` (default "answer"): `extract =
           "last_number"` (default; numbers compared as numbers), "boxed" (the last \\boxed{...}),
           "answer_line" (text after the last "Answer:"), or "exact" (the whole completion, stripped)
  math     1 when math-verify finds the completion's answer equivalent to `column` (pip install
           'retrograd[math]'); each check has `timeout_seconds`
  format   1 when `pattern` (a Python regex) matches (`fullmatch = true` for the whole text)
  length   -penalty * max(0, characters - target) / target
  python   `function = "module:name"` (or module.name), imported with the TOML's folder on sys.path;
           a call that has not returned after `timeout_seconds` (default 600) stops the run
  command  an external program speaking retrograd-reward/1 (rl/reward_command.py)

A reward that raises, hangs, returns the wrong count, or a non-finite value stops the run with a message
naming the reward and the prompt; it is never replaced by a silent zero.
"""
from __future__ import annotations

import math
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from retrograd.algorithms.registry import PluginError, import_object
from retrograd.errors import ConfigError, RetrogradError


class RewardError(RetrogradError):
    pass


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def extract_answer(text: str, how: str) -> str | None:
    if how == "exact":
        return text.strip()
    if how == "boxed":
        start = text.rfind("\\boxed{")
        if start < 0:
            return None
        depth, i = 0, start + len("\\boxed{")
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                if depth == 0:
                    return text[i:j].strip()
                depth -= 1
        return None
    if how == "answer_line":
        at = text.rfind("Answer:")
        return text[at + len("Answer:"):].strip().splitlines()[0].strip() if at >= 0 and text[at + 7:].strip() else None
    if how == "last_number":
        found = NUMBER.findall(text)
        return found[-1] if found else None
    raise ConfigError(f"unknown match extract {how!r}: boxed, last_number, answer_line or exact")


def answers_equal(got: str | None, want) -> bool:
    if got is None:
        return False
    a, b = _number(str(got)), _number(str(want).strip())
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=0, abs_tol=1e-9)
    return str(got).strip() == str(want).strip()


def match_reward(column: str = "answer", extract: str = "last_number"):
    extract_answer("", extract)  # validate the mode now

    def match(prompts, completions, **columns):
        if column not in columns:
            raise RewardError(f"reward 'match' needs a '{column}' field in every prompt row")
        return [1.0 if answers_equal(extract_answer(c, extract), a) else 0.0
                for c, a in zip(completions, columns[column])]
    return match


def math_reward(column: str = "answer", timeout_seconds: int = 5):
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigError("reward type 'math' needs math-verify: pip install 'retrograd[math]'") from None

    timeout_seconds = max(1, int(timeout_seconds))  # math-verify's alarm takes whole seconds

    def math_equiv(prompts, completions, **columns):
        if column not in columns:
            raise RewardError(f"reward 'math' needs a '{column}' field in every prompt row")
        out = []
        for c, a in zip(completions, columns[column]):
            gold, pred = parse(str(a), parsing_timeout=timeout_seconds), parse(c, parsing_timeout=timeout_seconds)
            out.append(1.0 if verify(gold, pred, timeout_seconds=timeout_seconds) else 0.0)
        return out
    return math_equiv


def format_reward(pattern: str, fullmatch: bool = False):
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"reward 'format': pattern {pattern!r} is not a valid regex ({e})") from None

    def fmt(prompts, completions, **columns):
        return [1.0 if (rx.fullmatch(c) if fullmatch else rx.search(c)) else 0.0 for c in completions]
    return fmt


def length_reward(target: int, penalty: float = 1.0):
    def length(prompts, completions, **columns):
        return [-penalty * max(0, len(c) - target) / target for c in completions]
    return length


class _RewardTimeout(BaseException):
    """Raised inside a hung reward call (a BaseException, so a reward's own `except Exception`
    cannot swallow it)."""


def call_with_timeout(fn, seconds: float, *args, **kwargs):
    """fn(*args, **kwargs), interrupted after `seconds`: a watchdog thread signals the main thread
    (SIGUSR1), whose handler raises inside the call -- this ends busy loops and blocking sleeps or
    reads alike, and leaves SIGALRM to the reward (math-verify times its checks with it). Off the
    main thread no signal can reach the call, so it runs without a limit."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    done = threading.Event()

    def on_signal(signum, frame):
        if not done.is_set():
            raise _RewardTimeout()

    previous = signal.signal(signal.SIGUSR1, on_signal)
    main = threading.main_thread().ident

    def watchdog():
        if not done.wait(seconds):
            signal.pthread_kill(main, signal.SIGUSR1)
    dog = threading.Thread(target=watchdog, name="reward-timeout", daemon=True)
    dog.start()
    try:
        return fn(*args, **kwargs)
    finally:
        done.set()
        dog.join()
        signal.signal(signal.SIGUSR1, previous)


def python_reward(function: str, base: Path, timeout_seconds: float = 600):
    try:
        fn = import_object(function, base)
    except PluginError as e:
        raise ConfigError(f"reward 'python': {e}") from None
    if not (isinstance(timeout_seconds, (int, float)) and timeout_seconds > 0):
        raise ConfigError(f"reward 'python' {function!r}: timeout_seconds must be a positive number of seconds")

    def limited(prompts, completions, **columns):
        try:
            return call_with_timeout(fn, timeout_seconds, prompts, completions, **columns)
        except _RewardTimeout:
            raise RewardError(f"reward {function!r} did not return within {timeout_seconds} s (its "
                              f"timeout_seconds); batch starting with prompt {prompts[0][:80]!r}") from None
    return limited


@dataclass
class Reward:
    name: str
    weight: float
    fn: Callable

    def __call__(self, prompts: list[str], completions: list[str], columns: dict) -> list[float]:
        try:
            values = self.fn(prompts, completions, **columns)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e} (batch starting with prompt "
                              f"{prompts[0][:80]!r})") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardError(f"reward {self.name!r} must return a list of numbers, got {str(values)[:100]}") from None
        if len(values) != len(completions):
            raise RewardError(f"reward {self.name!r} returned {len(values)} values for {len(completions)} completions")
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise RewardError(f"reward {self.name!r} returned {v} for the completion of prompt {prompts[i][:80]!r}")
        return values


# `type` of a [[grpo.rewards]] table -> what it scores (`retrograd plugins` lists these)
REWARD_TYPES = {
    "match": "1 when the extracted answer (last_number, boxed, answer_line, exact) equals a column",
    "math": "1 when math-verify finds the answer equivalent (pip install 'retrograd[math]')",
    "format": "1 when a regex matches the completion",
    "length": "-penalty * characters beyond target / target",
    "python": "your function = 'module:name' with TRL's signature",
    "command": "an external program speaking retrograd-reward/1",
}


def build_rewards(specs: list[dict], base: Path, command: dict | None = None) -> list[Reward]:
    """`[[grpo.rewards]]` tables (+ the retrograd-rs `reward_command` keys) -> Reward objects."""
    out = []
    builders = {"match": match_reward, "math": math_reward, "format": format_reward, "length": length_reward}
    for i, spec in enumerate(specs):
        where = f"grpo.rewards[{i}]"
        if not isinstance(spec, dict) or "type" not in spec:
            raise ConfigError(f"{where} must be a table with a 'type' (match, math, format, length, python, command)")
        spec = dict(spec)
        kind, weight, name = spec.pop("type"), float(spec.pop("weight", 1.0)), spec.pop("name", None)
        try:
            if kind in builders:
                fn = builders[kind](**spec)
            elif kind == "python":
                fn = python_reward(base=base, **spec)
            elif kind == "command":
                from retrograd.rl.reward_command import CommandReward
                fn = CommandReward(base=base, **spec)
            else:
                raise ConfigError(f"{where}.type = {kind!r}: one of match, math, format, length, python, command")
        except TypeError as e:
            raise ConfigError(f"{where} ({kind}): {e}".replace("__init__() ", "").replace("_reward() ", "")) from None
        out.append(Reward(name or (spec.get("function") if kind == "python" else kind), weight, fn))
    if command:
        from retrograd.rl.reward_command import CommandReward
        out.append(Reward("command", 1.0, CommandReward(base=base, **command)))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        out = [Reward(f"{r.name}_{i}", r.weight, r.fn) for i, r in enumerate(out)]
    return out


def rewards_from_config(g, base: Path) -> list[Reward]:
    """The rewards of a [grpo] table: its [[grpo.rewards]] plus the retrograd-rs `reward_command` keys."""
    command = ({"command": g.reward_command, "mode": g.reward_mode, "timeout_seconds": g.reward_timeout_seconds}
               if g.reward_command else None)
    return build_rewards(g.rewards, base, command)
