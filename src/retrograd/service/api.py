"""Tinker's training, sampling and checkpoint endpoints, as methods of `Service` (HTTP routing and
auth are in service/http.py). Ids follow the SDK's hard-coded contracts: session = uuid4,
model_id = "{session}:train:{n}", sampler = "{session}:sample:{n}", checkpoint paths
"tinker://{model_id}/weights/{name}" (state + optimizer) and ".../sampler_weights/{name}".

Ownership: every session, run, sampler and checkpoint belongs to the API key's owner; a lookup by
another owner answers "not found", exactly as for an id that never existed.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retrograd.checkpoint.state import verify_state
from retrograd.errors import CheckpointError
from retrograd.service.engine import BaseModel, Run
from retrograd.service.futures import Executor, JobError
from retrograd.service.registry import Caller, CheckpointRow, Registry
from retrograd.service.sampling import Sampler, Sampling
from retrograd.service.storage import CheckpointStore, Signer
from retrograd.service import validate as v, wire
from retrograd.service.errors import HttpError, not_found

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_ID_RE = re.compile(r"^[0-9a-f-]{36}:train:\d{1,9}$")
KIND_SEGMENT = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}
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


def parse_path(path: str) -> tuple[str, str, str]:
    """tinker://RUN/SEGMENT/NAME -> (run_id, kind, name), validated; else a 400."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise HttpError(400, f"checkpoint path {path!r} must look like tinker://MODEL_ID/weights/NAME")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENT_KIND or not RUN_ID_RE.match(parts[0]) or not NAME_RE.match(parts[2]):
        raise HttpError(400, f"checkpoint path {path!r} is not a valid tinker://MODEL_ID/weights|sampler_weights/NAME")
    return parts[0], SEGMENT_KIND[parts[1]], parts[2]


def iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def checkpoint_json(row: CheckpointRow) -> dict:
    return {"checkpoint_id": row.checkpoint_id, "checkpoint_type": row.kind, "time": iso(row.created),
            "tinker_path": row.tinker_path, "size_bytes": row.size_bytes, "public": row.public,
            "user_metadata": row.user_metadata, "expires_at": iso(row.expires_at),
            "session_id": row.session_id, "step": row.step}


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

    def _checkpoint(self, caller: Caller, path: str, readable: bool = False) -> CheckpointRow:
        """The caller's checkpoint at `path`; with `readable`, also another owner's published one."""
        parse_path(path)
        row = (self.registry.readable_checkpoint if readable else self.registry.checkpoint)(path, caller.owner)
        if row is None:
            raise not_found(f"checkpoint {path}")
        return row

    def _verified(self, row: CheckpointRow) -> tuple[Path, dict]:
        """The checkpoint's folder and manifest, its files checked against their SHA-256. A damaged
        one is a client-visible, non-retryable 400 that names the checkpoint (paths stay in the log)."""
        folder = self.store.folder(row.storage_id)
        try:
            return folder, verify_state(folder)
        except CheckpointError as e:
            self.log(f"checkpoint {row.tinker_path} is damaged: {e}")
            raise HttpError(400, f"checkpoint {row.tinker_path} is damaged (a file is missing or does not match "
                                 "the SHA-256 recorded when it was saved) and cannot be loaded; delete it and use "
                                 "another checkpoint") from None

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

    # ---- checkpoints ---------------------------------------------------------------------------
    def _save(self, caller, body, kind: str) -> dict:
        model_id = self._run(caller, body.get("model_id"))
        name = body.get("path")
        if name is not None and (not isinstance(name, str) or not NAME_RE.match(name)):
            raise HttpError(400, f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' "
                                 "(at most 128, not starting with a symbol)")
        ttl = body.get("ttl_seconds")
        if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
            raise HttpError(400, f"ttl_seconds must be a positive integer, got {ttl!r}")
        overwrite, meta = v.boolean(body, "overwrite", False), body.get("user_metadata")
        used = self.registry.disk_bytes(caller.owner)
        if used >= self.limits.disk_bytes_per_owner:
            raise HttpError(403, f"owner {caller.owner!r} has {used / 1e9:.1f} GB of checkpoints, the server's limit "
                                 f"(--max-disk-gb-per-owner); delete some (RestClient.delete_checkpoint) or set TTLs")

        def job():
            run = self.runs[model_id]
            label = name or f"{run.steps:06d}"
            path = f"tinker://{model_id}/{KIND_SEGMENT[kind]}/{label}"
            if not overwrite and self.registry.checkpoint(path, caller.owner) is not None:
                raise JobError(f"checkpoint {path} already exists; pass overwrite=True or another name")
            self._write_checkpoint(caller.owner, run, kind, label, path, ttl, meta, replace=overwrite)
            return {"type": {"training": "save_weights", "sampler": "save_weights_for_sampler",
                             "external": "save_weights_external"}[kind], "path": path}
        return self._ordered(caller, body, job)

    def _write_checkpoint(self, owner, run: Run, kind, label, path, ttl, meta, replace) -> None:
        self.sweep_expired()
        def payload(folder: Path) -> None:
            if kind == "external":  # a PEFT adapter folder: loads in HF transformers / PEFT and vLLM
                from peft import get_peft_model_state_dict
                state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(run.model).items()}
                save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
                run.model.peft_config["default"].save_pretrained(str(folder))
                return
            save_file({n: p.detach().contiguous() for n, p in run.params.items()}, str(folder / "weights.safetensors"))
            if kind == "training":
                torch.save(run.ensure_optimizer().state_dict(), folder / "optimizer.pt")
            (folder / "progress.json").write_text(json.dumps({"step": run.steps}))
        lora = {k: run.lora[k] for k in ("rank", "alpha", "modules")} | {"dtype": "float32"}
        manifest_meta = {"algorithm": "service", "step": run.steps, "fingerprints": {}, "settings": {},
                         "base": {"model": run.base.path, "dtype": "float32", "trainable": "lora", "lora": lora},
                         "service": {"tinker_path": path, "kind": kind, "lora": run.lora, "base_model": run.base.name,
                                     "optimizer": run.optimizer_kind}}
        storage_id, files, size = self.store.save(label, payload, manifest_meta)
        now = time.time()
        old = self.registry.checkpoint(path, owner) if replace else None
        self.registry.add_checkpoint(CheckpointRow(path, storage_id, owner, run.run_id.split(":")[0], run.run_id, kind,
                                                   label, run.steps, files, size, now,
                                                   now + ttl if ttl else None, meta), replace=replace)
        if old is not None:
            self.store.remove(old.storage_id)
        self.log(f"{owner}: saved {path} (step {run.steps}, {size / 1e6:.1f} MB)")

    def save_weights(self, caller: Caller, body: dict) -> dict:
        return self._save(caller, body, "training")

    def save_weights_external(self, caller: Caller, body: dict) -> dict:
        return self._save(caller, body, "external")

    def save_weights_for_sampler(self, caller: Caller, body: dict) -> dict:
        if body.get("path") is not None:
            return self._save(caller, body, "sampler")
        # ephemeral: save_weights_and_get_sampling_client
        model_id = self._run(caller, body.get("model_id"))
        run_base = self.runs[model_id].base.name if model_id in self.runs else None
        self._may_sample(caller, run_base)
        sampler_id = f"{model_id.split(':')[0]}:sample:{v.integer(body, 'sampling_session_seq_id', 0, lo=0)}"

        def job():
            run = self.runs[model_id]
            self.sampling.keep(sampler_id, Sampler(sampler_id, caller.owner, run.base, None, run.snapshot(), run.lora,
                                                   model_id))
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        return self._ordered(caller, body, job)

    def load_weights(self, caller: Caller, body: dict) -> dict:
        row = self._checkpoint(caller, body.get("path"), readable=True)
        if row.kind != "training":
            raise HttpError(400, f"{row.tinker_path} is a {row.kind} checkpoint (weights only); training resumes from a "
                                 "tinker://.../weights/NAME path saved by save_state")
        with_optimizer = v.boolean(body, "optimizer", False)
        folder, manifest = self._verified(row)
        info = manifest["service"]
        if body.get("session_id") is None:  # legacy: load into an existing model, in order
            model_id = body.get("model_id")

            def job():
                self._restore(self.runs[model_id], folder, row, with_optimizer)
                return {"type": "load_weights", "path": row.tinker_path}
            return self._ordered(caller, body, job)
        session = self._live_session(caller, body["session_id"])
        base = self._base(info["base_model"])
        if body.get("base_model") not in (None, base.name):
            raise HttpError(400, f"{row.tinker_path} was trained on {base.name}, not {body['base_model']}")
        model_id = f"{session}:train:{v.integer(body, 'model_seq_id', 0, lo=0)}"
        meta = body.get("user_metadata")
        lora = info["lora"]

        def create():
            run = Run.create(model_id, base, lora["rank"], lora["alpha"], lora.get("seed", 0), lora["train_attn"],
                             lora["train_mlp"], lora.get("train_unembed", False))
            run.optimizer_kind = info.get("optimizer", "adamw")
            self._restore(run, folder, row, with_optimizer)
            self.runs[model_id] = run
            self.registry.add_run(model_id, session, caller.owner, base.name, run.lora, meta)
            self.log(f"{caller.owner}: created {model_id} from {row.tinker_path} (step {run.steps}"
                     f"{', with optimizer state' if with_optimizer else ''})")
            return {"type": "load_weights", "model_id": model_id, "path": row.tinker_path}
        # this request is the model's seq 0 (the SDK's create-via-load); its ops continue at 1
        return self._new_model(caller, model_id, create)

    def _restore(self, run: Run, folder: Path, row: CheckpointRow, with_optimizer: bool) -> None:
        run.load_tensors(load_file(str(folder / "weights.safetensors")), row.tinker_path)
        run.steps = json.loads((folder / "progress.json").read_text())["step"]
        if with_optimizer:
            state = torch.load(folder / "optimizer.pt", weights_only=True)
            run.ensure_optimizer().load_state_dict(state)
        else:
            run.optimizer = None
        for p in run.params.values():
            p.grad = None

    def copy_weights(self, caller: Caller, body: dict) -> dict:
        """A copy of a checkpoint (the caller's own, or a published one) owned by the caller: under
        session_id + model_seq_id when given, else under a new training-run id of its own."""
        row = self._checkpoint(caller, v.string(body, "source_path"), readable=True)
        folder, manifest = self._verified(row)
        ttl = v.integer(body, "ttl_seconds", None, lo=3600, hi=10 * 365 * 86400)
        session = v.string(body, "session_id", required=False)
        if session is not None:
            run_id = f"{self._live_session(caller, session)}:train:{v.integer(body, 'model_seq_id', 0, lo=0)}"
        else:
            session = str(uuid.uuid4())
            self.registry.add_session(session, caller.owner, ["copy"], {})
            run_id = f"{session}:train:0"
        path = f"tinker://{run_id}/{KIND_SEGMENT[row.kind]}/{row.name}"
        if self.registry.checkpoint(path, caller.owner) is not None:
            raise HttpError(409, f"{path} already exists")
        storage_id = self.store.copy(row.storage_id)
        info = manifest["service"]
        if self.registry.run(run_id, caller.owner) is None:
            self.registry.add_run(run_id, session, caller.owner, info["base_model"], info["lora"], {})
        now = time.time()
        self.registry.add_checkpoint(CheckpointRow(path, storage_id, caller.owner, session, run_id, row.kind, row.name,
                                                   row.step, row.files, row.size_bytes, now, now + ttl if ttl else None,
                                                   row.user_metadata), replace=False)
        self.log(f"{caller.owner}: copied {row.tinker_path} to {path}")
        return {"tinker_path": path}


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
