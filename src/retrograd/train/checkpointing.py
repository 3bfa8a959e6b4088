"""What a training loop puts into a `.state` checkpoint and takes back out on resume.

The file format and atomicity live in `checkpoint/state.py`; this module decides the payload:
trainable tensors, optimizer state, every RNG, and the loop's progress dict.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retrograd.checkpoint import state as ckpt
from retrograd.errors import CheckpointError
from retrograd.train.common import rng_state, seed_everything, set_rng_state


def run_meta(cfg, fingerprints: dict, settings: dict, lora_modules: list[str] | None = None) -> dict:
    """What a manifest records about the run. `base` is what `retrograd export` needs to rebuild the
    model around the saved tensors; only algorithm, fingerprints and settings gate a resume."""
    base = {"model": cfg.model.path, "dtype": cfg.model.dtype, "trainable": cfg.training.trainable}
    if cfg.training.trainable == "lora":
        base["lora"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "modules": lora_modules, "dtype": cfg.lora.dtype}
    return {"algorithm": cfg.run.algorithm, "fingerprints": fingerprints, "settings": settings, "base": base}


def save_training_state(directory: Path, name: str, model, optimizer, progress: dict, meta: dict,
                        extra=None, rank_rngs: list | None = None) -> Path:
    """`extra(folder)` writes what else the loop keeps (e.g. PPO's critic); the manifest covers it too.
    `rank_rngs`: every rank's generator states in a data-parallel run (rank 0's go to rng.pt, rank r's
    to rng-rank-r.pt); the replicated weights and optimizer are written once."""
    def write(folder: Path) -> None:
        tensors = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(tensors, str(folder / "weights.safetensors"))
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        rngs = rank_rngs or [rng_state()]
        torch.save(rngs[0], folder / "rng.pt")
        for rank, state in enumerate(rngs[1:], start=1):
            torch.save(state, folder / f"rng-rank-{rank}.pt")
        (folder / "progress.json").write_text(json.dumps(progress, indent=1, sort_keys=True))
        if extra is not None:
            extra(folder)

    return ckpt.save_state(Path(directory), name, write, {**meta, "step": progress["step"]})


def save_sharded_training_state(directory: Path, name: str, model, optimizer, progress: dict, meta: dict,
                                rank_rngs: list, world, extra=None) -> None:
    """An FSDP2 run's checkpoint: every rank writes its shards of the weights and the optimizer state
    (torch.distributed.checkpoint: .metadata + __R_0.distcp) into one staging folder, then rank 0 adds
    the RNGs, progress and `extra(folder)` (what else the loop keeps, replicated on every rank: PPO's
    critic), the manifest over every file, and renames the folder into place as save_state does for one
    process."""
    from retrograd import dist
    staging = Path(directory) / f".staging-{name}-sharded"
    if world.main:
        Path(directory).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    dist.barrier()
    dist.save_sharded(model, optimizer, staging)
    dist.barrier()
    if world.main:
        def write(folder: Path) -> None:
            torch.save(rank_rngs[0], folder / "rng.pt")
            for rank, state in enumerate(rank_rngs[1:], start=1):
                torch.save(state, folder / f"rng-rank-{rank}.pt")
            (folder / "progress.json").write_text(json.dumps(progress, indent=1, sort_keys=True))
            if extra is not None:
                extra(folder)
        ckpt.save_state(Path(directory), name, write, {**meta, "step": progress["step"]}, staging=staging)
    dist.barrier()


def check_resumable(path: Path, meta: dict) -> dict:
    """Verify the checkpoint's files and that it belongs to this run; returns its manifest."""
    manifest = ckpt.verify_state(path)
    diffs = ckpt.compare_meta(manifest, meta)
    if diffs:
        raise CheckpointError(f"{path} does not match this run, so it cannot be resumed exactly:\n  "
                              + "\n  ".join(diffs)
                              + "\nRestore those settings, or start a new run (lora.init_adapter for weights only).")
    return manifest


def _load_whole_weights(path: Path, model, device) -> None:
    """weights.safetensors into the model's trainable parameters, names and shapes checked."""
    tensors = load_file(str(path / "weights.safetensors"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise CheckpointError(f"{path}: its trainable tensors do not match the model "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for n, p in params.items():
            if tensors[n].shape != p.shape:
                raise CheckpointError(f"{path}: tensor {n} has shape {tuple(tensors[n].shape)}, "
                                      f"the model has {tuple(p.shape)}")
            p.copy_(tensors[n].to(device))


def load_training_state(path: Path, model, optimizer, device, rank: int = 0, seed: int = 0) -> tuple[dict, int]:
    """Restore weights, optimizer and this rank's RNGs in place; return (the progress dict, the number of
    processes that saved it). A rank the checkpoint has no random state for is seeded seed + rank.
    A sharded (FSDP2) checkpoint loads at any number of processes; a whole-model one into a sharded run
    is refused (its optimizer state is keyed by one process's parameters)."""
    from retrograd import dist
    sharded_ckpt = (path / ".metadata").exists()
    if sharded_ckpt:
        dist.load_sharded(model, optimizer, path)
    elif dist.is_sharded(model):
        raise CheckpointError(f"{path} holds the whole model (one process or ddp); an fsdp2 run resumes only "
                              "its own sharded checkpoints: resume with distributed.strategy = 'ddp' (or one process)")
    else:
        _load_whole_weights(path, model, device)
    try:
        if not sharded_ckpt:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
        rng_file = path / ("rng.pt" if rank == 0 else f"rng-rank-{rank}.pt")
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            seed_everything(seed + rank)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot restore the optimizer / RNG state: {e}") from None
    saved_world = int(ckpt.read_manifest(path).get("world_size", 1))
    return json.loads((path / "progress.json").read_text()), saved_world
