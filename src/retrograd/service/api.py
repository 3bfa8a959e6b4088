"""Tinker's session, model and training endpoints, as methods of `Service`, which also holds the
sampling (service/sampling.py) and checkpoint (service/checkpoints.py) endpoints; HTTP routing and
auth are in service/http.py. Ids follow the SDK's hard-coded contracts: session = uuid4,
model_id = "{session}:train:{n}", sampler = "{session}:sample:{n}", checkpoint paths
"tinker://{model_id}/weights/{name}" (state + optimizer) and ".../sampler_weights/{name}".

Ownership: every session, run, sampler and checkpoint belongs to the API key's owner; a lookup by
another owner answers "not found", exactly as for an id that never existed.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.service import validate as v, wire
from retrograd.service.checkpoints import Checkpoints
from retrograd.service.engine import BaseModel, Run
from retrograd.service.errors import HttpError, not_found
from retrograd.service.futures import Executor, JobError
from retrograd.service.registry import Caller, Registry
from retrograd.service.sampling import Sampling
from retrograd.service.storage import CheckpointStore, Signer

URL_TTL_S = 3600
SESSION_IDLE_S = 1800  # a session without a heartbeat this long is finished (its runs leave memory)
LORA_ALPHA = 32.0  # Tinker's LoRA config has no alpha: a server-wide setting (--lora-alpha), kept in manifests


@dataclass(frozen=True)
class Limits:
    """What one request and one owner may take (retrograd serve --max-* flags)."""
    models_per_owner: int = 8  # live training clients
    disk_bytes_per_owner: int = 50 << 30  # registered checkpoints
    sample_tokens: int = 1 << 16  # num_samples x max_tokens of one sampling request
    batch_tokens: int = 1 << 17  # input tokens of one forward_backward request
    sample_chunk: int = 8  # sequences per scheduling slice of a sampling request
    samplers_per_session: int = 8  # live samplers (each holds a weight snapshot); the oldest leave first


def make_private(state_dir: Path) -> None:
    """The state dir and everything in it readable by the server's user only: files created from
    now on (umask 077: the server owns its process), and what an older version left (chmod)."""
    os.umask(0o077)
    state_dir.mkdir(parents=True, exist_ok=True)
    for path in [state_dir, *state_dir.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o700 if path.is_dir() else 0o600)


class Service:
    def __init__(self, state_dir: Path, bases: dict[str, BaseModel], model_policy: dict[str, str] | None = None,
                 log=print, lora_alpha: float = LORA_ALPHA, limits: Limits = Limits()):
        self.state_dir = Path(state_dir)
        make_private(self.state_dir)
        self.limits = limits
        self.registry = Registry(self.state_dir / "registry.sqlite3")
        self.store = CheckpointStore(self.state_dir)
        self.signer = Signer(self.state_dir)
        self.bases = bases
        self.model_policy = model_policy or {}
        self.lora_alpha = lora_alpha
        self.log = log
        self.executor = Executor(log)
        self.runs: dict[str, Run] = {}
        self.run_owner: dict[str, str] = {}
        self.custom_losses: dict[tuple[str, str], object] = {}  # (owner, loss id) -> custom_loss.CustomLoss
        self.sampling = Sampling(self)
        self.checkpoints = Checkpoints(self)
        self.last_seen: dict[str, float] = {}  # session -> last request (heartbeats every 10 s)
        self.sweep()

    def sweep(self) -> None:
        self.sweep_expired()
        removed = self.store.sweep_orphans(self.registry.storage_ids())
        if removed:
            self.log(f"removed {removed} unregistered checkpoint folder(s) (saves cut short)")

    def sweep_expired(self) -> None:
        """Delete checkpoints past their TTL (reads already hide them; this frees the disk)."""
        for row in self.registry.expired():
            self.registry.forget(row.tinker_path)
            self.store.remove(row.storage_id)

    # ---- helpers -------------------------------------------------------------------------------
    def _session(self, caller: Caller, session_id) -> str:
        if not isinstance(session_id, str) or self.registry.session_owner(session_id) != caller.owner:
            raise not_found(f"session {session_id!r}")
        return session_id

    def _live_session(self, caller: Caller, session_id) -> str:
        session = self._session(caller, session_id)
        if session not in self.last_seen:
            raise HttpError(410, f"session {session} has finished (closed, idle for {SESSION_IDLE_S} s, or from before a "
                                 "server restart); create a new ServiceClient -- saved checkpoints remain loadable")
        return session

    def _base(self, name) -> BaseModel:
        if not isinstance(name, str) or name not in self.bases:
            raise HttpError(400, f"base_model {name!r} is not served here; served: {', '.join(self.bases)} "
                                 "(retrograd serve --models ...)")
        return self.bases[name]

    def _run(self, caller: Caller, model_id) -> str:
        if not isinstance(model_id, str):
            raise HttpError(400, f"model_id must be a string, got {model_id!r:.80}")
        if self.run_owner.get(model_id) != caller.owner or not self.executor.has_model(model_id):
            raise not_found(f"model {model_id!r}")
        return model_id

    def _may_sample(self, caller: Caller, base: str) -> None:
        if not caller.may_sample:
            raise HttpError(403, f"sampling is not allowed for owner {caller.owner!r}: the API key's policy is "
                                 "actor-only (training and checkpoints only); ask the administrator for a "
                                 "rollout-enabled key")
        if self.model_policy.get(base, "rollout-enabled") != "rollout-enabled":
            raise HttpError(403, f"sampling is not allowed on model {base!r}: its policy on this server is "
                                 f"{self.model_policy[base]} (retrograd serve --policy)")

    def _ordered(self, caller, body, fn) -> dict:
        model_id = self._run(caller, body.get("model_id"))
        seq = v.integer(body, "seq_id", lo=0)
        if seq is None:
            raise HttpError(400, "seq_id (an integer) is required")
        try:
            return {"request_id": self.executor.submit_ordered(caller.owner, model_id, seq, fn), "model_id": model_id}
        except JobError as e:
            raise HttpError(409, str(e)) from None

    # ---- sessions ------------------------------------------------------------------------------
    def create_session(self, caller: Caller, body: dict) -> dict:
        session_id = str(uuid.uuid4())
        self.registry.add_session(session_id, caller.owner, body.get("tags"), body.get("user_metadata"))
        self.last_seen[session_id] = time.time()
        self._drop_idle_sessions()
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, caller: Caller, body: dict) -> dict:
        session = self._session(caller, body.get("session_id"))
        if session not in self.last_seen:
            raise HttpError(410, f"session {session} has finished")
        self.last_seen[session] = time.time()
        return {"type": "session_heartbeat"}

    def finish_session(self, caller: Caller, session_id: str) -> dict:
        self.registry.finish_session(self._session(caller, session_id), caller.owner)
        self._release(session_id)
        return {}

    def _release(self, session_id: str) -> None:
        """Free a finished session's models and samplers (after the jobs already queued for them):
        what it saved stays registered; what it did not save is gone, as in Tinker."""
        self.last_seen.pop(session_id, None)
        prefix = session_id + ":"

        def drop():
            for model_id in [m for m in self.runs if m.startswith(prefix)]:
                del self.runs[model_id]
                self.executor.close_model(model_id)
            self.sampling.release(session_id)
            self.log(f"session {session_id} finished; its models left memory")
        self.executor.submit("server", drop)

    def _drop_idle_sessions(self) -> None:
        cutoff = time.time() - SESSION_IDLE_S
        for session_id in [s for s, t in list(self.last_seen.items()) if t < cutoff]:
            self.log(f"session {session_id}: no heartbeat for {SESSION_IDLE_S} s, releasing its models")
            self._release(session_id)

    # ---- training ------------------------------------------------------------------------------
    def _new_model(self, caller: Caller, model_id: str, create) -> dict:
        """Reserve `model_id` for its first job `create` (seq 0); a failed create frees the id again."""
        if self.executor.has_model(model_id):
            raise HttpError(409, f"model {model_id} already exists in this session")
        if self.executor.models_of(caller.owner) >= self.limits.models_per_owner:
            raise HttpError(403, f"owner {caller.owner!r} already has {self.limits.models_per_owner} live training "
                                 "clients (the server's --max-models-per-owner): close a session, or wait until an idle "
                                 "one is released")

        def guarded():
            try:
                return create()
            except BaseException:
                self.runs.pop(model_id, None)
                self.run_owner.pop(model_id, None)
                self.executor.close_model(model_id)
                raise
        self.run_owner[model_id] = caller.owner
        self.executor.open_model(model_id, caller.owner, 1)
        return {"request_id": self.executor.submit(caller.owner, guarded), "model_id": model_id}

    def create_model(self, caller: Caller, body: dict) -> dict:
        session = self._live_session(caller, body.get("session_id"))
        base = self._base(body.get("base_model"))
        lora = v.table(body, "lora_config")
        if not lora:
            raise HttpError(400, "only LoRA training clients are served here: lora_config is required")
        opt = optimizer_kind(v.table(body, "optimizer_config"))
        model_id = f"{session}:train:{v.integer(body, 'model_seq_id', 0, lo=0)}"
        rank = v.integer(lora, "rank", 32, lo=1, hi=512, where="lora_config.")
        seed = v.integer(lora, "seed", None, where="lora_config.")
        seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        flags = [v.boolean(lora, k, True, "lora_config.") for k in ("train_attn", "train_mlp", "train_unembed")]
        meta = body.get("user_metadata")

        def create():
            run = Run.create(model_id, base, rank, self.lora_alpha, seed, *flags)
            run.optimizer_kind = opt
            self.runs[model_id] = run
            self.registry.add_run(model_id, session, caller.owner, base.name, run.lora, meta)
            self.log(f"{caller.owner}: created {model_id} on {base.name} (LoRA r={run.lora['rank']}, "
                     f"{', '.join(run.lora['modules'])})")
            return {"type": "create_model", "model_id": model_id}
        return self._new_model(caller, model_id, create)

    def get_info(self, caller: Caller, body: dict) -> dict:
        model_id = self._run(caller, body.get("model_id"))
        run = self.runs.get(model_id)
        if run is None:
            raise HttpError(409, f"model {model_id} is still being created; wait for its future")
        b = run.base
        # a client on this machine reads the tokenizer from the server's folder; one elsewhere needs a
        # name it can resolve (the model's hub id, when known)
        tokenizer = b.tokenizer_dir if caller.local or not b.hub_id else b.hub_id
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": run.lora["rank"],
                "model_name": b.name, "model_data": {"arch": b.arch, "model_name": b.name, "tokenizer_id": tokenizer},
                "optimizer_config": optimizer_config(run.optimizer_kind)}

    def forward_backward(self, caller: Caller, body: bytes) -> dict:
        try:
            req = wire.decode_forward_backward(body)
        except wire.WireError as e:
            raise HttpError(400, str(e)) from None

        tokens = sum(len(d.tokens) for d in req.data)
        run = self.runs.get(req.model_id)
        longest = max((len(d.tokens) for d in req.data), default=0)
        if run is not None and longest > run.base.max_context:  # (a run still being created checks in its job)
            raise HttpError(400, f"a datum of {longest} tokens exceeds the model's context of {run.base.max_context}")
        if tokens > self.limits.batch_tokens:
            raise HttpError(400, f"forward_backward of {tokens} tokens exceeds this server's {self.limits.batch_tokens} "
                                 "per request; send fewer datums per call")

        if req.loss_fn == "stable_reinforce":
            for i, d in enumerate(req.data):
                d.inputs["logprobs"] = self.sampling.recorded_logprobs(caller, i, d)
        custom = None
        if req.loss_fn == "custom":  # a loss this session created with create_custom_loss
            loss_id = req.loss_fn_config.get("loss_id")
            custom = self.custom_losses.get((caller.owner, loss_id)) if isinstance(loss_id, str) else None
            if custom is None:
                raise not_found(f"custom loss {loss_id!r}")

        def job():
            outs, metrics = self.runs[req.model_id].forward_backward(req.data, req.loss_fn, req.loss_fn_config,
                                                                     req.forward_only, custom)
            return wire.encode_forward_backward_output(outs, metrics)
        return self._ordered(caller, {"model_id": req.model_id, "seq_id": req.seq_id}, job)

    def create_custom_loss(self, caller: Caller, body: dict) -> dict:
        """Store a traced per-datum loss (checked against service/custom_loss.py's allowlists)."""
        from retrograd.service import custom_loss
        session = self._live_session(caller, body.get("session_id"))
        loss = custom_loss.build(body)
        loss_id = f"{session}:loss:{v.integer(body, 'custom_loss_seq_id', 0, lo=0)}"
        self.custom_losses[(caller.owner, loss_id)] = loss
        self.log(f"{caller.owner}: custom loss {loss.name!r} ({len(loss.nodes)} nodes) as {loss_id}")
        return {"request_id": self.executor.submit(caller.owner, lambda: {"type": "create_custom_loss",
                                                                            "loss_id": loss_id})}

    def optim_step(self, caller: Caller, body: dict) -> dict:
        model_id = self._run(caller, body.get("model_id"))
        run = self.runs.get(model_id)
        kind = run.optimizer_kind if run is not None else "adamw"
        # finite and in range, so a sloppy client cannot ruin the model (NaN or an absurd rate)
        if "adam_params" in body:
            if kind != "adamw":
                raise HttpError(400, f"optim_step: {model_id} was created with the {kind} optimizer; send its "
                                     "optimizer_params, not adam_params")
            p, w = v.table(body, "adam_params"), "adam_params."
            args = {"lr": v.number(p, "learning_rate", 1e-4, lo=0.0, hi=1.0, where=w),
                    "beta1": v.number(p, "beta1", 0.9, lo=0.0, hi=1.0, hi_open=True, where=w),
                    "beta2": v.number(p, "beta2", 0.95, lo=0.0, hi=1.0, hi_open=True, where=w),
                    "eps": v.number(p, "eps", 1e-12, lo=0.0, hi=1.0, lo_open=True, where=w),
                    "weight_decay": v.number(p, "weight_decay", 0.0, lo=0.0, hi=1.0, where=w),
                    "grad_clip_norm": v.number(p, "grad_clip_norm", 0.0, lo=0.0, where=w)}
        elif "optimizer_params" in body:
            p, w = v.table(body, "optimizer_params"), "optimizer_params."
            if p.get("type") != kind:
                raise HttpError(400, f"optim_step: optimizer_params of type {p.get('type')!r}, but {model_id} uses "
                                     f"{kind}")
            unknown = sorted(set(p) - {"type", "learning_rate", "grad_clip_norm", "beta1"})
            if unknown:
                raise HttpError(400, f"optim_step: optimizer_params {unknown} are not Dimuon's")
            args = {"lr": v.number(p, "learning_rate", 1e-4, lo=0.0, hi=1.0, where=w),
                    "beta1": v.number(p, "beta1", 0.9, lo=0.0, hi=1.0, hi_open=True, where=w),
                    "grad_clip_norm": max(0.0, v.number(p, "grad_clip_norm", 0.0, where=w))}
        else:
            raise HttpError(400, "optim_step needs adam_params (AdamW) or optimizer_params (Dimuon)")

        def job():
            m = self.runs[model_id].optim_step(**args)
            self.registry.touch_run(model_id)
            return {"type": "optim_step", "metrics": m}
        return self._ordered(caller, body, job)

def optimizer_kind(config: dict) -> str:
    """Tinker's optimizer_config at creation: {"type": "adamw"} (default) or {"type": "dimuon", "version": 1}."""
    kind = config.get("type", "adamw")
    if kind == "dimuon" and config.get("version", 1) == 1 and set(config) <= {"type", "version"}:
        return "dimuon"
    if kind == "adamw" and set(config) <= {"type"}:
        return "adamw"
    raise HttpError(400, f"optimizer_config {config!r:.120} is not supported here: adamw, or dimuon version 1")


def optimizer_config(kind: str) -> dict:
    return {"type": "dimuon", "version": 1} if kind == "dimuon" else {"type": "adamw"}
