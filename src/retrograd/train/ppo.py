"""PPO with a critic: the RL loop, top to bottom in `train_ppo`.

Each update:
  1. sample one completion for each of `rollout_batch_size` prompts with the live policy (seeded by
     sampling.seed and the update) and score it with the rewards (train/rollouts.py);
  2. one pass without gradient records the rollout policy's log-probs (the "old" policy of every
     epoch) and the final hidden states before each token; the critic (train/critic.py, a value head
     on those states) gives V(s_t), GAE turns the terminal reward into per-token advantages and
     TD(lambda) returns (algorithms/gae.py), and the advantages are whitened over every completion
     token of the update; without a critic, the whitened sequence reward goes on every token;
  3. ppo_epochs optimizer steps of the clipped surrogate (Clip-Higher band, dual-clip) + beta * k3 KL
     toward the rollout policy (policy_update.epoch_backward), every epoch's gradient norm logged;
  4. the critic fits the returns (value_epochs full-batch steps); metrics; evaluation (greedy mean
     reward, best.state the highest); checkpoints carry the critic (weights and optimizer).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from retrograd import dist
from retrograd.algorithms.gae import gae, terminal_rewards, whiten
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
from retrograd.rl.judge import judge_from_config
from retrograd.rl.rewards import rewards_from_config
from retrograd.rl.sampler import eos_ids, whole_weights
from retrograd.train.checkpointing import run_meta
from retrograd.train.common import StopRequest
from retrograd.train.critic import Critic, ModelCritic
from retrograd.train.policy_update import build_batch, epoch_backward, keep_share, policy_metrics, score_old_policy
from retrograd.train.rollouts import CompletionsLog, collect, collect_sharded, greedy_rewards, rollout_metrics
from retrograd.train.setup import (TrainResult, check_resumable, evaluation_due, finish, lr_for, open_metrics,
                                   record_eval, resolve_resume, restore, save_checkpoint, schedule_state, start_run)

CPU_PASS_TOKENS = 1024


def train_ppo(cfg, resume: str | None = None, log=print) -> TrainResult:
    tr, ev, ck, p = cfg.training, cfg.evaluation, cfg.checkpoint, cfg.ppo
    sp, critic_cfg, base = p.sampling, p.critic, Path(cfg.source).parent
    resume_path = resolve_resume(cfg, resume)
    run = start_run(cfg, log, CPU_PASS_TOKENS)
    model, tok, world, log = run.model, run.tokenizer, run.world, run.log

    # ---- data, rewards, loss, critic -------------------------------------------------------------
    prompts = load_prompts(p.prompts, tok, tr.ctx, sp.max_new_tokens, p.template_variables)
    eval_prompts = []
    if ev is not None:
        eval_all = load_prompts(ev.data, tok, tr.ctx, sp.max_new_tokens, p.template_variables)
        eval_prompts = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
    log(f"data: {len(prompts)} prompts" + (f", {len(eval_prompts)} evaluation prompts" if eval_prompts else ""))
    rewards = rewards_from_config(p, base)
    judge = judge_from_config(p, seed=tr.seed, default_cache=Path(cfg.run.directory) / "judge-cache.jsonl")
    if judge is not None and not rewards and ev is not None:
        log("note: evaluation never calls the judge, and the judge is this run's only reward: eval/mean_reward "
            "will read 0 (add a verifiable reward to evaluate on)")
    eos = eos_ids(tok, model)
    loss_fn = POLICY_LOSSES.get("clip")
    loss_params = {"clip_low": p.clip_range, "clip_high": p.clip_range if p.clip_range_high is None
                   else p.clip_range_high, "clip_ratio_c": p.clip_ratio_c}
    scorer = Scorer(model)
    if not scorer.fusable:
        raise ConfigError(f"{cfg.source}: PPO's critic reads the final hidden states through the fused LM head; "
                          f"{model.config.model_type}'s head is not a plain linear layer")
    share_prompts = scorer.shares_prompts
    critic = None
    if critic_cfg.enabled and critic_cfg.critic == "model":
        critic = ModelCritic(critic_cfg, tr.seed, tok, run.device, log)
    elif critic_cfg.enabled:
        critic = Critic(model.config.hidden_size, critic_cfg, tr.seed)
    fingerprints = {"data": fingerprint_path(resolve_data_path(p.prompts))}
    if ev is not None:
        fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
    meta = run_meta(run.cfg, {"model": run.loaded.fingerprint, **fingerprints}, trajectory_settings(run.cfg),
                    run.lora_modules)

    # ---- progress: fresh or resumed --------------------------------------------------------------
    total = p.updates or tr.max_steps or tr.epochs * steps_per_epoch(len(prompts), p.rollout_batch_size)
    check_resumable(resume_path, meta)
    progress = restore(run, resume_path)
    if resume_path:
        if critic is not None:
            critic.load(Path(resume_path))
        log(f"resumed from {resume_path} at step {progress['step']} (epoch {progress['epoch']}, "
            f"row {progress['cursor']} of {len(prompts)})")
    metrics = open_metrics(run, total, progress)
    completions_log = CompletionsLog(run.run_dir, progress["step"], p.log_completions_every) if world.main else None
    log(f"training {total} steps of {p.rollout_batch_size} rollouts (<= {sp.max_new_tokens} tokens), "
        f"{'GAE with a ' + critic_cfg.critic + ' critic' if critic else 'whitened rewards, no critic'}; "
        f"run folder {run.run_dir}")

    def evaluate() -> dict:  # under torchrun each rank answers its share of the prompts
        mine = dist.shard(eval_prompts, world)
        with whole_weights(model):  # FSDP2: gathered once, so the ranks' chunks need not pair up
            r = greedy_rewards(model, tok, mine, rewards, sp, eos, p.overlong_penalty)
        r = dist.reduce_metrics(r, len(mine), set())
        return {"eval/mean_reward": r.pop("mean_reward"), **{f"eval/reward/{k}": v for k, v in r.items()}}

    def save(name: str) -> None:
        save_checkpoint(run, name, progress, meta, critic.save if critic is not None else None)

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
                                                                    p.prompt_order == "shuffled")
            batch = [prompts[i] for i in order[progress["cursor"]:progress["cursor"] + p.rollout_batch_size]]
            progress["cursor"] += len(batch)
            if progress["cursor"] >= len(prompts):
                progress["epoch"], progress["cursor"] = progress["epoch"] + 1, 0
            lr = lr_for(run, update, total)

            # ---- 1. sample and score -----------------------------------------------------------
            if world.distributed:  # each rank samples its share; every rank then holds (and trains on) them all
                rollouts = collect_sharded(model, tok, batch, rewards, sp, 1, eos, update, world,
                                           overlong=p.overlong_penalty)
            else:
                rollouts = collect(model, tok, batch, prompts, rewards, sp, 1, eos, update, overlong=p.overlong_penalty,
                                   judge=judge)
            samples = rollouts.samples
            failed = rollouts.judge_failed
            live = [i for i in range(len(samples.completion_ids)) if not (p.mask_truncated and samples.truncated[i])
                    and not (failed is not None and failed[i])]
            step_metrics = {**rollout_metrics(rollouts, torch.zeros(len(batch), dtype=torch.bool)),
                            **rollouts.judge_metrics}
            grad_norms, t_train = [], time.perf_counter()
            if live:
                seqs = [(rollouts.prompts[samples.prompt_index[i]].ids, samples.completion_ids[i]) for i in live]
                width = max(len(c) for _, c in seqs)
                lengths = torch.tensor([len(c) for _, c in seqs])
                mask = lengths[:, None] > torch.arange(width)[None]  # [L, W]
                update_batch = build_batch(seqs, [samples.prompt_index[i] for i in live] if share_prompts else None,
                                           torch.zeros(len(seqs), width, dtype=torch.float64),
                                           [samples.behaviour_logprobs[i] for i in live], run.pass_tokens,
                                           p.loss_normalisation, sp.max_new_tokens, tok.pad_token_id, run.device)
                with attention_for_length(model, max(len(q) + len(c) for q, c in seqs)):
                    # ---- 2. the rollout policy's log-probs and states; advantages -------------------------
                    states = score_old_policy(scorer, update_batch)  # [L, W, H]
                    reward = rollouts.rewards[live]
                    if critic is not None:
                        if isinstance(critic, ModelCritic):
                            critic.bind(update_batch)
                        features = critic.features(states)
                        values = critic.values(features)  # [L, W]
                        advantages, returns = gae(terminal_rewards(reward, lengths, width), values, mask,
                                                  critic_cfg.gamma, critic_cfg.gae_lambda)
                        step_metrics["critic/value_mean"] = float(values[mask].mean())
                        step_metrics["critic/returns_mean"] = float(returns[mask].mean())
                    else:
                        advantages = (reward.double()[:, None] * mask).double()
                    advantages = whiten(advantages, mask)
                    update_batch.advantages = advantages.to(run.device)
                    per_completion = torch.zeros(len(samples.completion_ids), dtype=torch.float64)
                    per_completion[torch.tensor(live)] = advantages.sum(1) / lengths  # its tokens' mean
                    if completions_log is not None:
                        completions_log.write(update + 1, rollouts, per_completion)

                    # ---- 3. ppo_epochs optimizer steps on the same rollouts ---------------------------------
                    if world.distributed:  # this rank's share of the passes; its first epoch records their old log-probs
                        update_batch = keep_share(update_batch, world)
                        update_batch.old.clear()
                        update_batch.is_weights.clear()
                    loss_total, stats = 0.0, []
                    for epoch in range(p.ppo_epochs):
                        loss, st = epoch_backward(scorer, update_batch, loss_fn, loss_params,
                                                  ref_logp=update_batch.old if p.kl_coefficient > 0 else None,
                                                  beta=p.kl_coefficient)
                        # under torchrun: every rank's passes summed, one process's gradient and loss
                        loss, st = dist.sum_epoch(run.params, loss, st)
                        grad_norms.append(optimizer_step(run.optimizer, run.params, tr.max_grad_norm))
                        loss_total += loss / p.ppo_epochs
                        stats += st
                # ---- 4. the critic fits the returns ------------------------------------------------------
                if critic is not None:
                    step_metrics.update(critic.fit(features, returns, mask))
                step_metrics.update(policy_metrics(stats, loss_total, p.kl_coefficient))
                step_metrics["train/tokens"] = update_batch.tokens() * p.ppo_epochs
            else:
                step_metrics.update({"train/loss": 0.0, "train/tokens": 0})

            # ---- metrics ---------------------------------------------------------------------------
            progress["step"] = step = update + 1
            progress["tokens_seen"] += step_metrics["train/tokens"]
            progress["lr_schedule"] = schedule_state(run, total, lr)
            dt = time.perf_counter() - t0
            step_metrics.update({"time/training_s": time.perf_counter() - t_train if live else 0.0,
                                 "train/epoch": step * p.rollout_batch_size / len(prompts), "optimizer/lr": lr,
                                 "optimizer/grad_norm": grad_norms[-1] if grad_norms else 0.0,
                                 "system/tokens_per_second": step_metrics["train/tokens"] / dt,
                                 "system/step_seconds": dt, **memory_metrics(run.device)})
            if len(grad_norms) > 1:
                step_metrics.update({f"optimizer/grad_norm/epoch_{e + 1}": n for e, n in enumerate(grad_norms)})
            metrics.log(step, step_metrics)

            # ---- evaluation, best.state, patience ----------------------------------------------------
            if evaluation_due(ev, step, total, rollout=True):
                eval_metrics = evaluate()
                last_eval = eval_metrics["eval/mean_reward"]
                improved = record_eval(progress, last_eval, True, ev.min_delta)
                metrics.log(step, {**eval_metrics, "eval/best_mean_reward": progress["best_eval"]})
                if improved and ck is not None and ck.mode in ("best_eval", "steps_and_best_eval"):
                    save("best.state")
                if ev.patience and progress["stale_evals"] >= ev.patience and step < total:
                    stopped_by = "patience"

            # ---- checkpoints, stop requests -----------------------------------------------------------
            if dist.any_rank(stop.signal is not None):  # every rank stops at the same update
                stopped_by = "signal"
            if ck is not None and ((ck.every_steps and step % ck.every_steps == 0) or stopped_by == "signal"):
                save(ckpt.step_name(step))
            if stopped_by != "done":
                break
    if completions_log is not None:
        completions_log.close()
    for r in rewards:
        if hasattr(r.fn, "close"):
            r.fn.close()
    return finish(run, metrics, progress, stopped_by, stop.exit_code, last_eval)
