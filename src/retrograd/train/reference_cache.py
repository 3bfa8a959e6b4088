"""The reference model's summed log-probabilities of every pair, scored once before the first step
of a dpo/ipo run and kept beside the checkpoints, so the reference is never run again (and never
held in memory) during training, and a resume continues with the very same numbers.

  preference-reference.bin   float64 little-endian: [train pairs x 2] then [eval pairs x 2]
                             (chosen, rejected)
  preference-reference.json  written last: format, the identity of what was scored (`key`: the
                             reference, model and data fingerprints, ctx, template), pair counts,
                             the .bin's SHA-256

Both are staged and renamed into place. A resume refuses a missing, damaged or stale (other key)
cache by name; a fresh run reuses a cache whose key matches (a run killed before its first
checkpoint does not score the reference twice).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import CheckpointError

BIN, JSON = "preference-reference.bin", "preference-reference.json"
FORMAT = 1


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_reference(directory: Path, key: dict, train: torch.Tensor, evaluation: torch.Tensor) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = np.concatenate([train.double().numpy().reshape(-1), evaluation.double().numpy().reshape(-1)]).astype("<f8")
    raw = data.tobytes()
    _atomic_write(directory / BIN, raw)
    meta = {"format": FORMAT, "key": key, "train_pairs": int(train.shape[0]), "eval_pairs": int(evaluation.shape[0]),
            "sha256": hashlib.sha256(raw).hexdigest()}
    _atomic_write(directory / JSON, json.dumps(meta, indent=1, sort_keys=True).encode())


def load_reference(directory: Path, key: dict, required: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(train [n, 2], eval [m, 2]) float64 when the cache exists and matches `key`. Otherwise None,
    or, when `required` (a resume), a CheckpointError saying what is wrong."""
    meta_path, bin_path = directory / JSON, directory / BIN

    def fail(why: str):
        if required:
            raise CheckpointError(f"{directory}: cannot resume this preference run: {why}. The reference scores "
                                  "are part of the run's state (scoring them again with a changed model or data "
                                  "would silently change the loss); start a new run instead")
        return None

    if not meta_path.is_file() or not bin_path.is_file():
        return fail(f"{BIN} (the reference log-probabilities scored before step 1) is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return fail(f"{JSON} is unreadable ({e})")
    raw = bin_path.read_bytes()
    if meta.get("format") != FORMAT or hashlib.sha256(raw).hexdigest() != meta.get("sha256"):
        return fail(f"{BIN} does not match the SHA-256 in {JSON} (damaged or partly written)")
    if meta.get("key") != key:
        diffs = sorted(k for k in set(key) | set(meta.get("key") or {}) if (meta.get("key") or {}).get(k) != key.get(k))
        return fail(f"{BIN} was scored for a different reference/model/data (differs in: {', '.join(diffs)})")
    n, m = meta["train_pairs"], meta["eval_pairs"]
    values = torch.from_numpy(np.frombuffer(raw, dtype="<f8").copy())
    if values.numel() != 2 * (n + m):
        return fail(f"{BIN} holds {values.numel()} numbers, {2 * (n + m)} expected")
    return values[: 2 * n].view(n, 2), values[2 * n:].view(m, 2)
