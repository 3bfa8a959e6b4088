"""Promises, and the one compute thread that runs their jobs, shared fairly between owners.

Every submitting endpoint returns `{"request_id"}` at once and queues a job; the client then
long-polls `retrieve_future`. Jobs run one at a time on one thread (torch already uses every core
for each op: two at once would only make both slower and double peak memory).

Fairness: each owner has its own queue, and the thread takes one job from each owner with work in
turn (round robin), so one owner's burst never waits in front of another's single call. A long
request is queued as several parts (`submit_parts`: e.g. a big sampling request in chunks of
sequences) so that other owners' jobs run between its parts; its promise resolves with the last.

Training ops of one model carry the client's `seq_id` (1, 2, ... after create_model, which is 0)
and must run in that order even when they arrive out of order (the SDK sends the chunks of one
forward_backward in parallel, the first chunk last): a job waits in its model's `pending` map
until every lower seq_id has been released to its owner's queue. A resubmitted (model, seq_id) gets
the first submission's request id back, so a client retry never runs an op twice.
"""
from __future__ import annotations

import asyncio
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
    waiters: list = field(default_factory=list)  # (event loop, asyncio.Event) of long polls

    def _finish(self) -> None:
        self.finished_at = time.time()
        self.done.set()
        for loop, event in self.waiters:
            loop.call_soon_threadsafe(event.set)
        self.waiters.clear()


@dataclass
class _ModelQueue:
    owner: str
    next_seq: int
    pending: dict = field(default_factory=dict)  # seq_id -> (promise, fn)
    request_ids: dict = field(default_factory=dict)  # seq_id -> request id (dedupe resubmissions)


@dataclass
class _Job:
    promise: Promise
    fn: object  # () -> result; for a part of a chain, its result is not the promise's unless it is the last
    last: bool = True


class Executor:
    def __init__(self, log=print):
        self.log = log
        self._lock = threading.Lock()
        self._promises: dict[str, Promise] = {}
        self._models: dict[str, _ModelQueue] = {}
        self._queues: dict[str, collections.deque] = {}  # owner -> jobs, FIFO
        self._turns: collections.deque = collections.deque()  # owners with queued jobs, in turn order
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self.running: str | None = None  # the owner whose job runs now (for the load test's accounting)
        self.busy_seconds: dict[str, float] = collections.defaultdict(float)  # compute time per owner
        self._thread = threading.Thread(target=self._work, name="retrograd-compute", daemon=True)
        self._thread.start()

    # ---- submission ----------------------------------------------------------------------------
    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    def _promise(self, owner: str, request_id: str | None = None) -> Promise:
        p = Promise(request_id or uuid.uuid4().hex, owner)
        self._promises[p.request_id] = p
        return p

    def _enqueue(self, owner: str, job: _Job) -> None:
        q = self._queues.setdefault(owner, collections.deque())
        if not q and owner not in self._turns:
            self._turns.append(owner)
        q.append(job)
        self._wake.notify()

    def submit(self, owner: str, fn) -> str:
        """An unordered job (sampling, session-level work)."""
        return self.submit_parts(owner, [fn])

    def submit_parts(self, owner: str, parts: list, request_id: str | None = None) -> str:
        """One request run as several jobs in order, other owners' jobs between them; the promise
        resolves with the last part's result (earlier parts prepare it, e.g. into a shared list).
        A failing part fails the promise and skips the rest. `request_id`: one the caller chose
        (new_request_id), so its jobs can name their own request."""
        with self._lock:
            p = self._promise(owner, request_id)
            for i, fn in enumerate(parts):
                self._enqueue(owner, _Job(p, fn, i == len(parts) - 1))
            return p.request_id

    def open_model(self, model_id: str, owner: str, next_seq: int) -> None:
        with self._lock:
            self._models.setdefault(model_id, _ModelQueue(owner, next_seq))

    def close_model(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._models

    def models_of(self, owner: str) -> int:
        with self._lock:
            return sum(1 for q in self._models.values() if q.owner == owner)

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
                promise, job_fn = q.pending.pop(q.next_seq)
                self._enqueue(owner, _Job(promise, job_fn))
                q.next_seq += 1
            return p.request_id

    # ---- results -------------------------------------------------------------------------------
    def promise(self, request_id: str, owner: str) -> Promise | None:
        with self._lock:
            p = self._promises.get(request_id)
        return p if p is not None and p.owner == owner else None

    def wait(self, request_id: str, owner: str, timeout: float) -> Promise | None:
        """The promise (done or not after `timeout`), or None when unknown to this owner."""
        p = self.promise(request_id, owner)
        if p is not None:
            p.done.wait(timeout)
        return p

    async def wait_async(self, request_id: str, owner: str, timeout: float) -> Promise | None:
        """As `wait`, without holding a thread: the compute thread wakes the poll when the job ends."""
        p = self.promise(request_id, owner)
        if p is None:
            return None
        event = asyncio.Event()
        with self._lock:
            if p.done.is_set():
                return p
            p.waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            with self._lock:
                p.waiters[:] = [w for w in p.waiters if w[1] is not event]
        return p

    def _next(self) -> _Job | None:
        """The next owner's next job (round robin); None when stopping."""
        while not self._turns and not self._stop:
            self._wake.wait()
        if self._stop:
            return None
        owner = self._turns.popleft()
        q = self._queues[owner]
        job = q.popleft()
        if q:
            self._turns.append(owner)  # back of the line
        else:
            del self._queues[owner]
        return job

    def _work(self) -> None:
        while True:
            with self._lock:
                job = self._next()
                if job is None:
                    return
                self.running = job.promise.owner
            p = job.promise
            t0 = time.perf_counter()
            failed = p.error is not None  # an earlier part failed: skip the rest of the chain
            if not failed:
                try:
                    result = job.fn()
                    if job.last:
                        p.result = result
                except (JobError, UserError, LossInputError, RetrogradError) as e:
                    p.error = (str(e), "user")
                except Exception as e:  # reported to the client; the server keeps serving
                    self.log("job failed:\n" + traceback.format_exc())
                    p.error = (f"internal error ({type(e).__name__}); the server log has the details", "server")
            with self._lock:
                self.busy_seconds[p.owner] += time.perf_counter() - t0
                self.running = None
                if job.last or (p.error is not None and not failed):
                    if not p.done.is_set():
                        p._finish()
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
