"""Checkpoint folders of the service and the signed URLs that download them.

A checkpoint is a `.state` folder (checkpoint/state.py: staged, fsynced, manifest with every
file's size and SHA-256 written last, renamed into place) named by a random storage id under
`STATE_DIR/checkpoints/`. Folder names never come from a client, so no name or path a client
sends can reach outside the state dir.

Download URLs carry `expires`, the id of the API key they were issued under, and an HMAC-SHA256 of
(storage id, file, expires, key id) under a secret kept in `STATE_DIR/signing.key` (mode 0600, made
at first start): a changed byte, a passed deadline or a revoked key is refused, and the URL needs no
API key, so it can be handed to a download tool.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import signal
import time
import uuid
from pathlib import Path

from retrograd.checkpoint.fingerprint import sha256_file
from retrograd.checkpoint.state import CRASH_ENV, MANIFEST, save_state

_STORAGE_ID = re.compile(r"^[0-9a-f]{32}$")


class CheckpointStore:
    def __init__(self, state_dir: Path):
        self.root = Path(state_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, storage_id: str) -> Path:
        if not _STORAGE_ID.match(storage_id):
            raise ValueError("bad storage id")
        return self.root / storage_id

    def save(self, user_name: str, write_payload, meta: dict) -> tuple[str, dict, int]:
        """Write a complete checkpoint; returns (storage id, files from the manifest, total bytes)."""
        storage_id = uuid.uuid4().hex

        def write(folder: Path) -> None:
            write_payload(folder)
            if os.environ.get(CRASH_ENV) == f"service:{user_name}":  # crash-safety test hook
                os.kill(os.getpid(), signal.SIGKILL)

        final = save_state(self.root, storage_id, write, meta)
        files = json.loads((final / MANIFEST).read_text())["files"]
        files[MANIFEST] = {"bytes": (final / MANIFEST).stat().st_size, "sha256": sha256_file(final / MANIFEST)}
        return storage_id, files, sum(f["bytes"] for f in files.values())

    def copy(self, storage_id: str) -> str:
        """A copy of a complete checkpoint folder under a new storage id (staged, then renamed)."""
        new = uuid.uuid4().hex
        staging = self.root / f".copy-{new}"
        shutil.copytree(self.folder(storage_id), staging)
        os.replace(staging, self.root / new)
        return new

    def remove(self, storage_id: str) -> None:
        shutil.rmtree(self.folder(storage_id), ignore_errors=True)

    def sweep_orphans(self, registered: set[str]) -> int:
        """Delete folders no registry row points at (a save cut short, staging leftovers)."""
        n = 0
        for p in self.root.iterdir():
            if p.name not in registered:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                n += 1
        return n


class Signer:
    def __init__(self, state_dir: Path):
        key_file = Path(state_dir) / "signing.key"
        if not key_file.exists():
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
        self._key = bytes.fromhex(key_file.read_text().strip())

    def _mac(self, storage_id: str, filename: str, expires: int, kid: str) -> str:
        msg = f"{storage_id}/{filename}/{expires}/{kid}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def url_path(self, storage_id: str, filename: str, ttl_seconds: int, kid: str) -> tuple[str, int]:
        """A download path for `filename`, valid `ttl_seconds` and while the API key `kid` it was
        issued under lives."""
        expires = int(time.time()) + ttl_seconds
        return (f"/api/v1/files/{storage_id}/{filename}?expires={expires}&kid={kid}&signature="
                f"{self._mac(storage_id, filename, expires, kid)}", expires)

    def check(self, storage_id: str, filename: str, expires: str, signature: str, kid: str) -> str | None:
        """None when valid, else why not."""
        try:
            deadline = int(expires)
        except (TypeError, ValueError):
            return "the URL has no valid expiry"
        if not hmac.compare_digest(self._mac(storage_id, filename, deadline, kid or ""), signature or ""):
            return "the URL's signature does not match (was it altered?)"
        if deadline < time.time():
            return "the URL has expired; ask the server for a new one"
        return None
