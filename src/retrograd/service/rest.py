"""The SDK's RestClient endpoints (training runs, checkpoints, TTL, deletion, weights info) and
retrograd's download endpoints: a checkpoint's manifest (files, sizes, SHA-256) with signed URLs,
and the signed file download itself. All reads are owner-scoped through the registry."""
from __future__ import annotations

import time

from retrograd.service.api import URL_TTL_S, HttpError, Service, not_found, optimizer_config
from retrograd.service.checkpoints import checkpoint_json, iso, parse_path
from retrograd.service.registry import Caller


def _page(query: dict, default_limit: int) -> tuple[int, int]:
    try:
        limit = int(query.get("limit", default_limit))
        offset = int(query.get("offset", 0))
    except ValueError:
        raise HttpError(400, "limit and offset must be integers") from None
    if not 1 <= limit <= 1000 or offset < 0:
        raise HttpError(400, "limit must be 1..1000 and offset >= 0")
    return limit, offset


def _run_json(svc: Service, run: dict) -> dict:
    ckpts, _ = svc.registry.checkpoints(run["owner"], run_id=run["run_id"], limit=1000)
    last = {k: next((checkpoint_json(c) for c in ckpts if c.kind == k), None) for k in ("training", "sampler")}
    meta = {str(k): str(v) for k, v in (run["user_metadata"] or {}).items()}
    return {"training_run_id": run["run_id"], "base_model": run["base_model"], "model_owner": run["owner"],
            "is_lora": True, "corrupted": False, "lora_rank": run["lora"]["rank"],
            "last_request_time": iso(run["last_request"]), "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"], "user_metadata": meta or None}


def list_runs(svc: Service, caller: Caller, query: dict) -> dict:
    limit, offset = _page(query, 20)
    runs, total = svc.registry.runs(caller.owner, limit, offset)
    return {"training_runs": [_run_json(svc, r) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def get_run(svc: Service, caller: Caller, run_id: str) -> dict:
    run = svc.registry.run(run_id, caller.owner)
    if run is None:
        raise not_found(f"training run {run_id!r}")
    return _run_json(svc, run)


def list_checkpoints(svc: Service, caller: Caller, query: dict, run_id: str | None = None,
                     session_id: str | None = None) -> dict:
    limit, offset = _page(query, 100)
    if run_id is not None and svc.registry.run(run_id, caller.owner) is None:
        raise not_found(f"training run {run_id!r}")
    if session_id is not None and svc.registry.session(session_id, caller.owner) is None:
        raise not_found(f"session {session_id!r}")
    rows, total = svc.registry.checkpoints(caller.owner, run_id=run_id, session_id=session_id, limit=limit,
                                           offset=offset)
    return {"checkpoints": [checkpoint_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def _path(run_id: str, checkpoint_id: str) -> str:
    path = f"tinker://{run_id}/{checkpoint_id}"
    parse_path(path)
    return path


def delete_checkpoint(svc: Service, caller: Caller, run_id: str, checkpoint_id: str) -> dict:
    row = svc.registry.delete_checkpoint(_path(run_id, checkpoint_id), caller.owner)
    if row is None:
        raise not_found(f"checkpoint tinker://{run_id}/{checkpoint_id}")
    svc.store.remove(row.storage_id)
    return {}


def publish(svc: Service, caller: Caller, run_id: str, checkpoint_id: str, public: bool) -> dict:
    """Publish (or unpublish) an owned checkpoint: every owner of this server may then load it, read-only."""
    if not svc.registry.set_public(_path(run_id, checkpoint_id), caller.owner, public):
        raise not_found(f"checkpoint tinker://{run_id}/{checkpoint_id}")
    return {}


def set_ttl(svc: Service, caller: Caller, run_id: str, checkpoint_id: str, body: dict) -> dict:
    ttl = body.get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
        raise HttpError(400, f"ttl_seconds must be a positive integer or null, got {ttl!r}")
    if not svc.registry.set_ttl(_path(run_id, checkpoint_id), caller.owner, time.time() + ttl if ttl else None):
        raise not_found(f"checkpoint tinker://{run_id}/{checkpoint_id}")
    return {}


def weights_info(svc: Service, caller: Caller, body: dict) -> dict:
    row = svc.checkpoints.find(caller, body.get("tinker_path"), readable=True)
    run = svc.registry.run(row.run_id, row.owner)
    lora = run["lora"]
    return {"base_model": run["base_model"], "is_lora": True, "lora_rank": lora["rank"],
            "train_attn": lora["train_attn"], "train_mlp": lora["train_mlp"],
            "train_unembed": False, "optimizer_config": optimizer_config(row_optimizer(svc, row))}


def row_optimizer(svc: Service, row) -> str:
    """The optimizer a checkpoint was trained with (its manifest's; adamw before Dimuon existed)."""
    try:
        _, meta = svc.checkpoints.verified(row)
    except HttpError:
        return "adamw"
    return meta.get("service", {}).get("optimizer", "adamw")


def manifest(svc: Service, caller: Caller, run_id: str, checkpoint_id: str, base_url: str) -> dict:
    """What a client needs to download and verify a checkpoint: every file with its size and
    SHA-256 (the registry's copy, recorded when the save completed) and a signed URL for each."""
    row = svc.checkpoints.find(caller, _path(run_id, checkpoint_id))
    urls, expires = {}, 0
    for name in sorted(row.files):
        rel, expires = svc.signer.url_path(row.storage_id, name, URL_TTL_S, caller.key_id)
        urls[name] = base_url + rel
    return {"tinker_path": row.tinker_path, "checkpoint_type": row.kind, "step": row.step,
            "session_id": row.session_id, "files": row.files, "size_bytes": row.size_bytes, "urls": urls,
            "expires": iso(expires)}


def external_urls(svc: Service, caller: Caller, run_id: str, checkpoint_id: str, base_url: str) -> dict:
    m = manifest(svc, caller, run_id, checkpoint_id, base_url)
    return {"urls": m["urls"], "expires": m["expires"]}


def download(svc: Service, storage_id: str, filename: str, query: dict):
    """(path of the file) for a valid signed URL; 403 says why a URL is refused."""
    why = svc.signer.check(storage_id, filename, query.get("expires"), query.get("signature"), query.get("kid", ""))
    if why:
        raise HttpError(403, why)
    row = svc.registry.checkpoint_by_storage(storage_id)
    if row is None or filename not in row.files:
        raise HttpError(404, "this checkpoint file no longer exists (deleted or expired)")
    if svc.registry.key_owner(query.get("kid", "")) != row.owner:
        raise HttpError(403, "the API key this URL was issued under has been revoked")
    return svc.store.folder(storage_id) / filename


def capabilities(svc: Service) -> dict:
    return {"supported_models": [{"model_name": b.name, "max_context_length": b.max_context, "trainable": True,
                                  "sampleable": svc.model_policy.get(b.name, "rollout-enabled") == "rollout-enabled"}
                                 for b in svc.bases.values()]}
