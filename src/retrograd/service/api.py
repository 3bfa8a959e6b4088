"""Tinker's training, sampling and checkpoint endpoints, as methods of `Service` (HTTP routing and
auth are in service/http.py). Ids follow the SDK's hard-coded contracts: session = uuid4,
model_id = "{session}:train:{n}", sampler = "{session}:sample:{n}", checkpoint paths
"tinker://{model_id}/weights/{name}" (state + optimizer) and ".../sampler_weights/{name}".

Ownership: every session, run, sampler and checkpoint belongs to the API key's owner; a lookup by
another owner answers "not found", exactly as for an id that never existed.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retrograd.checkpoint.state import verify_state
from retrograd.models.logprobs import Scorer
from retrograd.service.engine import BaseModel, Run, sample_sequences
from retrograd.service.futures import Executor, JobError
from retrograd.service.registry import Caller, CheckpointRow, Registry
from retrograd.service.storage import CheckpointStore, Signer
from retrograd.service import wire

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_ID_RE = re.compile(r"^[0-9a-f-]{36}:train:\d{1,9}$")
KIND_SEGMENT = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}
URL_TTL_S = 3600
SESSION_IDLE_S = 1800  # a session without a heartbeat this long is finished (its runs leave memory)
LORA_ALPHA = 32.0  # Tinker's LoRA config has no alpha: a server-wide setting (--lora-alpha), kept in manifests


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def not_found(what: str) -> HttpError:
    return HttpError(404, f"{what} not found (it does not exist, has expired, or belongs to another owner)")


@dataclass
class Sampler:
    sampler_id: str
    owner: str
    base: BaseModel
    model_path: str | None  # the tinker path it was made from, if any
    tensors: dict | None  # adapter tensors; None samples the base model
    lora: dict | None
    origin_run: str | None


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
            "tinker_path": row.tinker_path, "size_bytes": row.size_bytes, "public": False,
            "user_metadata": row.user_metadata, "expires_at": iso(row.expires_at),
            "session_id": row.session_id, "step": row.step}


class Service:
    def __init__(self, state_dir: Path, bases: dict[str, BaseModel], model_policy: dict[str, str] | None = None,
                 log=print, lora_alpha: float = LORA_ALPHA):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
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
        self.samplers: dict[str, Sampler] = {}
        self.hosts: dict[tuple, Run] = {}  # models that carry sampler tensors when their run is not live
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
        if name not in self.bases:
            raise HttpError(400, f"base_model {name!r} is not served here; served: {', '.join(self.bases)} "
                                 "(retrograd serve --models ...)")
        return self.bases[name]

    def _run(self, caller: Caller, model_id) -> str:
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

    def _checkpoint(self, caller: Caller, path: str) -> CheckpointRow:
        parse_path(path)
        row = self.registry.checkpoint(path, caller.owner)
        if row is None:
            raise not_found(f"checkpoint {path}")
        return row

    def _ordered(self, caller, body, fn) -> dict:
        model_id = self._run(caller, body.get("model_id"))
        seq = body.get("seq_id")
        if not isinstance(seq, int):
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
            for sid in [s for s in self.samplers if s.startswith(prefix)]:
                del self.samplers[sid]
            self.log(f"session {session_id} finished; its models left memory")
        self.executor.submit("server", drop)

    def _drop_idle_sessions(self) -> None:
        cutoff = time.time() - SESSION_IDLE_S
        for session_id in [s for s, t in list(self.last_seen.items()) if t < cutoff]:
            self.log(f"session {session_id}: no heartbeat for {SESSION_IDLE_S} s, releasing its models")
            self._release(session_id)

    # ---- training ------------------------------------------------------------------------------
    def create_model(self, caller: Caller, body: dict) -> dict:
        session = self._live_session(caller, body.get("session_id"))
        base = self._base(body.get("base_model"))
        lora = body.get("lora_config") or {}
        if not lora:
            raise HttpError(400, "only LoRA training clients are served here: lora_config is required")
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise HttpError(400, f"optimizer {opt!r} is not supported here (only adamw)")
        model_id = f"{session}:train:{int(body.get('model_seq_id', 0))}"
        if self.executor.has_model(model_id):
            raise HttpError(409, f"model {model_id} already exists in this session")
        seed = lora.get("seed")
        seed = int(seed) if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        meta = body.get("user_metadata")

        def create():
            run = Run.create(model_id, base, int(lora.get("rank", 32)), self.lora_alpha, seed,
                             bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True)),
                             bool(lora.get("train_unembed", True)))
            self.runs[model_id] = run
            self.registry.add_run(model_id, session, caller.owner, base.name, run.lora, meta)
            self.log(f"{caller.owner}: created {model_id} on {base.name} (LoRA r={run.lora['rank']}, "
                     f"{', '.join(run.lora['modules'])})")
            return {"type": "create_model", "model_id": model_id}

        self.run_owner[model_id] = caller.owner
        self.executor.open_model(model_id, 1)
        return {"request_id": self.executor.submit(caller.owner, create), "model_id": model_id}

    def get_info(self, caller: Caller, body: dict) -> dict:
        model_id = self._run(caller, body.get("model_id"))
        run = self.runs.get(model_id)
        if run is None:
            raise HttpError(409, f"model {model_id} is still being created; wait for its future")
        b = run.base
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": run.lora["rank"],
                "model_name": b.name, "model_data": {"arch": b.arch, "model_name": b.name, "tokenizer_id": b.tokenizer_dir},
                "optimizer_config": {"type": "adamw"}}

    def forward_backward(self, caller: Caller, body: bytes) -> dict:
        try:
            req = wire.decode_forward_backward(body)
        except wire.WireError as e:
            raise HttpError(400, str(e)) from None

        def job():
            outs, metrics = self.runs[req.model_id].forward_backward(req.data, req.loss_fn, req.loss_fn_config,
                                                                     req.forward_only)
            return wire.encode_forward_backward_output(outs, metrics)
        return self._ordered(caller, {"model_id": req.model_id, "seq_id": req.seq_id}, job)

    def optim_step(self, caller: Caller, body: dict) -> dict:
        if "adam_params" not in body:
            raise HttpError(400, "optim_step: only adam_params (AdamW) is supported here")
        p = body["adam_params"] or {}
        try:
            args = {k: float(p.get(k, d)) for k, d in (("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95),
                                                       ("eps", 1e-12), ("weight_decay", 0.0), ("grad_clip_norm", 0.0))}
        except (TypeError, ValueError):
            raise HttpError(400, f"optim_step: adam_params must be numbers, got {p!r}") from None
        if args["learning_rate"] < 0 or not 0 <= args["beta1"] < 1 or not 0 <= args["beta2"] < 1:
            raise HttpError(400, f"optim_step: adam_params out of range: {args}")
        model_id = body.get("model_id")

        def job():
            m = self.runs[model_id].optim_step(args["learning_rate"], args["beta1"], args["beta2"], args["eps"],
                                               args["weight_decay"], args["grad_clip_norm"])
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
        overwrite, meta = bool(body.get("overwrite", False)), body.get("user_metadata")

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
                         "service": {"tinker_path": path, "kind": kind, "lora": run.lora, "base_model": run.base.name}}
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
        sampler_id = f"{model_id.split(':')[0]}:sample:{int(body.get('sampling_session_seq_id') or 0)}"

        def job():
            run = self.runs[model_id]
            self.samplers[sampler_id] = Sampler(sampler_id, caller.owner, run.base, None, run.snapshot(), run.lora,
                                                model_id)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        return self._ordered(caller, body, job)

    def load_weights(self, caller: Caller, body: dict) -> dict:
        row = self._checkpoint(caller, body.get("path"))
        if row.kind != "training":
            raise HttpError(400, f"{row.tinker_path} is a {row.kind} checkpoint (weights only); training resumes from a "
                                 "tinker://.../weights/NAME path saved by save_state")
        with_optimizer = bool(body.get("optimizer", False))
        folder = self.store.folder(row.storage_id)
        manifest = verify_state(folder)
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
        model_id = f"{session}:train:{int(body.get('model_seq_id', 0))}"
        meta = body.get("user_metadata")
        lora = info["lora"]

        def create():
            run = Run.create(model_id, base, lora["rank"], lora["alpha"], lora.get("seed", 0), lora["train_attn"],
                             lora["train_mlp"], lora.get("train_unembed", False))
            self._restore(run, folder, row, with_optimizer)
            self.runs[model_id] = run
            self.registry.add_run(model_id, session, caller.owner, base.name, run.lora, meta)
            self.log(f"{caller.owner}: created {model_id} from {row.tinker_path} (step {run.steps}"
                     f"{', with optimizer state' if with_optimizer else ''})")
            return {"type": "load_weights", "model_id": model_id, "path": row.tinker_path}

        self.run_owner[model_id] = caller.owner
        self.executor.open_model(model_id, 1)
        # this request is the model's seq 0 (the SDK's create-via-load); its ops continue at 1
        return {"request_id": self.executor.submit(caller.owner, create), "model_id": model_id}

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

    # ---- sampling ------------------------------------------------------------------------------
    def create_sampling_session(self, caller: Caller, body: dict) -> dict:
        session = self._live_session(caller, body.get("session_id"))
        sampler_id = f"{session}:sample:{int(body.get('sampling_session_seq_id') or 0)}"
        self.samplers[sampler_id] = self._make_sampler(caller, sampler_id, body.get("model_path"), body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _make_sampler(self, caller: Caller, sampler_id: str, model_path, base_model) -> Sampler:
        if model_path:
            row = self._checkpoint(caller, model_path)
            if row.kind == "external":
                raise HttpError(400, f"{row.tinker_path} is an external (PEFT) export; sample from its "
                                     "sampler_weights or weights checkpoint")
            folder = self.store.folder(row.storage_id)
            info = verify_state(folder)["service"]
            base = self._base(info["base_model"])
            self._may_sample(caller, base.name)
            return Sampler(sampler_id, caller.owner, base, row.tinker_path,
                           load_file(str(folder / "weights.safetensors")), info["lora"], row.run_id)
        base = self._base(base_model)
        self._may_sample(caller, base.name)
        return Sampler(sampler_id, caller.owner, base, None, None, None, None)

    def get_sampler(self, caller: Caller, sampler_id: str) -> dict:
        s = self.samplers.get(sampler_id)
        if s is None or s.owner != caller.owner:
            raise not_found(f"sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": s.base.name, "model_path": s.model_path}

    def asample(self, caller: Caller, body: dict) -> dict:
        sid = body.get("sampling_session_id")
        if sid is not None:
            sampler = self.samplers.get(sid)
            if sampler is None or sampler.owner != caller.owner:
                raise not_found(f"sampling session {sid!r}")
        else:
            sampler = self._make_sampler(caller, "adhoc", body.get("model_path"), body.get("base_model"))
        self._may_sample(caller, sampler.base.name)
        prompt = []
        for chunk in (body.get("prompt") or {}).get("chunks", []):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise HttpError(400, f"prompt chunks of type {chunk.get('type')!r} are not supported (text only)")
            prompt.extend(int(t) for t in chunk.get("tokens", []))
        n = int(body.get("num_samples", 1))
        if not 1 <= n <= 256:
            raise HttpError(400, f"num_samples must be 1..256, got {n}")
        params = body.get("sampling_params") or {}
        want_prompt_lp = bool(body.get("prompt_logprobs")) or int(body.get("topk_prompt_logprobs") or 0) > 0
        topk = int(body.get("topk_prompt_logprobs") or 0)

        def job():
            with self._sampling_model(sampler) as model:
                seqs = sample_sequences(model, sampler.base.tokenizer, prompt, n, params, sampler.base.max_context)
                plp, top = Scorer(model).prompt_logprobs(prompt, topk) if want_prompt_lp else (None, None)
            return wire.encode_sample_response(seqs, plp if body.get("prompt_logprobs") else None, top)

        request_id = self.executor.submit(caller.owner, job)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}

    def _sampling_model(self, sampler: Sampler):
        """A model carrying the sampler's weights: its run's own model when that run is live in this
        server, else a host model with the same LoRA layout (made once per layout)."""
        from contextlib import nullcontext
        if sampler.tensors is None:
            return nullcontext(sampler.base.model)
        run = self.runs.get(sampler.origin_run)
        if run is None or run.lora["modules"] != sampler.lora["modules"] or run.lora["rank"] != sampler.lora["rank"]:
            key = (sampler.base.name, sampler.lora["rank"], sampler.lora["alpha"], tuple(sampler.lora["modules"]))
            if key not in self.hosts:
                lo = sampler.lora
                self.hosts[key] = Run.create("host", sampler.base, lo["rank"], lo["alpha"], 0, lo["train_attn"],
                                             lo["train_mlp"], lo.get("train_unembed", False))
            run = self.hosts[key]
        return run.swapped_adapter(sampler.tensors)
