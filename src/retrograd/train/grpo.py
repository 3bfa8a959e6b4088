"""GRPO with verifiable rewards: the RL loop, top to bottom in `train_grpo`.

Each update:
  1. sample group_size completions for each of the update's prompts with the live policy (seeded by
     sampling.seed and the update, so a resume samples the same) and score them with the rewards
     (train/rollouts.py; dynamic sampling replaces groups without signal);
  2. credit assignment (train/credit.py): episode advantages x token transforms, batch norm, clip;
     groups without signal (all rewards equal) leave the update;
  3. grpo_epochs optimizer steps on the same completions: teacher-forced log-probs (fused head, T = 1;
     a group's prompt runs once for all its completions), the registered policy loss against the
     first epoch's log-probs (so the ratio is exactly 1 on-policy), off-policy correction of the
     sampler's distribution when asked, + beta * k3 KL to the reference (the adapter disabled, or
     [reference]), aggregated by loss_normalisation;
  4. metrics (every epoch's gradient norm), evaluation (greedy mean reward; best.state is the
     highest), checkpoints.

Under torchrun each rank samples every N-th group (rollouts.collect_sharded: all ranks then hold the
whole update), computes the same advantages, backpropagates every N-th pass (keep_share) and the
gradients are summed: the update one process takes (retrograd/dist.py). With FSDP2 (sharded weights)
sampling and evaluation read the weights gathered whole (sampler.whole_weights), the training passes
go through the model's own forward (Scorer: no fused head, no shared prompts), the backward reduces the
gradients and the ranks' pass counts are padded to match (train/policy_update.py).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path


from retrograd import dist
from retrograd.algorithms.advantages import zero_signal_groups
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
from retrograd.models.logprobs import Scorer
from retrograd.algorithms.backpressure import backpressure_from_config
from retrograd.rl.judge import judge_from_config
from retrograd.rl.rewards import rewards_from_config
from retrograd.rl.sampler import eos_ids, whole_weights
from retrograd.train.checkpointing import run_meta
from retrograd.train.common import StopRequest
from retrograd.train.credit import Credit
from retrograd.train.policy_update import (build_batch, epoch_backward, keep_share, policy_metrics, reference_logprobs,
                                           trainable_rows)
from retrograd.train.rollouts import CompletionsLog, collect, collect_sharded, greedy_rewards, rollout_metrics
from retrograd.train.setup import (TrainResult, check_resumable, evaluation_due, finish, lr_for, open_metrics,
                                   record_eval, resolve_resume, restore, save_checkpoint, schedule_state, start_run)

# default training.micro_batch on CPU (SFT's is 512): one pass of 4 prompts x 4 completions x 32 tokens
# with 47-token prompts (~570 tokens run) took 15-20% less time than two passes (fewer, larger matmuls,
# half the per-op overhead), for ~0.3 GB more activations on SmolLM2
CPU_PASS_TOKENS = 1024


def train_grpo(cfg, resume: str | None = None, log=print) -> TrainResult:
    tr, ev, ck, g = cfg.training, cfg.evaluation, cfg.checkpoint, cfg.grpo
    sp, G, base = g.sampling, g.group_size, Path(cfg.source).parent
    resume_path = resolve_resume(cfg, resume)
    run = start_run(cfg, log, CPU_PASS_TOKENS)
    model, tok, world, log = run.model, run.tokenizer, run.world, run.log

    # ---- data, rewards, credit assignment, loss, reference ---------------------------------------
    prompts = load_prompts(g.prompts, tok, tr.ctx, sp.max_new_tokens, g.template_variables)
    eval_prompts = []
    if ev is not None:
        eval_all = load_prompts(ev.data, tok, tr.ctx, sp.max_new_tokens, g.template_variables)
        eval_prompts = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
    log(f"data: {len(prompts)} prompts" + (f", {len(eval_prompts)} evaluation prompts" if eval_prompts else ""))
    rewards = rewards_from_config(g, base)
    judge = judge_from_config(g, seed=tr.seed, default_cache=Path(cfg.run.directory) / "judge-cache.jsonl")
    if judge is not None and not rewards and ev is not None:
        log("note: evaluation never calls the judge, and the judge is this run's only reward: eval/mean_reward "
            "will read 0 (add a verifiable reward to evaluate on)")
    eos = eos_ids(tok, model)
    credit = Credit(g, tok, base)
    loss_fn = POLICY_LOSSES.get(g.policy_loss, base)
    loss_params = {"clip_low": g.clip_range_low, "clip_high": g.clip_range_high, "clip_ratio_c": g.clip_ratio_c,
                   **g.policy_loss_params}
    correction = (g.importance_correction, g.importance_correction_max, g.importance_correction_min)
    scorer = Scorer(model)
    share_prompts = scorer.shares_prompts
    reference = load_reference(cfg, tok, run.device, log) if g.kl_coefficient > 0 and cfg.reference else None
    fingerprints = {"data": fingerprint_path(resolve_data_path(g.prompts))}
    if ev is not None:
        fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
    meta = run_meta(run.cfg, {"model": run.loaded.fingerprint, **fingerprints}, trajectory_settings(run.cfg),
                    run.lora_modules)

    # ---- progress: fresh or resumed --------------------------------------------------------------
    total = g.updates or tr.max_steps or tr.epochs * steps_per_epoch(len(prompts), g.prompts_per_update)
    check_resumable(resume_path, meta)
    progress = restore(run, resume_path)
    loop_state = {"kl_multiplier": 1.0, "stalled": 0, **(progress.get("task") or {})}
    credit.load_state_dict(loop_state.pop("credit", None) or {})
    bp = backpressure_from_config(cfg.backpressure, G)  # None unless [backpressure] enabled
    if bp is not None:
        bp.load_state_dict(loop_state.pop("backpressure", None) or {})
    if resume_path:
        log(f"resumed from {resume_path} at step {progress['step']} (epoch {progress['epoch']}, "
            f"row {progress['cursor']} of {len(prompts)})")
    metrics = open_metrics(run, total, progress)
    completions_log = CompletionsLog(run.run_dir, progress["step"], g.log_completions_every) if world.main else None
    log(f"training {total} steps of {g.prompts_per_update} prompts x {G} completions (<= {sp.max_new_tokens} tokens); "
        f"run folder {run.run_dir}")

    def evaluate() -> dict:  # under torchrun each rank answers its share of the prompts
        mine = dist.shard(eval_prompts, world)
        with whole_weights(model):  # FSDP2: gathered once, so the ranks' chunks need not pair up
            r = greedy_rewards(model, tok, mine, rewards, sp, eos, g.overlong_penalty)
        r = dist.reduce_metrics(r, len(mine), set())
        return {"eval/mean_reward": r.pop("mean_reward"), **{f"eval/reward/{k}": v for k, v in r.items()}}

    stopped_by, last_eval, reason = "done", None, ""
    if ev is not None and progress["step"] == 0:
        metrics.log(0, evaluate())  # the base model's numbers: every curve starts where training began
    order_epoch, order = -1, []
    with StopRequest() as stop:
        while progress["step"] < total:
            t0 = time.perf_counter()
            update = progress["step"]
            if order_epoch != progress["epoch"]:
                order_epoch, order = progress["epoch"], epoch_order(len(prompts), tr.seed, progress["epoch"],
                                                                    g.prompt_order == "shuffled")
            per_update = bp.next_batch_size() if bp is not None else g.prompts_per_update
            batch = [prompts[i] for i in order[progress["cursor"]:progress["cursor"] + per_update]]
            progress["cursor"] += len(batch)
            if progress["cursor"] >= len(prompts):
                progress["epoch"], progress["cursor"] = progress["epoch"] + 1, 0
            lr = lr_for(run, update, total)

            # ---- 1. sample and score -----------------------------------------------------------
            if world.distributed:  # each rank samples its share of the groups; all get the whole update
                rollouts = collect_sharded(model, tok, batch, rewards, sp, G, eos, update, world,
                                           overlong=g.overlong_penalty, entropy=credit.needs_entropy)
            else:
                rollouts = collect(model, tok, batch, prompts, rewards, sp, G, eos, update, overlong=g.overlong_penalty,
                                   dynamic=g.dynamic_sampling, entropy=credit.needs_entropy, judge=judge)
            samples = rollouts.samples

            # ---- 2. advantages; which completions train ----------------------------------------
            token_adv, episode_adv, adv_metrics = credit.assign(rollouts, update)
            live = trainable_rows(rollouts.rewards, G, samples.truncated, g.mask_truncated, rollouts.judge_failed)
            step_metrics = {**rollout_metrics(rollouts, zero_signal_groups(rollouts.rewards, G)), **adv_metrics,
                            **rollouts.judge_metrics}
            if completions_log is not None:
                completions_log.write(update + 1, rollouts, episode_adv)

            # ---- 3. grpo_epochs optimizer steps on the same completions ------------------------
            grad_norms, t_train = [], time.perf_counter()
            if live:
                loop_state["stalled"] = 0
                seqs = [(rollouts.prompts[samples.prompt_index[i]].ids, samples.completion_ids[i]) for i in live]
                update_batch = build_batch(seqs, [samples.prompt_index[i] for i in live] if share_prompts else None,
                                     token_adv[live], [samples.behaviour_logprobs[i] for i in live], run.pass_tokens,
                                     g.loss_normalisation, sp.max_new_tokens, tok.pad_token_id, run.device)
                update_batch = keep_share(update_batch, world)  # under torchrun: this rank's passes
                beta = kl_beta(g, loop_state["kl_multiplier"], update)
                params = {**loss_params, "seed": tr.seed * 1_000_003 + update} if "seed" in loss_params else loss_params
                with attention_for_length(model, max(len(p) + len(c) for p, c in seqs)):
                    ref_logp = None
                    if beta > 0:  # the reference: [reference], or the policy with its adapter disabled
                        with (nullcontext() if reference is not None else model.disable_adapter()):
                            ref_logp = reference_logprobs(reference or scorer, update_batch)
                    loss_total, stats = 0.0, []
                    for epoch in range(g.grpo_epochs):
                        loss, st = epoch_backward(scorer, update_batch, loss_fn, params, correction=correction,
                                                  ref_logp=ref_logp, beta=beta)
                        # under torchrun: every rank's passes summed, one process's gradient and loss
                        loss, st = dist.sum_epoch(run.params, loss, st)
                        grad_norms.append(optimizer_step(run.optimizer, run.params, tr.max_grad_norm))
                        loss_total += loss / g.grpo_epochs
                        stats += st
                step_metrics.update(policy_metrics(stats, loss_total, beta))
                step_metrics["train/tokens"] = update_batch.tokens() * g.grpo_epochs
                adapt_kl(g, loop_state, step_metrics.get("policy/kl"))
            else:
                loop_state["stalled"] += 1
                if g.max_stalled_updates and loop_state["stalled"] >= g.max_stalled_updates:
                    stopped_by = "stalled"
                    reason = f"{loop_state['stalled']} updates in a row without learning signal (grpo.max_stalled_updates)"
                step_metrics.update({"train/loss": 0.0, "train/tokens": 0})

            # ---- 4. metrics ---------------------------------------------------------------------
            progress["step"] = step = update + 1
            progress["tokens_seen"] += step_metrics["train/tokens"]
            progress["lr_schedule"] = schedule_state(run, total, lr)
            if bp is not None:  # the controller sees the whole update's time, then picks the next batch size
                step_metrics.update(bp.observe(len(batch), step_metrics["train/tokens"], time.perf_counter() - t0))
            progress["task"] = {**loop_state, "credit": credit.state_dict(),
                                **({"backpressure": bp.state_dict()} if bp is not None else {})}
            dt = time.perf_counter() - t0
            step_metrics.update({"time/training_s": time.perf_counter() - t_train if live else 0.0,
                                 "train/epoch": progress["epoch"] + progress["cursor"] / len(prompts), "optimizer/lr": lr,
                                 "optimizer/grad_norm": grad_norms[-1] if grad_norms else 0.0,
                                 "system/tokens_per_second": step_metrics["train/tokens"] / dt,
                                 "system/step_seconds": dt, **memory_metrics(run.device)})
            if len(grad_norms) > 1:  # every epoch's norm: a growing one says the update left the trust region
                step_metrics.update({f"optimizer/grad_norm/epoch_{e + 1}": n for e, n in enumerate(grad_norms)})
            metrics.log(step, step_metrics)

            # ---- 5. evaluation, best.state, patience ----------------------------------------------
            if evaluation_due(ev, step, total, rollout=True):
                eval_metrics = evaluate()
                last_eval = eval_metrics["eval/mean_reward"]
                improved = record_eval(progress, last_eval, True, ev.min_delta)
                metrics.log(step, {**eval_metrics, "eval/best_mean_reward": progress["best_eval"]})
                if improved and ck is not None and ck.mode in ("best_eval", "steps_and_best_eval"):
                    save_checkpoint(run, "best.state", progress, meta)
                if ev.patience and progress["stale_evals"] >= ev.patience and step < total:
                    stopped_by = "patience"

            # ---- 6. checkpoints, stop requests -----------------------------------------------------
            if dist.any_rank(stop.signal is not None):  # every rank stops at the same update
                stopped_by = "signal"
            if ck is not None and ((ck.every_steps and step % ck.every_steps == 0) or stopped_by == "signal"):
                save_checkpoint(run, ckpt.step_name(step), progress, meta)
            if stopped_by != "done":
                break
    if completions_log is not None:
        completions_log.close()
    for r in rewards:
        if hasattr(r.fn, "close"):
            r.fn.close()
    return finish(run, metrics, progress, stopped_by, stop.exit_code, last_eval, reason)


# ---- the pieces the loop calls --------------------------------------------------------------------
def load_reference(cfg, tokenizer, device, log) -> Scorer:
    """[reference] model, scored without gradient for the KL term; same tokenizer required."""
    from retrograd.models.load import load_model
    ref = load_model(cfg.reference.model, cfg.model.dtype, log=log)
    if ref.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"reference.model {cfg.reference.model}: its tokenizer differs from the trained model's")
    return Scorer(ref.model.to(device).eval())


def kl_beta(g, multiplier: float, update: int) -> float:
    """The KL coefficient of this update: kl_coefficient x the adaptive multiplier x the warm-up ramp."""
    beta = g.kl_coefficient * multiplier
    if g.kl_schedule is not None and g.kl_schedule.warmup_updates:
        beta *= min(1.0, (update + 1) / g.kl_schedule.warmup_updates)
    return beta


def adapt_kl(g, loop_state: dict, measured: float | None) -> None:
    """[grpo.kl_schedule] target: x1.5 / /1.5 on the multiplier to keep the measured KL near the target."""
    if measured is None or g.kl_schedule is None or not g.kl_schedule.target:
        return
    if measured > 1.5 * g.kl_schedule.target:
        loop_state["kl_multiplier"] *= 1.5
    elif measured < g.kl_schedule.target / 1.5:
        loop_state["kl_multiplier"] /= 1.5
