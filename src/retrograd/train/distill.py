"""Distillation ([run] algorithm = "distill"): a student learns a teacher's distribution. Two loops, each
read top to bottom:

`on_policy` (train_on_policy): each update the student samples `samples_per_prompt` completions of
  `prompts_per_update` prompts; the teacher scores every sampled token; the per-token advantage is
  A_t = clamp(log p_T(y_t) - log p_S(y_t), +-weight_clip) (a one-sample reverse-KL signal: tokens
  the student over-weights against the teacher are pushed down; log p_S is the sampler's own when it
  drew from the plain distribution, else a no-grad forward's), fed to the shared clipped
  surrogate for `distill_epochs` steps (the ratio is 1 with one epoch), + beta * k3 KL toward the base
  (the adapter disabled).
`topk_offline` (train/distill_offline.py): forward KL on the teacher's top-k written once.

Under torchrun on_policy shares its updates as GRPO does (train/grpo.py), FSDP2 included: the student
samples, is evaluated and scored without gradient from its weights gathered whole; the teacher (and a
[reference]) is a plain model on every rank.

Teacher and student must share a tokenizer (checked; refused naming both). Metrics: distill/
teacher_kl_mean and teacher_kl_p95 (the sampled tokens' log p_S - log p_T),
advantage_clipped_fraction, teacher_top1_fraction (sampled tokens that are the teacher's first
choice); evaluation: the exact KL(p_S || p_T) per position over the whole vocabulary and the top-1
agreement on the student's greedy completions of the evaluation prompts (best.state: the lowest KL).
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from retrograd import dist
from retrograd.algorithms.optim import optimizer_step
from retrograd.algorithms.policy_losses import POLICY_LOSSES
from retrograd.checkpoint import state as ckpt
from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.config.load import trajectory_settings
from retrograd.data.prompts import load_prompts
from retrograd.data.sampler import epoch_order, evenly_spaced, steps_per_epoch
from retrograd.data.sft import resolve_data_path
from retrograd.device import attention_for_length, memory_metrics
from retrograd.errors import ConfigError
from retrograd.models.load import load_model, model_fingerprint
from retrograd.models.logprobs import Scorer, to_device
from retrograd.rl.sampler import eos_ids, whole_weights
from retrograd.train.checkpointing import run_meta
from retrograd.train.common import StopRequest
from retrograd.train.grpo import load_reference
from retrograd.train.policy_update import (build_batch, collate, epoch_backward, keep_share, policy_metrics,
                                           reference_logprobs)
from retrograd.train.rollouts import CompletionsLog, collect, collect_sharded, draw, rollout_metrics
from retrograd.train.setup import (TrainResult, check_resumable, evaluation_due, finish, lr_for, open_metrics,
                                   record_eval, resolve_resume, restore, save_checkpoint, schedule_state, start_run)

CPU_PASS_TOKENS = 1024


def load_teacher(cfg, student_tokenizer, device, log) -> Scorer:
    """The teacher, frozen, in eval mode; refused unless its tokenizer is the student's."""
    d = cfg.distill
    teacher = load_model(d.teacher_path, cfg.model.dtype, log=log)
    if teacher.tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(f"distill.teacher_path {d.teacher_path} and model.path {cfg.model.path} have different "
                          "tokenizers: distillation compares the two models' probabilities of the same token ids")
    teacher.model.requires_grad_(False)
    return Scorer(teacher.model.to(device).eval())


def train_distill(cfg, resume: str | None = None, log=print) -> TrainResult:
    if cfg.distill.mode == "topk_offline":
        from retrograd.train.distill_offline import train_topk_offline
        return train_topk_offline(cfg, resume, log)
    return train_on_policy(cfg, resume, log)


def train_on_policy(cfg, resume: str | None = None, log=print) -> TrainResult:
    tr, ev, ck, d = cfg.training, cfg.evaluation, cfg.checkpoint, cfg.distill
    sp, G = d.sampling, d.samples_per_prompt
    resume_path = resolve_resume(cfg, resume)
    run = start_run(cfg, log, CPU_PASS_TOKENS)
    model, tok, world, log = run.model, run.tokenizer, run.world, run.log

    # ---- data, teacher, loss ---------------------------------------------------------------------
    prompts = load_prompts(d.prompts, tok, tr.ctx, sp.max_new_tokens, d.template_variables, cut_answers=True)
    eval_prompts = []
    if ev is not None:
        eval_all = load_prompts(ev.data, tok, tr.ctx, sp.max_new_tokens, d.template_variables, cut_answers=True)
        eval_prompts = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
    log(f"data: {len(prompts)} prompts" + (f", {len(eval_prompts)} evaluation prompts" if eval_prompts else ""))
    teacher = load_teacher(cfg, tok, run.device, log)
    reference = load_reference(cfg, tok, run.device, log) if d.kl_coefficient > 0 and cfg.reference else None
    eos = eos_ids(tok, model)
    scorer = Scorer(model)
    share_prompts = scorer.shares_prompts
    plain_sampling = sp.temperature == 1.0 and sp.top_p == 1.0 and not sp.top_k
    loss_fn = POLICY_LOSSES.get("clip")
    loss_params = {"clip_low": d.clip_range_low, "clip_high": d.clip_range_high, "clip_ratio_c": 0.0}
    fingerprints = {"data": fingerprint_path(resolve_data_path(d.prompts)), "teacher": model_fingerprint(d.teacher_path)}
    if ev is not None:
        fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
    meta = run_meta(run.cfg, {"model": run.loaded.fingerprint, **fingerprints}, trajectory_settings(run.cfg),
                    run.lora_modules)

    total = d.updates or tr.max_steps or tr.epochs * steps_per_epoch(len(prompts), d.prompts_per_update)
    check_resumable(resume_path, meta)
    progress = restore(run, resume_path)
    if resume_path:
        log(f"resumed from {resume_path} at step {progress['step']} (epoch {progress['epoch']}, "
            f"row {progress['cursor']} of {len(prompts)})")
    metrics = open_metrics(run, total, progress)
    completions_log = CompletionsLog(run.run_dir, progress["step"], d.log_completions_every) if world.main else None
    log(f"training {total} steps of {d.prompts_per_update} prompts x {G} samples distilled from {d.teacher_path}; "
        f"run folder {run.run_dir}")

    def evaluate() -> dict:  # under torchrun each rank answers its share; means weighted by positions
        with whole_weights(model):  # FSDP2: gathered once, so the ranks' chunks need not pair up
            m, positions = evaluate_against_teacher(model, tok, teacher, dist.shard(eval_prompts, world), sp, eos,
                                                    with_count=True)
        return dist.reduce_metrics(m, positions, set())

    stopped_by, last_eval = "done", None
    if ev is not None and progress["step"] == 0:
        metrics.log(0, evaluate())
    order_epoch, order = -1, []
    with StopRequest() as stop:
        while progress["step"] < total:
            t0 = time.perf_counter()
            update = progress["step"]
            if order_epoch != progress["epoch"]:
                order_epoch, order = progress["epoch"], epoch_order(len(prompts), tr.seed, progress["epoch"],
                                                                    d.prompt_order == "shuffled")
            batch = [prompts[i] for i in order[progress["cursor"]:progress["cursor"] + d.prompts_per_update]]
            progress["cursor"] += len(batch)
            if progress["cursor"] >= len(prompts):
                progress["epoch"], progress["cursor"] = progress["epoch"] + 1, 0
            lr = lr_for(run, update, total)

            # ---- 1. the student samples ---------------------------------------------------------
            if world.distributed:  # each rank samples its share of the groups; all get the whole update
                rollouts = collect_sharded(model, tok, batch, [], sp, G, eos, update, world)
            else:
                rollouts = collect(model, tok, batch, prompts, [], sp, G, eos, update)
            samples = rollouts.samples
            live = [i for i in range(len(samples.completion_ids)) if not (d.mask_truncated and samples.truncated[i])]
            step_metrics = {k: v for k, v in rollout_metrics(rollouts, torch.zeros(len(batch), dtype=torch.bool))
                            .items() if not k.startswith(("reward/", "batch/"))}
            grad_norms, t_train = [], time.perf_counter()
            if live:
                seqs = [(rollouts.prompts[samples.prompt_index[i]].ids, samples.completion_ids[i]) for i in live]
                width = max(len(c) for _, c in seqs)
                lengths = torch.tensor([len(c) for _, c in seqs])
                mask = lengths[:, None] > torch.arange(width)[None]  # [L, W]
                update_batch = build_batch(seqs, [samples.prompt_index[i] for i in live] if share_prompts else None,
                                           torch.zeros(len(seqs), width, dtype=torch.float64),
                                           [samples.behaviour_logprobs[i] for i in live], run.pass_tokens,
                                           "token", sp.max_new_tokens, tok.pad_token_id, run.device)
                update_batch = keep_share(update_batch, world)  # under torchrun: this rank's passes
                mine = torch.zeros(len(seqs), dtype=torch.bool)  # the rows this rank scores and trains
                mine[[j for idx in update_batch.passes for j in idx]] = True
                with attention_for_length(model, max(len(q) + len(c) for q, c in seqs)):
                    # ---- 2. the teacher scores every sampled token: the per-token advantage ------------
                    # against the student's log-probs: the sampler's own when it sampled the plain
                    # distribution (temperature 1, no top-k / top-p: equal to a forward's), else one
                    # no-grad forward, which is then also the "old" policy of the surrogate's ratio
                    teacher_lp, teacher_first = teacher_scores(teacher, update_batch)
                    if plain_sampling:
                        student_lp = update_batch.behaviour.float().cpu()
                    else:
                        student_lp = torch.zeros(len(seqs), width)
                        for k, lp in reference_logprobs(scorer, update_batch).items():
                            student_lp[torch.tensor(update_batch.passes[k])] = lp.float().cpu()
                            update_batch.old[k], update_batch.is_weights[k] = lp, torch.ones_like(lp)
                    gap = (teacher_lp - student_lp)[mine][mask[mine]]  # log p_T - log p_S on the sampled tokens
                    first = teacher_first[mine][mask[mine]]
                    if world.distributed:  # every rank's tokens: the metrics one process reports
                        parts = dist.gather_objects((gap, first))
                        gap, first = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                    advantages = torch.where(mask, (teacher_lp - student_lp).clamp(-d.weight_clip, d.weight_clip), 0.0)
                    update_batch.advantages = advantages.double().to(run.device)
                    step_metrics.update(distill_metrics(gap, d.weight_clip))
                    step_metrics["distill/teacher_top1_fraction"] = float(first.double().mean())
                    if completions_log is not None:
                        completions_log.write(update + 1, rollouts, torch.zeros(len(samples.completion_ids)))
                    # ---- 3. distill_epochs steps of the surrogate (+ KL toward the base) ----------------
                    ref = None
                    if d.kl_coefficient > 0:  # [reference], or the policy with its adapter disabled
                        with (nullcontext() if reference is not None else model.disable_adapter()):
                            ref = reference_logprobs(reference or scorer, update_batch)
                    loss_total, stats = 0.0, []
                    for epoch in range(d.distill_epochs):
                        loss, st = epoch_backward(scorer, update_batch, loss_fn, loss_params, ref_logp=ref,
                                                  beta=d.kl_coefficient)
                        # under torchrun: every rank's passes summed, one process's gradient and loss
                        loss, st = dist.sum_epoch(run.params, loss, st)
                        grad_norms.append(optimizer_step(run.optimizer, run.params, tr.max_grad_norm))
                        loss_total += loss / d.distill_epochs
                        stats += st
                step_metrics.update(policy_metrics(stats, loss_total, d.kl_coefficient))
                step_metrics["train/tokens"] = update_batch.tokens() * d.distill_epochs
            else:
                step_metrics.update({"train/loss": 0.0, "train/tokens": 0})

            # ---- 4. metrics, evaluation, checkpoints ---------------------------------------------------
            progress["step"] = step = update + 1
            progress["tokens_seen"] += step_metrics["train/tokens"]
            progress["lr_schedule"] = schedule_state(run, total, lr)
            dt = time.perf_counter() - t0
            step_metrics.update({"time/training_s": time.perf_counter() - t_train if live else 0.0,
                                 "train/epoch": step * d.prompts_per_update / len(prompts), "optimizer/lr": lr,
                                 "optimizer/grad_norm": grad_norms[-1] if grad_norms else 0.0,
                                 "system/tokens_per_second": step_metrics["train/tokens"] / dt,
                                 "system/step_seconds": dt, **memory_metrics(run.device)})
            if len(grad_norms) > 1:
                step_metrics.update({f"optimizer/grad_norm/epoch_{e + 1}": n for e, n in enumerate(grad_norms)})
            metrics.log(step, step_metrics)
            if evaluation_due(ev, step, total, rollout=True):
                eval_metrics = evaluate()
                last_eval = eval_metrics["eval/teacher_kl"]
                improved = record_eval(progress, last_eval, False, ev.min_delta)
                metrics.log(step, {**eval_metrics, "eval/best_teacher_kl": progress["best_eval"]})
                if improved and ck is not None and ck.mode in ("best_eval", "steps_and_best_eval"):
                    save_checkpoint(run, "best.state", progress, meta)
                if ev.patience and progress["stale_evals"] >= ev.patience and step < total:
                    stopped_by = "patience"
            if dist.any_rank(stop.signal is not None):  # every rank stops at the same update
                stopped_by = "signal"
            if ck is not None and ((ck.every_steps and step % ck.every_steps == 0) or stopped_by == "signal"):
                save_checkpoint(run, ckpt.step_name(step), progress, meta)
            if stopped_by != "done":
                break
    if completions_log is not None:
        completions_log.close()
    return finish(run, metrics, progress, stopped_by, stop.exit_code, last_eval)


def distill_metrics(gap: torch.Tensor, weight_clip: float) -> dict:
    """`gap`: log p_T - log p_S of the sampled tokens. Its negation is a one-sample estimate of the
    per-token KL(p_S || p_T) (exact in expectation over the student's samples)."""
    if gap.numel() == 0:
        return {}
    kl = -gap.double()
    return {"distill/teacher_kl_mean": float(kl.mean()), "distill/teacher_kl_p95": float(torch.quantile(kl, 0.95)),
            "distill/advantage_clipped_fraction": float((gap.abs() > weight_clip).double().mean())}


@torch.no_grad()
def teacher_scores(teacher: Scorer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, W] the teacher's log-probs of the sampled tokens, [L, W] bool: the sampled token is the
    teacher's first choice), one right-padded pass per planned pass of the update."""
    lp, top1 = torch.zeros(len(batch.seqs), batch.width), torch.zeros(len(batch.seqs), batch.width, dtype=torch.bool)
    device = teacher.head.weight.device
    for idx in batch.passes:
        rows = [batch.seqs[j] for j in idx]
        flat_lp, flat_top1 = teacher.target_and_top1(to_device(collate(rows, batch.pad_id), device))
        at = 0
        for j, (_, completion) in zip(idx, rows):  # labels run row by row, each row's completion in order
            n = len(completion)
            lp[j, :n], top1[j, :n] = flat_lp[at:at + n], flat_top1[at:at + n]
            at += n
    return lp, top1


def evaluate_against_teacher(model, tok, teacher: Scorer, prompts: list, sp, eos, chunk: int = 16,
                             with_count: bool = False):
    """The student's greedy completions of `prompts`; at each of their positions the exact
    KL(p_student || p_teacher) over the vocabulary and whether both put the same token first.
    `with_count`: (metrics, the number of positions they average over)."""
    was_training = model.training
    model.eval()
    student, kls, same = Scorer(model), [], []
    device = student.head.weight.device
    for i in range(0, len(prompts), chunk):
        rows = prompts[i:i + chunk]
        samples = draw(model, tok, rows, 1, sp, eos, 0, greedy=True)
        seqs = [(rows[s].ids, c) for s, c in zip(samples.prompt_index, samples.completion_ids)]
        kl, agree = student.compare(teacher, to_device(collate(seqs, tok.pad_token_id), device))
        kls.append(kl)
        same.append(agree)
    model.train(was_training)
    if not kls:  # a rank without evaluation prompts
        return ({}, 0) if with_count else {}
    kl, agree = torch.cat(kls), torch.cat(same)
    out = {"eval/teacher_kl": float(kl.mean()), "eval/top1_agreement": float(agree.double().mean())}
    return (out, kl.numel()) if with_count else out
