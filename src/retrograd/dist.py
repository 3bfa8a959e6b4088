"""The only module that touches torch.distributed: which rank this process is, the process group's
life (init, barrier, teardown), and the few collectives a data-parallel loop needs.

One process is the default and creates no process group at all. Under torchrun
(`torchrun --nproc-per-node N -m retrograd train run.toml`, or `retrograd train run.toml --nproc N`)
every rank runs the same loop on its share of each step's rows; this module makes the update equal
to one process's on the whole step:

  each rank's loss is a mean over its own examples (weight w_r: target tokens, pairs, ...), so the
  gradient one process computes over all of them is sum_r w_r g_r / sum_r w_r. all_reduce_gradients
  does exactly that in one summed all-reduce per bucket, weights included, so every rank ends the
  step with the same gradient, clips the same norm and takes the same optimizer step.

Strategy "ddp" is DDP's maths (gradients all-reduced, replicas identical) done once per optimizer step after
all micro-batches, instead of torch's DistributedDataParallel wrapper: the wrapper averages per
backward (wrong for token-weighted means over uneven shards), needs no_sync() around every
accumulation pass, and hides the PEFT model behind `.module`. For a LoRA the whole exchange is one
message of a few hundred KB per step.

GRPO shares an update differently (train/grpo.py): each rank samples its share of the groups, the
completions are exchanged (gather_objects), and each rank backpropagates its share of the passes, each
already divided by the whole update's denominator, so sum_gradients adds them up (under FSDP2 the
backward itself reduces them: see the FSDP2 section below).

Rank 0 alone writes (run folder, metrics, checkpoints, output); every rank keeps its own RNG state in
the checkpoint. Tests use gloo with one thread per rank; CUDA ranks use nccl.
"""
from __future__ import annotations

import datetime
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from retrograd.errors import ConfigError

# algorithms that run on several processes, under ddp and fsdp2 (PPO: every rank scores every rollout, as
# its critic and the batch whitening need them all, then backpropagates its share of the passes)
DATA_PARALLEL_ALGORITHMS = ("sft", "preference", "distill-offline", "grpo", "distill", "ppo")
GRAD_BUCKET_ELEMENTS = 1 << 24  # 64 MB of fp32 per all-reduce message for a full fine-tune


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    strategy: str = "none"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_world = World()


def current() -> World:
    return _world


def launched_size() -> int:
    """WORLD_SIZE as torchrun set it (1 without torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def single_process_keys(cfg) -> list[str]:
    """Settings of `cfg` that run on one process only in this version (their state lives in one process:
    dynamic sampling's replacement draws, the judge's cache file, the back-pressure controller)."""
    out = []
    g = cfg.grpo
    if g is not None and g.dynamic_sampling is not None:
        out.append("[grpo.dynamic_sampling]")
    if g is not None and g.judge is not None:
        out.append("[grpo.judge]")
    if cfg.ppo is not None and cfg.ppo.judge is not None:
        out.append("[ppo.judge]")
    if cfg.backpressure is not None and cfg.backpressure.enabled:
        out.append("[backpressure]")
    return out


def resolve_strategy(requested: str, trainable: str, size: int, algorithm: str, source: str,
                     single_process: list[str] | None = None, mixed_precision: str = "none") -> str:
    """The strategy this launch runs: "none" for one process, "fsdp2" for a full fine-tune (auto) or when
    asked, else "ddp". Refuses what cannot run, saying why and what to do instead."""
    if size == 1:
        return "none"
    if requested == "none":
        raise ConfigError(f"{source}: launched with {size} processes but distributed.strategy = 'none'; set "
                          "strategy = 'auto' (or 'ddp'), or run one process")
    if algorithm not in DATA_PARALLEL_ALGORITHMS:
        raise ConfigError(f"{source}: run.algorithm = {algorithm!r} runs in one process in this version (its "
                          f"rollouts are sampled in-process); {size} processes run "
                          f"{', '.join(DATA_PARALLEL_ALGORITHMS)}. Launch it without torchrun / --nproc")
    if single_process:
        raise ConfigError(f"{source}: {', '.join(single_process)} runs on one process in this version; remove it or "
                          f"launch without torchrun / --nproc")
    if requested == "fsdp2" or (requested == "auto" and trainable == "full"):
        return "fsdp2"
    if mixed_precision != "none":
        raise ConfigError(f"{source}: distributed.mixed_precision = {mixed_precision!r} applies to fsdp2 (a full "
                          f"fine-tune, or strategy = 'fsdp2'); with ddp set model.dtype instead")
    return "ddp"


def init(requested: str, trainable: str, algorithm: str, device_type: str, source: str,
         single_process: list[str] | None = None, mixed_precision: str = "none") -> World:
    """Join the process group torchrun prepared (nothing to do for one process). Call before the model
    loads, so a refused launch costs nothing."""
    global _world
    size = launched_size()
    strategy = resolve_strategy(requested, trainable, size, algorithm, source, single_process, mixed_precision)
    if size == 1:
        _world = World()
        return _world
    import torch.distributed as dist
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    _world = World(rank, size, local_rank, strategy)
    return _world


def barrier() -> None:
    if _world.distributed:
        import torch.distributed as dist
        dist.barrier()


def teardown() -> None:
    """Leave the process group cleanly. Collecting garbage and meeting at a barrier first avoids an
    intermittent "terminate called without an active exception" abort at exit, seen when gloo's
    threads still hold tensors during interpreter teardown (shared/reference/scaling-and-style.md)."""
    global _world
    if not _world.distributed:
        return
    import torch.distributed as dist
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    _world = World()


def all_reduce_gradients(params: list[torch.nn.Parameter], weight: float) -> float:
    """Each rank's gradients are a mean over `weight` examples; afterwards every rank holds the mean
    over all ranks' examples (sum_r w_r g_r / sum_r w_r). A rank without examples passes weight 0
    and no gradients. Returns the total weight."""
    if not _world.distributed:
        return weight
    import torch.distributed as dist
    total = torch.tensor([float(weight)], dtype=torch.float64)
    dist.all_reduce(total)
    _sum_scaled(params, float(weight) / float(total) if float(total) > 0 else 0.0)
    return float(total)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Every rank's gradients summed (the RL loops: each rank backpropagated its share of the update's
    passes, each already divided by the whole update's denominator)."""
    if _world.distributed:
        _sum_scaled(params, 1.0)


def sum_epoch(params: list[torch.nn.Parameter], loss: float, stats: list[dict]) -> tuple[float, list[dict]]:
    """After an RL epoch in which each rank backpropagated its share of the passes: the gradients summed,
    the loss summed and every rank's per-pass statistics, as one process would have them. Under FSDP2
    the backward already reduced the gradients (each pass's loss scaled by the world size:
    train/policy_update.keep_share), so only the loss and the statistics are exchanged."""
    if not _world.distributed:
        return loss, stats
    if _world.strategy != "fsdp2":
        sum_gradients(params)
    parts = gather_objects((loss, [{k: float(v) for k, v in x.items()} for x in stats]))
    return sum(p[0] for p in parts), [x for p in parts for x in p[1]]


def _sum_scaled(params: list[torch.nn.Parameter], scale: float) -> None:
    """grad <- sum over ranks of scale_r x grad_r, in buckets of GRAD_BUCKET_ELEMENTS (one all-reduce each)."""
    import torch.distributed as dist
    bucket: list[torch.nn.Parameter] = []
    count = 0
    for p in params:
        bucket.append(p)
        count += p.numel()
        if count >= GRAD_BUCKET_ELEMENTS:
            _reduce_bucket(bucket, scale, dist)
            bucket, count = [], 0
    if bucket:
        _reduce_bucket(bucket, scale, dist)


def _reduce_bucket(params: list[torch.nn.Parameter], scale: float, dist) -> None:
    device = params[0].device
    flat = torch.cat([(p.grad.detach().float().reshape(-1) * scale) if p.grad is not None
                      else torch.zeros(p.numel(), device=device) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def combine_metrics(parts: list[tuple[dict, float]], summed: set[str]) -> dict:
    """One step's metrics from every rank's (metrics, weight): keys in `summed` (token counts, pairs)
    add up; every other value is a mean over examples, so the ranks' values are averaged by weight.
    A key only some ranks report is averaged over those."""
    out: dict = {}
    keys = []
    for m, _ in parts:
        keys += [k for k in m if k not in keys]
    for k in keys:
        have = [(m[k], w) for m, w in parts if k in m]
        if k in summed:
            out[k] = sum(v for v, _ in have)
            continue
        total = sum(w for _, w in have)
        out[k] = (sum(v * w for v, w in have) / total) if total > 0 else have[0][0]
    return out


def reduce_metrics(metrics: dict, weight: float, summed: set[str]) -> dict:
    """combine_metrics over all ranks (every rank gets the result)."""
    if not _world.distributed:
        return metrics
    return combine_metrics(gather_objects((metrics, float(weight))), summed)


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _world.distributed:
        return [obj]
    import torch.distributed as dist
    out = [None] * _world.size
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any (a stop request seen by one rank stops all at the
    same step)."""
    if not _world.distributed:
        return flag
    import torch.distributed as dist
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shard(rows: list, world: World | None = None) -> list:
    """This rank's share of one step's rows: every size-th row from its rank on (deterministic, and
    the shares of all ranks together are the step's rows)."""
    w = world or _world
    return rows[w.rank::w.size]


# ---- FSDP2: parameters sharded across the ranks (full fine-tunes) ---------------------------------
# Rank 0 loads the whole model and the other ranks build it on the meta device (shard_model hands them
# their shards); fully_shard keeps 1/N of each parameter (and of the AdamW state) per rank; each decoder
# layer is gathered for its forward and backward only. The gradient is reduce-scattered as a mean over
# the ranks: the loop scales each rank's loss by N x its share of the step's weight (so the mean is
# all_reduce_gradients' weighted sum). FSDP2's collectives run inside every forward and backward, so
# every rank must run as many passes as the others: pad_passes adds zero-weight ones.
# What reads the weights outside a training pass (the RL loops' sampler, evaluation, no-grad scoring)
# runs inside `unsharded`: every weight gathered whole once, no collectives until it ends.

def sharded_root(model):
    """The module fully_shard wraps as the root: the transformers model (inside a PEFT wrapper for a LoRA)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard_model(model, device: torch.device, mixed_precision: str = "none") -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, head); a LoRA's adapter
    weights are sharded with the frozen layer they sit in (a base too big for one device). mixed_precision
    "bf16": the gathered weights compute in bfloat16, gradients are reduced in float32, and the sharded
    weights the optimizer steps stay float32.

    Rank 0 holds the whole model (on `device`); every other rank's is on the meta device (nothing read,
    nothing allocated) and receives its shards from rank 0's whole state (set_model_state_dict with
    broadcast_from_rank0). Buffers are not in that state when non-persistent (RoPE's inv_freq): after
    to_empty they hold garbage and nothing reports it (a loss off by ~5e-4), so every buffer is
    broadcast from rank 0 too, whatever the architecture computes in it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (_world.size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision == "bf16" else MixedPrecisionPolicy())
    root = sharded_root(model)
    whole = root.state_dict() if _world.main else {}  # references to rank 0's tensors, freed once broadcast
    decoder = getattr(root, root.base_model_prefix)
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # gradients reduce-scattered as a mean over ranks (gloo has no pre-scaled sum)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    if not _world.main:
        root.to_empty(device=device)
    set_model_state_dict(root, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del whole
    for buffer in root.buffers():
        dist.broadcast(buffer, src=0)
    # FSDP2 settles which module is the root at the first forward it sees: one that first reached a layer
    # (the decoder alone, run inside `unsharded` by the fused head) would make that layer a root of its
    # own and the root's later forward fail. One token through the root now, in eval mode so no dropout
    # draws from the generators (a collective: every rank shards the model together).
    was_training = root.training
    root.eval()
    with torch.no_grad():
        device = next(iter(root.parameters())).device
        root(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    root.reshard()  # the root keeps its weights gathered after a forward (for the backward); no backward follows
    root.train(was_training)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(sharded_root(model), FSDPModule)


def is_whole(model) -> bool:
    """Inside `unsharded(model)`: its weights are gathered whole, so code may read them outside the model's
    own forward (the fused LM head, the decoder alone)."""
    return bool(getattr(sharded_root(model), "_retrograd_whole", False))


@contextmanager
def unsharded(model):
    """Within: every fully_shard-ed module of `model` holds its whole weights (FSDPModule.unshard, the
    root's and each layer's, all-gathered once on entry) and its forwards gather and free nothing, so
    they run no collective and the ranks may run different numbers of them (a sampler's decode steps,
    evaluation chunks, no-grad scoring). The exit frees the gathered weights (reshard) and restores
    resharding after forward: fully_shard's defaults as shard_model applies them (a layer frees its
    weights after its forward; the root keeps its own for the backward that follows). The entry is a
    collective: every rank enters, as often as the others. A no-op for a model that is not sharded; no
    training pass may run inside (its backward would reshard and reduce)."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    root = sharded_root(model)
    modules = [m for m in root.modules() if isinstance(m, FSDPModule)]  # the same order on every rank
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    root._retrograd_whole = True
    try:
        yield
    finally:
        root._retrograd_whole = False
        for m in modules:
            m.set_reshard_after_forward(m is not root, recurse=False)
            m.reshard()


def sum_value(value: float) -> float:
    """`value` summed over the ranks."""
    if not _world.distributed:
        return value
    import torch.distributed as dist
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


class ForwardCount:
    """Counts the forwards of `model` within (a step's passes), for pad_passes."""

    def __init__(self, model):
        self.model, self.count, self.handle = model, 0, None

    def __enter__(self):
        def hook(*_):
            self.count += 1
        self.handle = sharded_root(self.model).register_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


def pad_passes(model, done: int, pad_id: int, device) -> None:
    """Run zero-weight forward/backward passes until this rank has run as many as the busiest rank
    (a rank with fewer rows, or shorter ones split into fewer passes, would otherwise leave the others
    waiting in a collective)."""
    import torch.distributed as dist
    t = torch.tensor([done], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for _ in range(int(t) - done):
        out = sharded_root(model)(input_ids=torch.tensor([[pad_id]], device=device), use_cache=False).logits
        (out.float().sum() * 0.0).backward()


def _trainable_state(model, **options) -> dict:
    """get_model_state_dict restricted to the trainable tensors (a LoRA's adapter, not its frozen base);
    dcp.load refuses a checkpoint that lacks one of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    state = get_model_state_dict(model, options=StateDictOptions(**options))
    return {k: v for k, v in state.items() if k in trainable}


def save_sharded(model, optimizer, folder) -> None:
    """Every rank writes its shards of the trainable weights and the optimizer state into `folder`
    (torch's distributed checkpoint: .metadata + one __R_0.distcp per rank); a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    dcp.save({"model": _trainable_state(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(folder))


def load_sharded(model, optimizer, folder) -> None:
    """Read a save_sharded checkpoint into `model` / `optimizer` (optimizer None: weights only), at any
    number of ranks, one process included: the shards are re-cut to the current layout."""
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    state = {"model": _trainable_state(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():  # one process reading a sharded checkpoint is intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def gather_trainable(model) -> dict | None:
    """The whole trainable tensors (a LoRA's adapter) of a sharded model, by parameter name, on rank 0
    (None on the others); a collective."""
    full = _trainable_state(model, full_state_dict=True, cpu_offload=True)
    return full if _world.main else None


def gather_full_model(model):
    """A plain (unsharded) CPU copy of a sharded model on rank 0, None on the others; a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not _world.main:
        return None
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(full.values())).dtype)
    missing, unexpected = plain.load_state_dict(full, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"the gathered weights do not fit the model: missing {sorted(set(missing) - tied)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}")
    plain.tie_weights()
    return plain
