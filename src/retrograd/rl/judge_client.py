"""The wire side of LLM judges: OpenAI-compatible chat completions with a hard deadline, retries, a
bounded number of requests in flight, and a disk cache of replies.

`JudgeClient.complete_all(requests)` sends a batch of chat requests (each a dict: messages and an
optional JSON schema for the reply) with at most `max_concurrency` in flight and returns, in order,
one `Reply` each: the reply text, or the reason it failed after `max_retries` retries. It never
raises for a failed request and never hangs: every attempt has a deadline of `timeout_seconds`,
enforced by closing the connection (a server that accepts and then drips bytes is cut off too).
Retried: connection errors, timeouts, HTTP 408/409/429/5xx (honouring Retry-After up to 30 s) and
replies `validate` rejects; not retried: other 4xx (a wrong model name or key will not heal).

The cache (`cache_path`, JSON lines, private to the user) maps a hash of everything that decides a
reply (model, messages, schema, temperature, max_tokens) to the reply text; hits skip the server.
The API key is read from the environment variable `api_key_env` and is never written anywhere.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
MAX_RETRY_AFTER_S = 30.0
MAX_REPLY_BYTES = 4 * 2**20


@dataclass
class Reply:
    text: str | None  # the assistant message, None when the request failed
    error: str = ""  # why it failed (after every retry)
    cached: bool = False
    latency_s: float = 0.0
    attempts: int = 0
    invalid: int = 0  # replies that arrived but `validate` rejected


class JudgeClient:
    def __init__(self, base_url: str, model: str, *, api_key: str | None, timeout_s: float, max_retries: int,
                 max_concurrency: int, temperature: float, max_tokens: int, cache_path: str | None,
                 structured_output: bool = True, retry_pause_s: float = 0.5):
        parts = urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"judge base_url {base_url!r} must be an http:// or https:// URL")
        self.parts, self.model, self.api_key = parts, model, api_key
        self.timeout_s, self.max_retries, self.max_concurrency = timeout_s, max_retries, max_concurrency
        self.temperature, self.max_tokens, self.structured = temperature, max_tokens, structured_output
        self.retry_pause_s = retry_pause_s
        self.cache_path = Path(cache_path) if cache_path else None
        self.cache: dict[str, str] = {}
        self._lock = threading.Lock()
        if self.cache_path is not None and self.cache_path.exists():
            for line in self.cache_path.read_text(encoding="utf-8").split("\n"):
                try:
                    row = json.loads(line) if line else None
                except json.JSONDecodeError:
                    row = None  # a line cut short by a crash: its request is simply asked again
                if isinstance(row, dict) and isinstance(row.get("key"), str) and isinstance(row.get("reply"), str):
                    self.cache[row["key"]] = row["reply"]

    # ---- one request ---------------------------------------------------------------------------
    def _body(self, messages: list[dict], schema: dict | None) -> dict:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "stream": False}
        if schema is not None and self.structured:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "verdict", "strict": True, "schema": schema}}
        return body

    def _key(self, body: dict) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def _post(self, body: dict) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one POST .../chat/completions, cut off at the deadline."""
        p = self.parts
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        conn = cls(p.hostname, p.port, timeout=self.timeout_s)
        sockets = []  # the connected socket: a response keeps reading from it after the connection lets go
        expired = threading.Event()

        def deadline():
            expired.set()
            _close(conn, sockets)
        timer = threading.Timer(self.timeout_s, deadline)
        timer.start()
        try:
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            conn.connect()
            sockets.append(conn.sock)
            conn.request("POST", f"{p.path}/chat/completions", json.dumps(body).encode(), headers)
            resp = conn.getresponse()
            data = resp.read(MAX_REPLY_BYTES + 1)
            if expired.is_set():  # what arrived before the cut is not a reply
                raise TimeoutError(f"no complete reply within {self.timeout_s:g} s")
            if len(data) > MAX_REPLY_BYTES:
                raise OSError(f"the reply is larger than {MAX_REPLY_BYTES} bytes")
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        finally:
            timer.cancel()
            _close(conn, sockets)

    def complete(self, messages: list[dict], schema: dict | None = None,
                 validate: Callable[[str], bool] = lambda _: True, use_cache: bool = True) -> Reply:
        body = self._body(messages, schema)
        key = self._key(body)
        if use_cache and key in self.cache and validate(self.cache[key]):
            return Reply(self.cache[key], cached=True)
        t0, error, invalid = time.perf_counter(), "", 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(8.0, self.retry_pause_s * 2 ** (attempt - 1)))
            started = time.perf_counter()
            try:
                status, headers, data = self._post(body)
            except (OSError, http.client.HTTPException) as e:
                late = isinstance(e, TimeoutError) or time.perf_counter() - started >= self.timeout_s - 0.05
                error = f"timed out after {self.timeout_s:g} s" if late else f"{type(e).__name__}: {e}"
                continue
            if status != 200:
                error = f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}"
                if status not in RETRY_STATUS:
                    break
                wait = _retry_after(headers.get("retry-after"))
                if wait:
                    time.sleep(wait)
                continue
            text = _message_text(data)
            if text is None:
                error, invalid = f"not an OpenAI chat completion: {data[:200].decode('utf-8', 'replace')}", invalid + 1
                continue
            if not validate(text):
                error, invalid = f"the verdict could not be read from {text[:200]!r}", invalid + 1
                continue
            if use_cache:
                self._remember(key, text)
            return Reply(text, latency_s=time.perf_counter() - t0, attempts=attempt + 1, invalid=invalid)
        return Reply(None, error, latency_s=time.perf_counter() - t0, attempts=attempt + 1, invalid=invalid)

    def complete_all(self, requests: list[tuple[list[dict], dict | None, Callable[[str], bool]]],
                     use_cache: bool = True) -> list[Reply]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(lambda r: self.complete(*r, use_cache=use_cache), requests))

    def _remember(self, key: str, text: str) -> None:
        with self._lock:
            self.cache[key] = text
            if self.cache_path is None:
                return
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.cache_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "reply": text}, ensure_ascii=False) + "\n")


def _close(conn, sockets: list) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
        except OSError:
            pass
    conn.close()


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, min(MAX_RETRY_AFTER_S, float(value))) if value else 0.0
    except ValueError:
        return 0.0


def _message_text(data: bytes) -> str | None:
    try:
        reply = json.loads(data)
        text = reply["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None
