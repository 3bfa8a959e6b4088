"""Promises and the single compute thread behind them.

Every submitting endpoint returns `{"request_id"}` at once and queues a job; the client then
long-polls `retrieve_future`. Jobs run one at a time on one thread (torch already uses every core
for each op, so running two at once would only make both slower and double peak memory).

Training ops of one model carry the client's `seq_id` (1, 2, ... after create_model, which is 0)
and must run in that order even when they arrive out of order (the SDK sends the chunks of one
forward_backward in parallel, the first chunk last): a job waits in its model's `pending` map
until every lower seq_id has been released. A resubmitted (model, seq_id) gets the first
submission's request id back, so a client retry never runs an op twice.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

from retrograd.algorithms.tinker_losses import LossInputError
from retrograd.errors import RetrogradError
from retrograd.service.engine import UserError

RESULT_TTL_S = 3600  # completed results are kept this long for (re-)polling


class JobError(Exception):
    """A job failed for a reason the client should read (category "user")."""


@dataclass
class Promise:
    request_id: str
    owner: str
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None  # dict (JSON) or bytes (protobuf)
    error: tuple[str, str] | None = None  # (message, category)
    finished_at: float = 0.0


@dataclass
class _ModelQueue:
    next_seq: int
    pending: dict = field(default_factory=dict)  # seq_id -> (promise, fn)
    request_ids: dict = field(default_factory=dict)  # seq_id -> request id (dedupe resubmissions)


class Executor:
    def __init__(self, log=print):
        self.log = log
        self._lock = threading.Lock()
        self._promises: dict[str, Promise] = {}
        self._models: dict[str, _ModelQueue] = {}
        self._ready: collections.deque = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="retrograd-compute", daemon=True)
        self._thread.start()

    # ---- submission ----------------------------------------------------------------------------
    def _promise(self, owner: str) -> Promise:
        p = Promise(uuid.uuid4().hex, owner)
        self._promises[p.request_id] = p
        return p

    def submit(self, owner: str, fn) -> str:
        """An unordered job (sampling, session-level work)."""
        with self._lock:
            p = self._promise(owner)
            self._ready.append((p, fn))
            self._wake.notify()
            return p.request_id

    def open_model(self, model_id: str, next_seq: int) -> None:
        with self._lock:
            self._models.setdefault(model_id, _ModelQueue(next_seq))

    def close_model(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._models

    def submit_ordered(self, owner: str, model_id: str, seq_id: int, fn) -> str:
        with self._lock:
            q = self._models[model_id]
            if seq_id in q.request_ids:
                return q.request_ids[seq_id]
            if seq_id < q.next_seq:
                raise JobError(f"seq_id {seq_id} of {model_id} was already executed (next is {q.next_seq})")
            p = self._promise(owner)
            q.request_ids[seq_id] = p.request_id
            q.pending[seq_id] = (p, fn)
            while q.next_seq in q.pending:
                self._ready.append(q.pending.pop(q.next_seq))
                q.next_seq += 1
            self._wake.notify()
            return p.request_id

    # ---- results -------------------------------------------------------------------------------
    def wait(self, request_id: str, owner: str, timeout: float) -> Promise | None:
        """The promise (done or not after `timeout`), or None when unknown to this owner."""
        with self._lock:
            p = self._promises.get(request_id)
        if p is None or p.owner != owner:
            return None
        p.done.wait(timeout)
        return p

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._ready and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                p, fn = self._ready.popleft()
            try:
                p.result = fn()
            except (JobError, UserError, LossInputError, RetrogradError) as e:
                p.error = (str(e), "user")
            except Exception as e:  # reported to the client; the server keeps serving
                self.log("job failed:\n" + traceback.format_exc())
                p.error = (f"{type(e).__name__}: {e}", "server")
            p.finished_at = time.time()
            p.done.set()
            self._expire()

    def _expire(self) -> None:
        cutoff = time.time() - RESULT_TTL_S
        with self._lock:
            for rid in [r for r, p in self._promises.items() if p.done.is_set() and p.finished_at < cutoff]:
                del self._promises[rid]

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
