"""The training loop every offline algorithm (SFT, preference) shares, top to bottom: resolve
--resume, load the model (+ LoRA), let the algorithm's Task load its data, (resume), then for each
optimizer step take the next rows in the seeded epoch order, let the Task run forward/backward,
clip, step, log, evaluate, checkpoint; always write [output].path.

What differs per algorithm lives in a Task (train/sft.py, train/preference.py):
  rows, rows_per_step, shuffle      what one step consumes (step_description says it in words)
  fingerprints                      data files a resume must find unchanged
  eval_metric                       the evaluation number best.state minimises ("loss", ...), or
                                    maximises when eval_higher_is_better (GRPO's mean reward)
  prepare(resume_path)              work before the first step (e.g. scoring the reference once)
  step(rows) -> metrics             forward + backward of one optimizer step (no optimizer call);
                                    `step_index` (steps done before this one) is set first, and
                                    `optimizer_step()` may be called for extra steps inside (GRPO epochs)
  evaluate() -> metrics             held-out metrics, `eval_metric` among them
Optional: total_steps (overrides the epoch arithmetic), state_dict()/load_state_dict() (saved in
the checkpoint's progress), stop_reason (set by step() to end the run early, e.g. stalled GRPO).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from retrograd.algorithms.schedule import lr_at
from retrograd.checkpoint import state as ckpt
from retrograd.config.load import config_as_dict, output_kind, trajectory_settings
from retrograd.data.sampler import epoch_order, steps_per_epoch
from retrograd.errors import CheckpointError
from retrograd.export.gguf_lora import ARCHS as GGUF_ARCHS, check_exportable, write_gguf_lora
from retrograd.metrics import MetricsLogger
from retrograd.models.adapter_io import adapter_layout, apply_adapter, read_spec
from retrograd.models.load import load_model
from retrograd.models.lora import attach_lora
from retrograd.train import checkpointing as io
from retrograd.train.common import (StopRequest, build_optimizer, clip_gradients, configure_torch, peak_rss_mb,
                                    pick_device, prepare_run_dir, save_output, seed_everything)


@dataclass
class TrainResult:
    step: int
    stopped_by: str  # "done" | "patience" | "signal" | "stalled"
    output: Path
    exit_code: int = 0
    last_eval_loss: float | None = None


@dataclass
class Setup:
    """What a Task is built from."""
    cfg: object
    model: object
    tokenizer: object
    device: object
    loaded: object  # models.load.LoadedModel
    pass_tokens: int | None  # token budget of one forward/backward pass
    log: Callable


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


def prepare_model(cfg, log):
    """Load the base model, attach (or initialise) the LoRA; returns (cfg, loaded, model, modules)."""
    tr = cfg.training
    loaded = load_model(cfg.model.path, cfg.model.dtype, log=log)
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
    if tr.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return cfg, loaded, model, modules


def run_training(cfg, make_task: Callable[[Setup], object], resume: str | None = None, log=print) -> TrainResult:
    tr, ev, ck = cfg.training, cfg.evaluation, cfg.checkpoint
    resume_path = resolve_resume(cfg, resume)  # before the slow model load, so a wrong path fails at once
    configure_torch(tr.threads)
    device = pick_device(cfg.model.device)
    seed_everything(tr.seed)

    cfg, loaded, model, modules = prepare_model(cfg, log)
    gguf_copies = tr.trainable == "lora" and ck is not None and model.config.model_type in GGUF_ARCHS
    if tr.trainable == "lora" and ck is not None and not gguf_copies:
        log(f"note: no .gguf copies beside checkpoints: llama.cpp adapters are written for "
            f"{', '.join(GGUF_ARCHS)} models, not {model.config.model_type!r}")
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_train, n_all = sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())
    log(f"model {loaded.source}: {n_all:,} parameters, {n_train:,} trainable ({tr.trainable})")

    # a task may size its own CPU passes (GRPO's prompts run once per group, so its passes hold more)
    pass_tokens = tr.micro_batch or (getattr(make_task, "cpu_pass_tokens", 512) if device.type == "cpu" else None)
    task = make_task(Setup(cfg, model, loaded.tokenizer, device, loaded, pass_tokens, log))
    total_steps = (getattr(task, "total_steps", None) or tr.max_steps
                   or tr.epochs * steps_per_epoch(len(task.rows), task.rows_per_step))
    optimizer = build_optimizer(params, tr)

    def optimizer_step() -> float:
        grad_norm = clip_gradients(params, tr.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    task.optimizer_step = optimizer_step
    meta = io.run_meta(cfg, {"model": loaded.fingerprint, **task.fingerprints}, trajectory_settings(cfg), modules)

    # ---- progress (fresh, or restored from a checkpoint) --------------------------------------
    progress = {"step": 0, "epoch": 0, "cursor": 0, "best_eval": None, "stale_evals": 0, "tokens_seen": 0}
    if resume_path:
        io.check_resumable(Path(resume_path), meta)
    task.prepare(resume_path)
    if resume_path:
        progress = io.load_training_state(Path(resume_path), model, optimizer, device)
        if hasattr(task, "load_state_dict"):
            task.load_state_dict(progress.get("task") or {})
        log(f"resumed from {resume_path} at step {progress['step']} (epoch {progress['epoch']}, "
            f"row {progress['cursor']} of {len(task.rows)})")

    run_dir = prepare_run_dir(cfg)
    metrics = MetricsLogger(run_dir, total_steps, tensorboard_dir=cfg.metrics.tensorboard_dir,
                            wandb_export_dir=cfg.metrics.wandb_export_dir, config=config_as_dict(cfg),
                            run_name=cfg.run.name, log_every=cfg.metrics.log_every, resume_step=progress["step"])
    log(f"training {total_steps} steps of {task.step_description}; run folder {run_dir}")

    def save(name: str) -> None:
        if hasattr(task, "state_dict"):
            progress["task"] = task.state_dict()
        io.save_training_state(Path(ck.directory), name, model, optimizer, progress, meta)
        if gguf_copies:  # a llama.cpp-loadable copy of the adapter beside each LoRA checkpoint
            from peft import get_peft_model_state_dict
            write_gguf_lora(Path(ck.directory) / name.replace(".state", ".gguf"), get_peft_model_state_dict(model),
                            cfg.lora.alpha, model.config, cfg.lora.dtype)

    best_key = f"eval/best_{task.eval_metric}"
    higher = getattr(task, "eval_higher_is_better", False)
    if hasattr(task, "start_run"):
        task.start_run(run_dir, progress["step"])
    stopped_by, last_eval, step = "done", None, progress["step"]
    if ev is not None and step == 0:
        metrics.log(0, task.evaluate())  # the base model's numbers: every curve starts where training began
    order_epoch, order = -1, []
    with StopRequest() as stop:
        while progress["step"] < total_steps:
            t0 = time.perf_counter()
            # ---- the rows of this step: next in the seeded order of the current epoch ----
            if order_epoch != progress["epoch"]:
                order_epoch, order = progress["epoch"], epoch_order(len(task.rows), tr.seed, progress["epoch"],
                                                                    task.shuffle)
            rows = [task.rows[i] for i in order[progress["cursor"]:progress["cursor"] + task.rows_per_step]]
            progress["cursor"] += len(rows)
            epoch_done = progress["cursor"] >= len(task.rows)
            if epoch_done:
                progress["epoch"], progress["cursor"] = progress["epoch"] + 1, 0

            # ---- forward/backward (the Task), one optimizer step ----
            lr = lr_at(progress["step"], total_steps, tr.lr, tr.lr_scheduler, tr.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            task.step_index = progress["step"]
            step_metrics = task.step(rows)
            grad_norm = optimizer_step()
            progress["step"] += 1
            progress["tokens_seen"] += step_metrics["train/tokens"]
            # the schedule is a pure function of the step; these make the state readable on its own
            progress["lr_schedule"] = {"kind": tr.lr_scheduler, "peak_lr": tr.lr, "warmup_steps": tr.warmup_steps,
                                       "total_steps": total_steps, "last_lr": lr}
            step = progress["step"]
            dt = time.perf_counter() - t0
            metrics.log(step, {**step_metrics, "train/epoch": step * task.rows_per_step / len(task.rows),
                               "optimizer/lr": lr, "optimizer/grad_norm": grad_norm,
                               "system/tokens_per_second": step_metrics["train/tokens"] / dt,
                               "system/step_seconds": dt, "system/peak_rss_mb": peak_rss_mb()})

            # ---- evaluation, best.state, patience ----
            if ev is not None and (
                    step == total_steps
                    or (ev.every_steps and step % ev.every_steps == 0)
                    or (ev.every_iterations and epoch_done and progress["epoch"] % ev.every_iterations == 0)
                    or (not ev.every_steps and not ev.every_iterations and epoch_done)):
                eval_metrics = task.evaluate()
                last_eval = eval_metrics[f"eval/{task.eval_metric}"]
                best = progress["best_eval"]
                improved = best is None or (last_eval > best + ev.min_delta if higher else last_eval < best - ev.min_delta)
                if improved:
                    progress["best_eval"], progress["stale_evals"] = last_eval, 0
                else:
                    progress["stale_evals"] += 1
                metrics.log(step, {**eval_metrics, best_key: progress["best_eval"]})
                if improved and ck is not None and ck.mode in ("best_eval", "steps_and_best_eval"):
                    save("best.state")
                if ev.patience and progress["stale_evals"] >= ev.patience and step < total_steps:
                    stopped_by = "patience"

            # ---- step checkpoints, stop requests ----
            if getattr(task, "stop_reason", None):
                stopped_by = "stalled"
            if stop.signal is not None:
                stopped_by = "signal"
            periodic = ck is not None and ck.every_steps and step % ck.every_steps == 0
            if ck is not None and (periodic or stopped_by == "signal"):
                save(ckpt.step_name(step))
            if stopped_by != "done":
                break

    if stopped_by == "patience":
        metrics.print(f"early stop at step {step}: no eval improvement in {ev.patience} evaluations")
    elif stopped_by == "stalled":
        metrics.print(f"stopped at step {step}: {task.stop_reason}")
    elif stopped_by == "signal":
        metrics.print(f"stopped at step {step}" + ("; continue with --resume" if ck else ""))
    out = save_output(model, loaded.tokenizer, cfg)
    metrics.print(f"wrote {out}")
    metrics.close({"done": "finished", "patience": "early_stopped", "signal": "stopped", "stalled": "stalled"}[stopped_by])
    if hasattr(task, "close"):
        task.close()
    return TrainResult(progress["step"], stopped_by, out, stop.exit_code, last_eval)
