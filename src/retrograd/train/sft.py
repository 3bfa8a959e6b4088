"""The SFT loop, top to bottom: load, (resume), then for each optimizer step take the next rows,
run the micro-batches, clip, step, log, evaluate, checkpoint; always write [output].path.

Loss normalisation: the summed token loss of all micro-batches of a step is divided by the number
of trained tokens of the whole step, so gradient accumulation gives the same update as one big
batch (TRL's and torchtune's convention).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.algorithms.schedule import lr_at
from retrograd.algorithms.sft import IGNORE, cross_entropy_sum_reference, linear_cross_entropy_sum, select_targets
from retrograd.checkpoint import state as ckpt
from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.config.load import config_as_dict, output_kind, trajectory_settings
from retrograd.export.gguf_lora import ARCHS as GGUF_ARCHS, check_exportable, write_gguf_lora
from retrograd.errors import CheckpointError
from retrograd.data.sampler import epoch_order, evenly_spaced, steps_per_epoch
from retrograd.data.sft import Example, Renderer, collate, load_examples, resolve_data_path, split_by_tokens
from retrograd.metrics import MetricsLogger
from retrograd.models.load import load_model
from retrograd.models.adapter_io import adapter_layout, apply_adapter, read_spec
from retrograd.models.lora import attach_lora
from retrograd.train import checkpointing as io
from retrograd.train.common import (StopRequest, build_optimizer, clip_gradients, configure_torch, peak_rss_mb,
                                    pick_device, prepare_run_dir, save_output, seed_everything)

# rows of logits alive at once in the fused loss: 256 x 49k vocabulary x 4 B = 50 MB (1,024 rows
# cost ~250 MB more peak memory and were no faster)
CE_CHUNK_ROWS = 256
# configs that transform logits after the head; those models take the plain full-logits path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


@dataclass
class SftResult:
    step: int
    stopped_by: str  # "done" | "patience" | "signal"
    output: Path
    exit_code: int = 0
    last_eval_loss: float | None = None


class TokenLoss:
    """Summed next-token loss of a micro-batch, through the fused chunked head when the model's
    head is a plain linear layer (no [B, T, V] logits), else through the model's own logits."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.head = base.get_output_embeddings()
        self.decoder = getattr(base, base.base_model_prefix)
        self.base = base
        plain_head = isinstance(self.head, torch.nn.Linear) and self.head.bias is None
        transforms = any(getattr(base.config, k, None) not in (None, 1.0) for k in _LOGIT_TRANSFORMS)
        self.fused = plain_head and not transforms

    def __call__(self, batch: dict) -> torch.Tensor:
        if not self.fused:
            logits = self.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               use_cache=False).logits  # [B, T, V]
            return cross_entropy_sum_reference(logits, batch["labels"])
        hidden = self.decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              use_cache=False).last_hidden_state  # [B, T, H]
        h, y = select_targets(hidden, batch["labels"])  # [N, H], [N]
        return linear_cross_entropy_sum(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)


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


def _to(batch: dict, device) -> dict:
    return {k: (v.to(device) if v is not None else None) for k, v in batch.items()}


def evaluate(loss_fn: TokenLoss, model, examples: list[Example], batch_size: int, pad_id: int, device) -> float:
    """Mean next-token loss over every trained token of `examples`."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            total += float(loss_fn(_to(collate(chunk, pad_id), device)))
            n += sum(e.n_targets for e in chunk)
    model.train(was_training)
    return total / max(1, n)


def train_sft(cfg, resume: str | None = None, log=print) -> SftResult:
    tr, sft, ev, ck = cfg.training, cfg.sft, cfg.evaluation, cfg.checkpoint
    # resolve --resume before the slow model load, so a wrong path fails at once
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
    configure_torch(tr.threads)
    device = pick_device(cfg.model.device)
    seed_everything(tr.seed)

    # ---- model, data, optimizer -------------------------------------------------------------
    loaded = load_model(cfg.model.path, cfg.model.dtype, log=log)
    model, tok = loaded.model, loaded.tokenizer
    gguf_copies = False
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
        gguf_copies = ck is not None and model.config.model_type in GGUF_ARCHS
        if ck is not None and not gguf_copies:
            log(f"note: no .gguf copies beside checkpoints: llama.cpp adapters are written for "
                f"{', '.join(GGUF_ARCHS)} models, not {model.config.model_type!r}")
    if tr.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_train, n_all = sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())
    log(f"model {loaded.source}: {n_all:,} parameters, {n_train:,} trainable ({tr.trainable})")

    renderer = Renderer(tok, tr.ctx, sft.assistant_only_loss, sft.template_variables)
    train_rows = load_examples(sft.data, sft.data_format, renderer)
    eval_rows = []
    if ev is not None:
        eval_all = load_examples(ev.data, sft.data_format, renderer)
        eval_rows = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
    truncated = sum(e.truncated for e in train_rows)
    log(f"data: {len(train_rows)} training rows ({truncated} truncated to ctx {tr.ctx})"
        + (f", {len(eval_rows)} evaluation rows" if ev else ""))

    rows_per_step = tr.batch_size * tr.gradient_accumulation
    total_steps = tr.max_steps or tr.epochs * steps_per_epoch(len(train_rows), rows_per_step)
    optimizer = build_optimizer(params, tr)
    pass_tokens = tr.micro_batch or (512 if device.type == "cpu" else None)
    loss_fn = TokenLoss(model)
    pad_id = tok.pad_token_id

    fingerprints = {"model": loaded.fingerprint, "data": fingerprint_path(resolve_data_path(sft.data))}
    if ev is not None:
        fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
    meta = io.run_meta(cfg, fingerprints, trajectory_settings(cfg), modules if tr.trainable == "lora" else None)

    # ---- progress (fresh, or restored from a checkpoint) --------------------------------------
    progress = {"step": 0, "epoch": 0, "cursor": 0, "best_eval": None, "stale_evals": 0, "tokens_seen": 0}
    if resume_path:
        io.check_resumable(Path(resume_path), meta)
        progress = io.load_training_state(Path(resume_path), model, optimizer, device)
        log(f"resumed from {resume_path} at step {progress['step']} (epoch {progress['epoch']}, "
            f"row {progress['cursor']} of {len(train_rows)})")

    run_dir = prepare_run_dir(cfg)
    metrics = MetricsLogger(run_dir, total_steps, tensorboard_dir=cfg.metrics.tensorboard_dir,
                            wandb_export_dir=cfg.metrics.wandb_export_dir, config=config_as_dict(cfg),
                            run_name=cfg.run.name, log_every=cfg.metrics.log_every, resume_step=progress["step"])
    log(f"training {total_steps} steps of {rows_per_step} rows "
        f"({tr.batch_size} x {tr.gradient_accumulation} accumulation); run folder {run_dir}")

    def save(name: str) -> None:
        io.save_training_state(Path(ck.directory), name, model, optimizer, progress, meta)
        if gguf_copies:  # a llama.cpp-loadable copy of the adapter beside each LoRA checkpoint
            from peft import get_peft_model_state_dict
            write_gguf_lora(Path(ck.directory) / name.replace(".state", ".gguf"), get_peft_model_state_dict(model),
                            cfg.lora.alpha, model.config, cfg.lora.dtype)

    stopped_by, last_eval, step = "done", None, progress["step"]
    if ev is not None and step == 0:
        # the base model's held-out loss, so every curve starts from where training began
        metrics.log(0, {"eval/loss": evaluate(loss_fn, model, eval_rows, ev.batch_size or tr.batch_size, pad_id, device)})
    order_epoch, order = -1, []
    with StopRequest() as stop:
        while progress["step"] < total_steps:
            t0 = time.perf_counter()
            # ---- the rows of this step: next in the seeded order of the current epoch ----
            if order_epoch != progress["epoch"]:
                order_epoch, order = progress["epoch"], epoch_order(len(train_rows), tr.seed, progress["epoch"], sft.shuffle)
            rows = [train_rows[i] for i in order[progress["cursor"]:progress["cursor"] + rows_per_step]]
            progress["cursor"] += len(rows)
            epoch_done = progress["cursor"] >= len(train_rows)
            if epoch_done:
                progress["epoch"], progress["cursor"] = progress["epoch"] + 1, 0

            # ---- forward/backward over the micro-batches, one optimizer step ----
            lr = lr_at(progress["step"], total_steps, tr.lr, tr.lr_scheduler, tr.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            n_targets = sum(e.n_targets for e in rows)
            loss_sum, n_tokens = 0.0, 0
            for i in range(0, len(rows), tr.batch_size):
                for chunk in split_by_tokens(rows[i:i + tr.batch_size], pass_tokens):
                    batch = _to(collate(chunk, pad_id), device)
                    loss = loss_fn(batch)
                    (loss / n_targets).backward()
                    loss_sum += float(loss.detach())
                    n_tokens += sum(len(e.input_ids) for e in chunk)
            grad_norm = clip_gradients(params, tr.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress["step"] += 1
            progress["tokens_seen"] += n_tokens
            # the schedule is a pure function of the step; these make the state readable on its own
            progress["lr_schedule"] = {"kind": tr.lr_scheduler, "peak_lr": tr.lr, "warmup_steps": tr.warmup_steps,
                                       "total_steps": total_steps, "last_lr": lr}
            step = progress["step"]
            dt = time.perf_counter() - t0
            metrics.log(step, {"train/loss": loss_sum / n_targets, "train/epoch": step * rows_per_step / len(train_rows),
                               "train/tokens": n_tokens, "train/target_tokens": n_targets, "optimizer/lr": lr,
                               "optimizer/grad_norm": grad_norm, "system/tokens_per_second": n_tokens / dt,
                               "system/step_seconds": dt, "system/peak_rss_mb": peak_rss_mb()})

            # ---- evaluation, best.state, patience ----
            if ev is not None and (
                    step == total_steps
                    or (ev.every_steps and step % ev.every_steps == 0)
                    or (ev.every_iterations and epoch_done and progress["epoch"] % ev.every_iterations == 0)
                    or (not ev.every_steps and not ev.every_iterations and epoch_done)):
                last_eval = evaluate(loss_fn, model, eval_rows, ev.batch_size or tr.batch_size, pad_id, device)
                best = progress["best_eval"]
                improved = best is None or last_eval < best - ev.min_delta
                if improved:
                    progress["best_eval"], progress["stale_evals"] = last_eval, 0
                else:
                    progress["stale_evals"] += 1
                metrics.log(step, {"eval/loss": last_eval, "eval/best_loss": progress["best_eval"]})
                if improved and ck is not None and ck.mode in ("best_eval", "steps_and_best_eval"):
                    save("best.state")
                if ev.patience and progress["stale_evals"] >= ev.patience and step < total_steps:
                    stopped_by = "patience"

            # ---- step checkpoints, stop requests ----
            if stop.signal is not None:
                stopped_by = "signal"
            periodic = ck is not None and ck.every_steps and step % ck.every_steps == 0
            if ck is not None and (periodic or stopped_by == "signal"):
                save(ckpt.step_name(step))
            if stopped_by != "done":
                break

    if stopped_by == "patience":
        metrics.print(f"early stop at step {step}: no eval improvement in {ev.patience} evaluations")
    elif stopped_by == "signal":
        metrics.print(f"stopped at step {step}" + ("; continue with --resume" if ck else ""))
    out = save_output(model, tok, cfg)
    metrics.print(f"wrote {out}")
    metrics.close({"done": "finished", "patience": "early_stopped", "signal": "stopped"}[stopped_by])
    return SftResult(progress["step"], stopped_by, out, stop.exit_code, last_eval)
