"""Tinker's checkpoint endpoints, as `Checkpoints`, which the `Service` (service/api.py) holds beside
`Sampling`: save_weights (state + optimizer), save_weights_for_sampler (weights, or an ephemeral
sampler), save_weights_external (a PEFT adapter folder), load_weights (into a run, or a new run
from a checkpoint) and copy_weights; plus checkpoint paths and their JSON form, which the REST
endpoints (service/rest.py) share.

Paths: "tinker://{model_id}/weights/{name}" (state + optimizer), ".../sampler_weights/{name}" and
".../external_weights/{name}". A checkpoint belongs to the API key's owner; another owner reads it
only once it is published, and a lookup that fails answers "not found" either way.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retrograd.checkpoint.state import verify_state
from retrograd.errors import CheckpointError
from retrograd.service import validate as v
from retrograd.service.engine import Run
from retrograd.service.errors import HttpError, not_found
from retrograd.service.futures import JobError
from retrograd.service.registry import Caller, CheckpointRow
from retrograd.service.sampling import Sampler

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_ID_RE = re.compile(r"^[0-9a-f-]{36}:train:\d{1,9}$")
KIND_SEGMENT = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}


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


class Checkpoints:
    def __init__(self, svc):
        self.svc = svc  # the Service: its registry, store, runs and request ordering

    def find(self, caller: Caller, path: str, readable: bool = False) -> CheckpointRow:
        """The caller's checkpoint at `path`; with `readable`, also another owner's published one."""
        parse_path(path)
        row = (self.svc.registry.readable_checkpoint if readable else self.svc.registry.checkpoint)(path, caller.owner)
        if row is None:
            raise not_found(f"checkpoint {path}")
        return row

    def verified(self, row: CheckpointRow) -> tuple[Path, dict]:
        """The checkpoint's folder and manifest, its files checked against their SHA-256. A damaged
        one is a client-visible, non-retryable 400 that names the checkpoint (paths stay in the log)."""
        folder = self.svc.store.folder(row.storage_id)
        try:
            return folder, verify_state(folder)
        except CheckpointError as e:
            self.svc.log(f"checkpoint {row.tinker_path} is damaged: {e}")
            raise HttpError(400, f"checkpoint {row.tinker_path} is damaged (a file is missing or does not match "
                                 "the SHA-256 recorded when it was saved) and cannot be loaded; delete it and use "
                                 "another checkpoint") from None

    def _save(self, caller, body, kind: str) -> dict:
        model_id = self.svc._run(caller, body.get("model_id"))
        name = body.get("path")
        if name is not None and (not isinstance(name, str) or not NAME_RE.match(name)):
            raise HttpError(400, f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' "
                                 "(at most 128, not starting with a symbol)")
        ttl = body.get("ttl_seconds")
        if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
            raise HttpError(400, f"ttl_seconds must be a positive integer, got {ttl!r}")
        overwrite, meta = v.boolean(body, "overwrite", False), body.get("user_metadata")
        used = self.svc.registry.disk_bytes(caller.owner)
        if used >= self.svc.limits.disk_bytes_per_owner:
            raise HttpError(403, f"owner {caller.owner!r} has {used / 1e9:.1f} GB of checkpoints, the server's limit "
                                 f"(--max-disk-gb-per-owner); delete some (RestClient.delete_checkpoint) or set TTLs")

        def job():
            run = self.svc.runs[model_id]
            label = name or f"{run.steps:06d}"
            path = f"tinker://{model_id}/{KIND_SEGMENT[kind]}/{label}"
            if not overwrite and self.svc.registry.checkpoint(path, caller.owner) is not None:
                raise JobError(f"checkpoint {path} already exists; pass overwrite=True or another name")
            self._write(caller.owner, run, kind, label, path, ttl, meta, replace=overwrite)
            return {"type": {"training": "save_weights", "sampler": "save_weights_for_sampler",
                             "external": "save_weights_external"}[kind], "path": path}
        return self.svc._ordered(caller, body, job)

    def _write(self, owner, run: Run, kind, label, path, ttl, meta, replace) -> None:
        self.svc.sweep_expired()

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
        storage_id, files, size = self.svc.store.save(label, payload, manifest_meta)
        now = time.time()
        old = self.svc.registry.checkpoint(path, owner) if replace else None
        row = CheckpointRow(path, storage_id, owner, run.run_id.split(":")[0], run.run_id, kind, label, run.steps,
                            files, size, now, now + ttl if ttl else None, meta)
        self.svc.registry.add_checkpoint(row, replace=replace)
        if old is not None:
            self.svc.store.remove(old.storage_id)
        self.svc.log(f"{owner}: saved {path} (step {run.steps}, {size / 1e6:.1f} MB)")

    def save_weights(self, caller: Caller, body: dict) -> dict:
        return self._save(caller, body, "training")

    def save_weights_external(self, caller: Caller, body: dict) -> dict:
        return self._save(caller, body, "external")

    def save_weights_for_sampler(self, caller: Caller, body: dict) -> dict:
        if body.get("path") is not None:
            return self._save(caller, body, "sampler")
        # ephemeral: save_weights_and_get_sampling_client
        model_id = self.svc._run(caller, body.get("model_id"))
        run_base = self.svc.runs[model_id].base.name if model_id in self.svc.runs else None
        self.svc._may_sample(caller, run_base)
        sampler_id = f"{model_id.split(':')[0]}:sample:{v.integer(body, 'sampling_session_seq_id', 0, lo=0)}"

        def job():
            run = self.svc.runs[model_id]
            self.svc.sampling.keep(sampler_id, Sampler(sampler_id, caller.owner, run.base, None, run.snapshot(),
                                                       run.lora, model_id))
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        return self.svc._ordered(caller, body, job)

    def load_weights(self, caller: Caller, body: dict) -> dict:
        row = self.find(caller, body.get("path"), readable=True)
        if row.kind != "training":
            raise HttpError(400, f"{row.tinker_path} is a {row.kind} checkpoint (weights only); training resumes from a "
                                 "tinker://.../weights/NAME path saved by save_state")
        with_optimizer = v.boolean(body, "optimizer", False)
        folder, manifest = self.verified(row)
        info = manifest["service"]
        if body.get("session_id") is None:  # legacy: load into an existing model, in order
            model_id = body.get("model_id")

            def job():
                self._restore(self.svc.runs[model_id], folder, row, with_optimizer)
                return {"type": "load_weights", "path": row.tinker_path}
            return self.svc._ordered(caller, body, job)
        session = self.svc._live_session(caller, body["session_id"])
        base = self.svc._base(info["base_model"])
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
            self.svc.runs[model_id] = run
            self.svc.registry.add_run(model_id, session, caller.owner, base.name, run.lora, meta)
            self.svc.log(f"{caller.owner}: created {model_id} from {row.tinker_path} (step {run.steps}"
                         f"{', with optimizer state' if with_optimizer else ''})")
            return {"type": "load_weights", "model_id": model_id, "path": row.tinker_path}
        # this request is the model's seq 0 (the SDK's create-via-load); its ops continue at 1
        return self.svc._new_model(caller, model_id, create)

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
        row = self.find(caller, v.string(body, "source_path"), readable=True)
        folder, manifest = self.verified(row)
        ttl = v.integer(body, "ttl_seconds", None, lo=3600, hi=10 * 365 * 86400)
        session = v.string(body, "session_id", required=False)
        if session is not None:
            run_id = f"{self.svc._live_session(caller, session)}:train:{v.integer(body, 'model_seq_id', 0, lo=0)}"
        else:
            session = str(uuid.uuid4())
            self.svc.registry.add_session(session, caller.owner, ["copy"], {})
            run_id = f"{session}:train:0"
        path = f"tinker://{run_id}/{KIND_SEGMENT[row.kind]}/{row.name}"
        if self.svc.registry.checkpoint(path, caller.owner) is not None:
            raise HttpError(409, f"{path} already exists")
        storage_id = self.svc.store.copy(row.storage_id)
        info = manifest["service"]
        if self.svc.registry.run(run_id, caller.owner) is None:
            self.svc.registry.add_run(run_id, session, caller.owner, info["base_model"], info["lora"], {})
        now = time.time()
        copy = CheckpointRow(path, storage_id, caller.owner, session, run_id, row.kind, row.name, row.step, row.files,
                             row.size_bytes, now, now + ttl if ttl else None, row.user_metadata)
        self.svc.registry.add_checkpoint(copy, replace=False)
        self.svc.log(f"{caller.owner}: copied {row.tinker_path} to {path}")
        return {"tinker_path": path}
