"""The building blocks every training loop calls, explicitly and in this order:

    resume_path = resolve_resume(cfg, resume)       before the slow model load: a wrong path fails at once
    run = start_run(cfg, log, cpu_pass_tokens)       threads, device, seed, model (+ LoRA), optimizer
    meta = run_meta(...)                             what a checkpoint records (train/checkpointing.py)
    check_resumable(resume_path, meta)               the checkpoint belongs to this run, files intact
    progress = restore(run, resume_path)             weights, optimizer, RNGs and the loop's progress
    metrics = open_metrics(run, total, progress)     the run folder, metrics.jsonl (+ TensorBoard, W&B)
      ... the loop: lr_for(...), optimizer_step(...), evaluation_due(...), record_eval(...),
          save_checkpoint(...) ...
    result = finish(run, metrics, progress, ...)     [output].path always written, metrics closed

They own no loop: train/offline.py (SFT, preference) and train/grpo.py (RL) each read top to bottom.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from retrograd import dist
from retrograd.algorithms.optim import build_optimizer
from retrograd.algorithms.schedule import lr_at
from retrograd.checkpoint import state as ckpt
from retrograd.config.load import config_as_dict, output_kind
from retrograd.device import bf16_warning, configure_torch, pick_device
from retrograd.errors import CheckpointError, ConfigError
from retrograd.export.gguf_lora import check_exportable, write_gguf_lora
from retrograd.metrics import MetricsLogger
from retrograd.models.adapter_io import adapter_layout, apply_adapter, read_spec
from retrograd.models.architectures import ARCHS as GGUF_ARCHS
from retrograd.models.lean_mlp import lean_mlp
from retrograd.models.load import load_model
from retrograd.models.logprobs import base_and_decoder
from retrograd.models.lora import attach_lora
from retrograd.models.packed import PackedForward, compile_training_passes
from retrograd.train import checkpointing as io
from retrograd.train.common import prepare_run_dir, rng_state, save_output, seed_everything


@dataclass
class TrainResult:
    step: int
    stopped_by: str  # "done" | "patience" | "signal" | "stalled"
    output: Path
    exit_code: int = 0
    last_eval_loss: float | None = None


@dataclass
class Run:
    """What a loop trains and with what: built by start_run."""
    cfg: object
    model: object
    tokenizer: object
    device: object
    loaded: object  # models.load.LoadedModel
    params: list  # the trainable parameters, in model order
    optimizer: object
    lora_modules: list | None
    pass_tokens: int | None  # token budget of one forward/backward pass
    log: Callable
    gguf_copies: bool = False  # write a llama.cpp .gguf beside each LoRA checkpoint
    run_dir: Path | None = None
    world: dist.World = dist.World()  # this process's rank; rank 0 alone writes


def _silent(*_args, **_kwargs) -> None:
    """The log of ranks other than 0: one voice on the console."""


def init_adapter_resume_message(adapter: str) -> str:
    msg = (f"--resume cannot be combined with lora.init_adapter = {adapter!r}: a checkpoint already holds the "
           "adapter it continues from, while init_adapter starts a new run from an adapter's weights.")
    try:
        spec = read_spec(adapter)
        msg += (f" To resume, replace init_adapter in [lora] by the values it set: rank = {spec.rank}, "
                f"alpha = {spec.alpha}, and the targets the run logged.")
    except Exception:  # the advice is optional; the refusal is the point
        pass
    return msg


def resolve_resume(cfg, resume: str | None) -> str | None:
    """--resume / checkpoint.resume_from -> a checkpoint path (checked to have a manifest), or None for
    a fresh run (refused when the checkpoint folder already holds another run's checkpoints)."""
    ck = cfg.checkpoint
    resume_path = resume or (ck.resume_from if ck else None)
    if resume_path and cfg.lora is not None and cfg.lora.init_adapter:
        raise CheckpointError(init_adapter_resume_message(cfg.lora.init_adapter))
    if resume_path == "latest":
        if ck is None:
            raise CheckpointError("--resume needs a [checkpoint] table (its directory is where to look), "
                                  "or give the checkpoint path: --resume PATH")
        resume_path = str(ckpt.find_resume(Path(ck.directory)))
    if resume_path:
        ckpt.read_manifest(Path(resume_path))
    elif ck is not None and (ckpt.list_steps(Path(ck.directory)) or (Path(ck.directory) / "best.state").exists()):
        raise CheckpointError(f"{ck.directory} already holds checkpoints of an earlier run; continue it with "
                              "--resume, or move that folder away (or set checkpoint.directory) to start afresh")
    return resume_path


def _check_folder(key: str, path: str | None, source) -> None:
    """`path` must be (or become) a writable folder: not a file, its nearest existing parent a writable folder."""
    if not path:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{source}: {key} = {path!r} is a file; it must be a folder (or not exist yet)")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{source}: {key} = {path!r}: {parent} is not a folder this user can write to")


def check_paths(cfg) -> None:
    """Every place the run writes, checked before the model loads: the output, the run folder, the
    checkpoint folder, TensorBoard and the W&B export."""
    src = cfg.source
    out = Path(cfg.output.path)
    writes_file = output_kind(cfg) == "adapter" or out.suffix == ".gguf"
    if writes_file:
        if out.is_dir():
            raise ConfigError(f"{src}: output.path = {cfg.output.path!r} is a folder; this output is one file")
        _check_folder("output.path's folder", str(out.parent), src)
    else:
        _check_folder("output.path", str(out), src)
    _check_folder("run.directory", cfg.run.directory, src)
    if cfg.checkpoint is not None:
        _check_folder("checkpoint.directory", cfg.checkpoint.directory, src)
    _check_folder("metrics.tensorboard_dir", cfg.metrics.tensorboard_dir, src)
    _check_folder("metrics.wandb_export_dir", cfg.metrics.wandb_export_dir, src)


def check_output_writable(cfg) -> None:
    """Every output path (check_paths); and a GGUF model from an HF-folder base is written from its config
    + tokenizer: check both can be expressed before any training happens (a GGUF base keeps its own
    metadata, nothing to check)."""
    check_paths(cfg)
    if output_kind(cfg) != "model" or not cfg.output.path.endswith(".gguf"):
        return
    folder = Path(cfg.model.path)
    if not (folder / "config.json").is_file():
        return  # a GGUF file, the built-in model, or a hub name resolved at load time
    from transformers import AutoConfig, AutoTokenizer
    from retrograd.export.gguf_from_hf import check_hf_gguf
    try:
        check_hf_gguf(AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    except ConfigError as e:
        raise ConfigError(f"{cfg.source}: output {cfg.output.path!r}: {e}") from None


def prepare_model(cfg, log, weights: bool = True):
    """Load the base model, attach (or initialise) the LoRA; returns (cfg, loaded, model, modules).
    `weights=False`: everything on the meta device (load_model), to be filled by dist.shard_model."""
    tr = cfg.training
    loaded = load_model(cfg.model.path, cfg.model.dtype, log=log, weights=weights)
    model, modules = loaded.model, None
    if tr.trainable == "lora":
        lc = cfg.lora
        if lc.init_adapter:
            # rank, alpha and targets come from the adapter; recorded as the run's settings
            spec = adapter_layout(lc.init_adapter, model)
            lc = dataclasses.replace(lc, rank=spec.rank, alpha=spec.alpha, targets=spec.modules)
            cfg = dataclasses.replace(cfg, lora=lc)
        model, modules = attach_lora(model, lc.rank, lc.alpha, lc.targets, lc.dropout, lc.seed)
        if lc.init_adapter:
            apply_adapter(lc.init_adapter, model)
            log(f"LoRA initialised from {lc.init_adapter} (weights only, fresh optimizer)")
        log(f"LoRA r={lc.rank} alpha={lc.alpha} on {', '.join(modules)}")
        if output_kind(cfg) == "adapter":
            check_exportable(model.config, cfg.lora.targets)  # refuse now, not after training
    lean_mlp(model)  # the gated MLP keeps a third less for backward, bit for bit the same results
    if tr.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return cfg, loaded, model, modules


# A full fine-tune's default pass on CPU. Each extra pass of a step costs a full fine-tune a sweep over
# every weight's gradient (accumulating into .grad: 540 MB for SmolLM2-135M) and, with tied embeddings,
# the [V, H] embedding and head gradients; activations are a smaller share of its memory than in a LoRA
# run. SFT on SmolLM2, 4 x 256 tokens a step, 2-core Xeon: 1024-token passes 3.99-4.02 s a step against
# 4.32-4.33 s for two 512-token ones (two runs each, alternating), peak RSS 3.99-4.09 GB against 3.82-3.84.
FULL_FINE_TUNE_CPU_PASS_TOKENS = 1024


def start_run(cfg, log, cpu_pass_tokens: int = 512) -> Run:
    """Threads, device and seeds set; the model (+ LoRA) loaded, on its device, in train mode; the
    optimizer built over its trainable parameters. `cpu_pass_tokens` is the algorithm's default
    pass budget on CPU, at least FULL_FINE_TUNE_CPU_PASS_TOKENS for a full fine-tune
    (training.micro_batch overrides it; no split on GPU)."""
    tr, ck = cfg.training, cfg.checkpoint
    check_output_writable(cfg)
    configure_torch(tr.threads)
    device = pick_device(cfg.model.device)
    algorithm = cfg.run.algorithm
    if algorithm == "distill" and cfg.distill.mode == "topk_offline":
        algorithm = "distill-offline"
    world = dist.init(cfg.distributed.strategy, tr.trainable, algorithm, device.type, cfg.source,
                      dist.single_process_keys(cfg), cfg.distributed.mixed_precision)
    if not world.main:
        log = _silent
    if world.distributed:
        log(f"distributed: {world.size} processes ({world.strategy}); each works on its share of every step, "
            "gradients all-reduced; rank 0 writes")
    seed_everything(tr.seed)
    mixed = ([("distributed.mixed_precision", "bf16")]
             if world.strategy == "fsdp2" and cfg.distributed.mixed_precision == "bf16" else [])
    for key, value in (("model.dtype", cfg.model.dtype), *sampling_dtypes(cfg), *mixed):
        warning = bf16_warning(device, key, value) if value in ("bfloat16", "bf16") else None
        if warning:
            log(warning)
    # FSDP2: rank 0 reads the weights (and converts a .gguf) first; the other ranks then build the model on
    # the meta device and receive only their shards from it (dist.shard_model)
    sharded = world.strategy == "fsdp2"
    if sharded and not world.main:
        dist.barrier()
    cfg, loaded, model, modules = prepare_model(cfg, log, weights=world.main or not sharded)
    if sharded and world.main:
        dist.barrier()
    gguf_copies = (tr.trainable == "lora" and ck is not None and model.config.model_type in GGUF_ARCHS
                   and world.strategy != "fsdp2")  # a sharded adapter is whole only in `retrograd export`
    if tr.trainable == "lora" and ck is not None and world.strategy == "fsdp2":
        log("note: no .gguf copies beside fsdp2 checkpoints (the adapter is sharded); "
            "`retrograd export STEP.state --format gguf` writes one")
    elif tr.trainable == "lora" and ck is not None and not gguf_copies:
        log(f"note: no .gguf copies beside checkpoints: llama.cpp adapters are written for "
            f"{', '.join(GGUF_ARCHS)} models, not {model.config.model_type!r}")
    if sharded:  # 1/N of every weight (and of its optimizer state) per rank
        if world.main:
            model.to(device)
        dist.shard_model(model.train(), device, cfg.distributed.mixed_precision)
    else:
        model.to(device).train()
    if tr.compile:
        compile_passes(model, tr, sharded, log)
    params = [p for p in model.parameters() if p.requires_grad]
    n_train, n_all = sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())
    log(f"model {loaded.source}: {n_all:,} parameters, {n_train:,} trainable ({tr.trainable})")
    if tr.trainable == "full":
        cpu_pass_tokens = max(cpu_pass_tokens, FULL_FINE_TUNE_CPU_PASS_TOKENS)
    pass_tokens = tr.micro_batch or (cpu_pass_tokens if device.type == "cpu" else None)
    return Run(cfg, model, loaded.tokenizer, device, loaded, params, build_optimizer(params, tr), modules,
               pass_tokens, log, gguf_copies, world=world)


def compile_passes(model, tr, sharded: bool, log) -> bool:
    """[training] compile: the training passes' packed forward through torch.compile, where the packed
    forward runs (models/packed.py); else a note saying why the passes stay eager. True when compiled."""
    base, decoder = base_and_decoder(model)
    why = ("fsdp2 shards the model, and sharded passes run the model's own forward" if sharded
           else "training.gradient_checkpointing recomputes through the model's own forward"
           if tr.gradient_checkpointing else None)
    if why is None and not PackedForward(decoder).shaped:
        why = f"only Llama-family models run the packed forward, not {base.config.model_type!r}"
    if why:
        log(f"warning: training.compile is ignored: {why}; training passes run eager")
        return False
    compile_training_passes(decoder)
    log("training.compile: the first training passes compile the model (minutes on a CPU; a later run or "
        "--resume starts faster from inductor's on-disk cache); later passes reuse it")
    return True


def sampling_dtypes(cfg) -> list[tuple[str, str]]:
    """(key, value) of every sampling.dtype the run sets ([grpo.sampling], [ppo.sampling], [distill.sampling])."""
    out = []
    for table in ("grpo", "ppo", "distill"):
        t = getattr(cfg, table, None)
        sp = getattr(t, "sampling", None) if t is not None else None
        if sp is not None and getattr(sp, "dtype", None):
            out.append((f"{table}.sampling.dtype", sp.dtype))
    return out


def fresh_progress() -> dict:
    return {"step": 0, "epoch": 0, "cursor": 0, "best_eval": None, "stale_evals": 0, "tokens_seen": 0}


def check_resumable(resume_path: str | None, meta: dict) -> None:
    """Refuse a checkpoint whose files are damaged or that belongs to another run (names what differs)."""
    if resume_path:
        io.check_resumable(Path(resume_path), meta)


def restore(run: Run, resume_path: str | None) -> dict:
    """The loop's progress: fresh, or read from a checkpoint (checked first with check_resumable),
    with weights, optimizer state and every RNG restored in place."""
    if not resume_path:
        return fresh_progress()
    progress, saved_world = io.load_training_state(Path(resume_path), run.model, run.optimizer, run.device,
                                                   run.world.rank, run.cfg.training.seed)
    if saved_world != run.world.size:
        run.log(f"note: {resume_path} was saved by {saved_world} process(es), this run has {run.world.size}: the "
                "weights, optimizer state and data position carry over (sharded ones re-cut to this layout); ranks "
                "without a saved random state start from training.seed + rank")
    return progress


class NullMetrics:
    """The metrics sinks of ranks other than 0: rank 0 logs the step's metrics, reduced over all ranks."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def close(self, state: str = "finished") -> None:
        pass


def open_metrics(run: Run, total_steps: int, progress: dict) -> MetricsLogger:
    """The run folder (with the resolved config) and the metrics sinks, continuing a resumed run's file."""
    cfg = run.cfg
    if not run.world.main:
        run.run_dir = Path(cfg.run.directory)
        return NullMetrics()
    run.run_dir = prepare_run_dir(cfg)
    return MetricsLogger(run.run_dir, total_steps, tensorboard_dir=cfg.metrics.tensorboard_dir,
                         wandb_export_dir=cfg.metrics.wandb_export_dir, config=config_as_dict(cfg),
                         run_name=cfg.run.name, log_every=cfg.metrics.log_every, resume_step=progress["step"],
                         verbose=cfg.run.verbose)


def lr_for(run: Run, step: int, total_steps: int) -> float:
    """Set and return this step's learning rate (a pure function of the step)."""
    tr = run.cfg.training
    lr = lr_at(step, total_steps, tr.lr, tr.lr_scheduler, tr.warmup_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    return lr


def schedule_state(run: Run, total_steps: int, lr: float) -> dict:
    """The LR schedule as saved in progress (it is recomputed from the step; this makes it readable)."""
    tr = run.cfg.training
    return {"kind": tr.lr_scheduler, "peak_lr": tr.lr, "warmup_steps": tr.warmup_steps, "total_steps": total_steps,
            "last_lr": lr}


def evaluation_due(ev, step: int, total_steps: int, epoch_done: bool = False, epoch: int = 0,
                   rollout: bool = False) -> bool:
    """[evaluation] every_steps / every_iterations / at each epoch's end, and always at the last step.
    every_iterations counts epochs in the offline loops and updates in the rollout loops (`rollout`: GRPO,
    PPO, on-policy distillation), as the public schema means it."""
    if ev is None:
        return False
    if rollout and ev.every_iterations and step % ev.every_iterations == 0:
        return True
    return (step == total_steps or (ev.every_steps and step % ev.every_steps == 0)
            or (ev.every_iterations and epoch_done and epoch % ev.every_iterations == 0)
            or (not ev.every_steps and not ev.every_iterations and epoch_done))


def record_eval(progress: dict, value: float, higher_is_better: bool, min_delta: float) -> bool:
    """Track the best evaluation and the evaluations without improvement; True when `value` improved."""
    best = progress["best_eval"]
    improved = best is None or (value > best + min_delta if higher_is_better else value < best - min_delta)
    if improved:
        progress["best_eval"], progress["stale_evals"] = value, 0
    else:
        progress["stale_evals"] += 1
    return improved


def save_checkpoint(run: Run, name: str, progress: dict, meta: dict, extra=None) -> None:
    """A .state checkpoint in [checkpoint].directory, and a llama.cpp .gguf copy beside a LoRA's.
    `extra(folder)` adds the loop's own files (PPO's critic)."""
    ck = run.cfg.checkpoint
    rank_rngs = dist.gather_objects(rng_state())  # every rank's generators; rank 0 writes them all
    if run.world.strategy == "fsdp2":  # every rank writes its shards into the one checkpoint folder
        io.save_sharded_training_state(Path(ck.directory), name, run.model, run.optimizer, progress,
                                       {**meta, "world_size": run.world.size, "sharded": True}, rank_rngs, run.world,
                                       extra)
        return
    if run.world.main:
        io.save_training_state(Path(ck.directory), name, run.model, run.optimizer, progress,
                               {**meta, "world_size": run.world.size}, extra, rank_rngs)
        if run.gguf_copies:
            from peft import get_peft_model_state_dict
            write_gguf_lora(Path(ck.directory) / name.replace(".state", ".gguf"),
                            get_peft_model_state_dict(run.model), run.cfg.lora.alpha, run.model.config,
                            run.cfg.lora.dtype)
    dist.barrier()  # no rank runs ahead (or exits) before the checkpoint is complete


STOP_STATUS = {"done": "finished", "patience": "early_stopped", "signal": "stopped", "stalled": "stalled"}


def finish(run: Run, metrics: MetricsLogger, progress: dict, stopped_by: str, exit_code: int,
           last_eval: float | None, reason: str = "") -> TrainResult:
    """Say why the run ended, write [output].path (always, also after an early stop) and close the sinks."""
    step, cfg = progress["step"], run.cfg
    if stopped_by == "patience":
        metrics.print(f"early stop at step {step}: no eval improvement in {cfg.evaluation.patience} evaluations")
    elif stopped_by == "stalled":
        metrics.print(f"stopped at step {step}: {reason}")
    elif stopped_by == "signal":
        metrics.print(f"stopped at step {step}" + ("; continue with --resume" if cfg.checkpoint else ""))
    out = Path(cfg.output.path)
    model = run.model
    if run.world.strategy == "fsdp2" and cfg.training.trainable == "lora":
        # the adapter gathered whole, into a fresh copy of the base on rank 0: every output kind as usual
        adapter = dist.gather_trainable(run.model)
        if run.world.main:
            _, _, model, _ = prepare_model(cfg, _silent)
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, tensor in adapter.items():
                    params[name].copy_(tensor)
    elif run.world.strategy == "fsdp2":
        model = dist.gather_full_model(run.model)
    if run.world.main:
        out = save_output(model, run.tokenizer, cfg)
    metrics.print(f"wrote {out}")
    dist.barrier()
    metrics.close(STOP_STATUS[stopped_by])
    return TrainResult(step, stopped_by, out, exit_code, last_eval)
