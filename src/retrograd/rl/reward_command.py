"""An external reward program speaking `retrograd-reward/1` over stdin/stdout, one JSON object per
line, every line flushed.

Request line (one per completion): {"prompt": <last user message>, "completion": <text>, ...the
prompt row's other fields}. Reply line: {"reward": <finite number>}.

  oneshot     the command is started for every batch, gets the batch's request lines, stdin is
              closed, and it must print exactly one reply per request, in order.
  persistent  (default) started once. Handshake: retrograd writes {"protocol": "retrograd-reward/1"}
              and the program answers the same line. Then per batch, request lines carry
              "_retrograd_batch" and "_retrograd_index", followed by {"_retrograd_batch_end": b};
              the program replies per request (echoing both fields, in any order) and then echoes
              {"_retrograd_batch_end": b}.

Any error (exit, timeout after `timeout_seconds`, unreadable line, a reply for the wrong request,
a missing or non-finite reward) raises RewardError naming the command; nothing is retried.
"""
from __future__ import annotations

import json
import math
import queue
import subprocess
import threading
import time
from pathlib import Path

from retrograd.errors import ConfigError
from retrograd.rl.rewards import RewardError

PROTOCOL = "retrograd-reward/1"
MAX_LINE = 8 << 20


class CommandReward:
    def __init__(self, command: list, base: Path, mode: str = "persistent", timeout_seconds: float = 300.0):
        if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
            raise ConfigError(f"reward command must be a non-empty list of strings (argv), got {command!r}")
        if mode not in ("persistent", "oneshot"):
            raise ConfigError(f"reward mode {mode!r}: persistent or oneshot")
        self.argv, self.cwd, self.mode, self.timeout = command, str(base), mode, float(timeout_seconds)
        self.proc: subprocess.Popen | None = None
        self.batch = 0

    def _what(self) -> str:
        return f"reward command {' '.join(self.argv)!r}"

    def _start(self) -> subprocess.Popen:
        try:
            proc = subprocess.Popen(self.argv, cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=None, text=True, bufsize=1)
        except OSError as e:
            raise RewardError(f"{self._what()} cannot start: {e}") from None
        # a reader thread, so a timeout can be enforced without losing lines buffered by the pipe
        proc.lines = queue.Queue()

        def pump(stream, q):
            for line in iter(lambda: stream.readline(MAX_LINE), ""):
                q.put(line)
            q.put(None)
        threading.Thread(target=pump, args=(proc.stdout, proc.lines), daemon=True).start()
        return proc

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> dict:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.close()
            raise RewardError(f"{self._what()} gave no answer within {self.timeout:g} s (reward timeout)") from None
        if line is None:
            code = proc.wait()
            self.proc = None
            raise RewardError(f"{self._what()} exited (status {code}) before answering every completion")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise RewardError(f"{self._what()} printed a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(obj, dict):
            raise RewardError(f"{self._what()} printed {line[:200]!r}; expected a JSON object per line")
        return obj

    def _reward(self, obj: dict, prompt: str) -> float:
        v = obj.get("reward")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"{self._what()} answered {json.dumps(obj)[:200]} for prompt {prompt[:80]!r}; "
                              "expected {\"reward\": <finite number>}")
        return float(v)

    def __call__(self, prompts, completions, **columns) -> list[float]:
        rows = [{"prompt": p, "completion": c, **{k: v[i] for k, v in columns.items()}}
                for i, (p, c) in enumerate(zip(prompts, completions))]
        deadline = time.monotonic() + self.timeout
        if self.mode == "oneshot":
            proc = self._start()
            try:
                proc.stdin.write("".join(json.dumps(r) + "\n" for r in rows))
                proc.stdin.close()
            except BrokenPipeError:
                pass
            self.proc = proc
            try:
                return [self._reward(self._read_line(proc, deadline), r["prompt"]) for r in rows]
            finally:
                self.close()
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
            self._send({"protocol": PROTOCOL})
            hello = self._read_line(self.proc, deadline)
            if hello.get("protocol") != PROTOCOL:
                self.close()
                raise RewardError(f"{self._what()} did not answer the {PROTOCOL} handshake (got {json.dumps(hello)[:200]})")
        self.batch += 1
        b = self.batch
        for i, r in enumerate(rows):
            self._send({**r, "_retrograd_batch": b, "_retrograd_index": i})
        self._send({"_retrograd_batch_end": b})
        out: list[float | None] = [None] * len(rows)
        while True:
            obj = self._read_line(self.proc, deadline)
            if obj.get("_retrograd_batch_end") == b:
                break
            i = obj.get("_retrograd_index")
            if obj.get("_retrograd_batch") != b or not isinstance(i, int) or not 0 <= i < len(rows):
                raise RewardError(f"{self._what()} answered {json.dumps(obj)[:200]}, which is not a request of batch {b}")
            out[i] = self._reward(obj, rows[i]["prompt"])
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            raise RewardError(f"{self._what()} ended batch {b} without rewards for {len(missing)} completions "
                              f"(first: prompt {rows[missing[0]]['prompt'][:80]!r})")
        return out

    def _send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            code = self.proc.wait()
            self.proc = None
            raise RewardError(f"{self._what()} exited (status {code}) while reading its input") from None

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
