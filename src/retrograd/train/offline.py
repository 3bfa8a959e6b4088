"""The offline loop (SFT, preference), top to bottom: resolve --resume, start the run (model + LoRA,
optimizer), let the Task load its data, restore a checkpoint, then for each optimizer step take the
next rows in the seeded epoch order, let the Task run forward/backward, step, log, evaluate,
checkpoint; always write [output].path. The building blocks are in train/setup.py.

What differs per algorithm lives in a Task (train/sft.py, train/preference.py), all of it required:
  rows, rows_per_step, shuffle      what one step consumes (step_description says it in words)
  epochs                            passes over rows (training.epochs; distill.offline_epochs)
  fingerprints                      data files a resume must find unchanged
  eval_metric                       the evaluation number best.state minimises ("loss", ...)
  prepare(resume_path)              work before the first step (e.g. scoring the reference once)
  step(rows) -> metrics             forward + backward of one optimizer step (no optimizer call)
  loss_weight(rows) -> float        what step's loss is a mean over (target tokens, pairs)
  loss_scale                        a factor on every backward (1; the rank's share of the step under FSDP2)
  evaluate() -> metrics             held-out metrics, `eval_metric` among them

Several processes (torchrun, retrograd/dist.py): each rank runs `step` on its share of the step's rows
(every world-size-th row); the gradients are all-reduced weighted by loss_weight, so every rank takes
the update one process takes on all the rows. Under FSDP2 (sharded weights, a full fine-tune) the
gradients are summed inside backward, so each rank's loss is scaled by its share of the step's weight
first, and a rank with fewer passes runs zero-weight ones (the collectives must pair up). Every rank evaluates (the replicas are identical, and
so are their numbers); rank 0 logs and writes.
"""
from __future__ import annotations

import time
from typing import Callable

from retrograd import dist
from retrograd.algorithms.optim import optimizer_step
from retrograd.checkpoint import state as ckpt
from retrograd.config.load import trajectory_settings
from retrograd.data.sampler import epoch_order, steps_per_epoch
from retrograd.device import memory_metrics
from retrograd.train.checkpointing import run_meta
from retrograd.train.common import StopRequest
from retrograd.train.setup import (Run, TrainResult, check_resumable, evaluation_due, finish, lr_for, open_metrics, record_eval,
                                   resolve_resume, restore, save_checkpoint, schedule_state, start_run)


# metrics that add up over the ranks' shares of a step (every other one is a mean, averaged by weight)
COUNT_METRICS = {"train/tokens", "train/target_tokens", "preference/pairs_per_step"}


def train_offline(cfg, make_task: Callable[[Run], object], resume: str | None = None, log=print) -> TrainResult:
    tr, ev, ck = cfg.training, cfg.evaluation, cfg.checkpoint
    resume_path = resolve_resume(cfg, resume)
    run = start_run(cfg, log)
    task = make_task(run)
    total_steps = tr.max_steps or task.epochs * steps_per_epoch(len(task.rows), task.rows_per_step)
    meta = run_meta(run.cfg, {"model": run.loaded.fingerprint, **task.fingerprints}, trajectory_settings(run.cfg),
                    run.lora_modules)
    check_resumable(resume_path, meta)
    task.prepare(resume_path)
    progress = restore(run, resume_path)
    if resume_path:
        run.log(f"resumed from {resume_path} at step {progress['step']} (epoch {progress['epoch']}, "
            f"row {progress['cursor']} of {len(task.rows)})")
    metrics = open_metrics(run, total_steps, progress)
    run.log(f"training {total_steps} steps of {task.step_description}; run folder {run.run_dir}")

    stopped_by, last_eval = "done", None
    if ev is not None and progress["step"] == 0:
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
            lr = lr_for(run, progress["step"], total_steps)
            mine = dist.shard(rows, run.world)
            weight = task.loss_weight(mine) if mine else 0.0
            if run.world.strategy == "fsdp2":  # gradients are averaged inside backward: weight the loss first
                total = dist.sum_value(weight)
                task.loss_scale = run.world.size * weight / total if total > 0 else 0.0
                with dist.ForwardCount(run.model) as passes:
                    step_metrics = task.step(mine) if mine else {}
                dist.pad_passes(run.model, passes.count, run.tokenizer.pad_token_id, run.device)
                step_metrics = dist.reduce_metrics(step_metrics, weight, COUNT_METRICS)
            else:
                step_metrics = task.step(mine) if mine else {}
                if run.world.distributed:
                    dist.all_reduce_gradients(run.params, weight)
                    step_metrics = dist.reduce_metrics(step_metrics, weight, COUNT_METRICS)
            grad_norm = optimizer_step(run.optimizer, run.params, tr.max_grad_norm)
            progress["step"] += 1
            progress["tokens_seen"] += step_metrics["train/tokens"]
            progress["lr_schedule"] = schedule_state(run, total_steps, lr)
            step = progress["step"]
            dt = time.perf_counter() - t0
            metrics.log(step, {**step_metrics, "train/epoch": step * task.rows_per_step / len(task.rows),
                               "optimizer/lr": lr, "optimizer/grad_norm": grad_norm,
                               "system/tokens_per_second": step_metrics["train/tokens"] / dt,
                               "system/step_seconds": dt, **memory_metrics(run.device)})

            # ---- evaluation, best.state, patience ----
            if evaluation_due(ev, step, total_steps, epoch_done, progress["epoch"]):
                eval_metrics = task.evaluate()
                last_eval = eval_metrics[f"eval/{task.eval_metric}"]
                improved = record_eval(progress, last_eval, False, ev.min_delta)
                metrics.log(step, {**eval_metrics, f"eval/best_{task.eval_metric}": progress["best_eval"]})
                if improved and ck is not None and ck.mode in ("best_eval", "steps_and_best_eval"):
                    save_checkpoint(run, "best.state", progress, meta)
                if ev.patience and progress["stale_evals"] >= ev.patience and step < total_steps:
                    stopped_by = "patience"

            # ---- step checkpoints, stop requests ----
            if dist.any_rank(stop.signal is not None):  # every rank stops at the same step
                stopped_by = "signal"
            if ck is not None and ((ck.every_steps and step % ck.every_steps == 0) or stopped_by == "signal"):
                save_checkpoint(run, ckpt.step_name(step), progress, meta)
            if stopped_by != "done":
                break
    return finish(run, metrics, progress, stopped_by, stop.exit_code, last_eval)
