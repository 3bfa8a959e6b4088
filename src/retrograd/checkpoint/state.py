"""`.state` checkpoint directories: atomic save, manifest + SHA-256, verification, selection.

Layout of `step-000000000100.state/` (and `best.state/`):
  weights.safetensors   the trainable tensors (LoRA A/B, or every base weight for a full run)
  optimizer.pt          torch optimizer state_dict
  rng.pt                python, numpy, torch (CPU and CUDA) generator states
  rng-rank-N.pt         the same for rank N of a run under torchrun (rank 0's are rng.pt)
  progress.json         step, epoch, data cursor, best eval, patience counter, ...
  manifest.json         written LAST: format version, file list with bytes + SHA-256,
                        fingerprints (model, data, algorithm) and the trajectory settings

Everything is written into a hidden staging folder beside the target, fsynced, and renamed into
place; a folder without manifest.json is never picked by resume. Killing the process at any
moment leaves either the old checkpoint, the new one, or (for best.state, between two renames)
a `.replaced-best.state` that `find_resume` still recognises.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

from retrograd.checkpoint.fingerprint import sha256_file
from retrograd.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STEP_RE = re.compile(r"^step-(\d{12})\.state$")
# Test hook: SIGKILL ourselves after writing the payload but before the manifest (crash-safety test).
CRASH_ENV = "RETROGRAD_TEST_CRASH_IN_SAVE"


def step_name(step: int) -> str:
    return f"step-{step:012d}.state"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_state(directory: Path, name: str, write_payload, meta: dict, staging: Path | None = None) -> Path:
    """Write checkpoint `name` in `directory`.

    `write_payload(folder)` writes the payload files into the staging folder; `meta` (fingerprints,
    settings, step) goes into the manifest, which is written last with every file's SHA-256.
    `staging`: a staging folder that already holds part of the payload (the shards every rank of an
    FSDP2 run wrote); by default a fresh one.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    if staging is None:
        staging = directory / f".staging-{name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    write_payload(staging)
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    files = {}
    for f in sorted(staging.iterdir()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": files, **meta}
    tmp = staging / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, staging / MANIFEST)
    _fsync_dir(staging)
    replaced = directory / f".replaced-{name}"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(staging, final)
    _fsync_dir(directory)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    mf = path / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"{path} is incomplete: it has no {MANIFEST} (the save did not finish); "
                              "resume from an earlier checkpoint")
    try:
        manifest = json.loads(mf.read_text())
    except ValueError as e:
        raise CheckpointError(f"{mf} is corrupt: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format_version')!r} is not "
                              f"the supported format {FORMAT_VERSION}")
    return manifest


def verify_state(path: Path) -> dict:
    """Check every file of the manifest (present, size, SHA-256). Returns the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    for fname, info in manifest["files"].items():
        f = path / fname
        if not f.exists():
            raise CheckpointError(f"{path} is corrupt: {fname} is missing")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path} is corrupt: {fname} has {f.stat().st_size} bytes, "
                                  f"the manifest says {info['bytes']}")
        if sha256_file(f) != info["sha256"]:
            raise CheckpointError(f"{path} is corrupt: {fname} does not match its SHA-256 in the manifest")
    return manifest


def list_steps(directory: Path) -> list[tuple[int, Path]]:
    """Complete step checkpoints (with a manifest), oldest first."""
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / MANIFEST).exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def find_resume(directory: Path) -> Path:
    """Latest complete step-*.state, else best.state."""
    directory = Path(directory)
    steps = list_steps(directory)
    if steps:
        return steps[-1][1]
    for name in ("best.state", ".replaced-best.state"):
        if (directory / name / MANIFEST).exists():
            return directory / name
    raise CheckpointError(f"--resume: no complete checkpoint (step-*.state or best.state) in {directory}")


def compare_meta(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between a checkpoint's recorded run and the current one."""
    diffs = []
    for key in ("algorithm",):
        if saved.get(key) != current.get(key):
            diffs.append(f"algorithm: checkpoint {saved.get(key)!r}, config {current.get(key)!r}")
    for kind, fp in current.get("fingerprints", {}).items():
        old = saved.get("fingerprints", {}).get(kind)
        if old != fp:
            diffs.append(f"{kind}: content changed (checkpoint {str(old)[:12]}, now {str(fp)[:12]})")
    s_old, s_new = saved.get("settings", {}), current.get("settings", {})
    for key in sorted(set(s_old) | set(s_new)):
        if s_old.get(key) != s_new.get(key):
            diffs.append(f"{key}: checkpoint {s_old.get(key, '<unset>')!r}, config {s_new.get(key, '<unset>')!r}")
    return diffs
