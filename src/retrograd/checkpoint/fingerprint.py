"""Content fingerprints (SHA-256) of files and folders, cached by (path, size, mtime).

A checkpoint records the fingerprints of the model and the data; a resume recomputes them and
refuses when they differ. Hashing a 500 MB model takes about a second, and the cache makes the
second time free.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from retrograd.paths import home

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cache_file() -> Path:
    return home() / "fingerprints.json"


def cached_sha256(path: str | Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    cache_path = _cache_file()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    digest = sha256_file(path)
    cache[key] = digest
    tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_path)
    except OSError:
        pass  # the cache is an optimisation only
    return digest


def fingerprint_path(path: str | Path) -> str:
    """SHA-256 of a file, or of a folder's files (sorted names + their hashes)."""
    path = Path(path)
    if path.is_file():
        return cached_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(cached_sha256(f).encode())
    return h.hexdigest()
