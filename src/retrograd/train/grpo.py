"""GRPO with verifiable rewards as a Task of the shared loop (train/loop.py).

One optimizer step of the loop is one update:
  1. sample group_size completions for each of the update's prompts with the live policy
     (rl/sampler.py; seeded by sampling.seed and the update number, so a resume samples the same);
  2. score them with the reward functions (rl/rewards.py), add the overlong penalty, compute group
     advantages (algorithms/policy.py); groups without signal (all rewards equal) are dropped,
     or re-drawn with dynamic sampling;
  3. teacher-force prompt + completion through the policy (fused head, per-token log-probs at T = 1),
     and take grpo_epochs steps of the clipped surrogate (+ beta * k3 KL to the reference, the
     adapter disabled or [reference], scored without gradient when beta > 0). The first epoch's
     log-probs, detached, are the "old" policy's: the ratio is exactly 1 on-policy.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from retrograd.algorithms.policy import group_advantages, overlong_penalty, policy_loss, zero_signal_groups
from retrograd.algorithms.sft import IGNORE, linear_token_logprobs, select_targets
from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.data.prompts import load_prompts
from retrograd.data.sampler import evenly_spaced
from retrograd.data.sft import resolve_data_path
from retrograd.rl.rewards import rewards_from_config
from retrograd.models.load import DTYPES
from retrograd.rl.sampler import eos_ids, sample, split_prompts, stop_string_check
from retrograd.train.common import attention_for_length
from retrograd.train.loop import Setup, TrainResult, run_training
from retrograd.train.sft import CE_CHUNK_ROWS, TokenLoss


SHARED_PROMPT_MODELS = ("llama",)


class TokenLogprobs(TokenLoss):
    """Per-token log-probabilities of each row's completion: batch -> [B, Tc] (0 beyond each
    completion), through the fused chunked head."""

    def __call__(self, batch: dict, width: int) -> torch.Tensor:
        labels = batch["labels"]
        keep = labels[:, 1:] != IGNORE  # [B, T-1]
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(keep)[keep]
        cols = (keep.cumsum(1) - 1)[keep]  # position within the completion
        if self.fused:
            h, y = select_targets(self.hidden(batch), labels)
            logp = linear_token_logprobs(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)
        else:
            lp = torch.log_softmax(self.logits(batch)[:, :-1].float(), -1)
            logp = lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1)[keep]
        return torch.zeros(labels.shape[0], width, dtype=logp.dtype, device=logp.device).index_put((rows, cols), logp)

    def shared_prompts(self, prompts: list[list[int]], completions: list[list[int]], owner: list[int], width: int,
                       pad_id: int) -> torch.Tensor:
        """The same [N, width] log-probabilities, with each prompt run once for all its completions
        (completion i belongs to prompts[owner[i]]), and the prompts' common prefix (a chat template's
        system prompt, a shared instruction) run once for all prompts. Three passes, each on the cache
        of the one before: the common prefix [1, c]; the prompts' remainders [P, *] left-padded; the
        completions [N, *]. Keys and values keep their graph when gathered for the next pass, so
        gradients reach every shared position and the result equals one row per completion (tested),
        at c + sum(P remainders) + completion tokens instead of N x (prompt + completion)."""
        device = self.head.weight.device
        prefix, ids_p, attention_p, positions_p = split_prompts(prompts, pad_id, device)
        cache = None
        if prefix is not None:
            c = prefix.shape[0]
            cache = self.decoder(input_ids=prefix[None], position_ids=torch.arange(c, device=device)[None],
                                 use_cache=True).past_key_values
            cache.reorder_cache(torch.zeros(len(prompts), dtype=torch.long, device=device))  # one row per prompt
            attention_p = torch.cat([torch.ones_like(attention_p[:, :1]).expand(-1, c), attention_p], 1)
        out = self.decoder(input_ids=ids_p, attention_mask=attention_p, position_ids=positions_p,
                           past_key_values=cache, use_cache=True)
        rows = torch.tensor(owner, device=device)
        cache = out.past_key_values
        cache.reorder_cache(rows)  # index_select per layer: differentiable
        last = out.last_hidden_state[rows, -1:]  # [N, 1, H]
        n, n_max = len(completions), max(len(c) for c in completions)
        ids = torch.full((n, n_max), pad_id, dtype=torch.long, device=device)
        keep = torch.zeros((n, n_max), dtype=torch.bool, device=device)
        for i, c in enumerate(completions):
            ids[i, :len(c)] = torch.tensor(c, device=device)
            keep[i, :len(c)] = True
        attention = torch.cat([attention_p[rows], keep.long()], dim=1)
        positions = positions_p[rows, -1:] + 1 + torch.arange(n_max, device=device)[None]
        hidden = self.decoder(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                              use_cache=False).last_hidden_state  # [N, n_max, H]
        # token j of a completion is predicted from the position before it: the prompt's last for j = 0
        before = torch.cat([last, hidden[:, :-1]], dim=1)  # [N, n_max, H]
        logp = linear_token_logprobs(before[keep], self.head.weight, ids[keep], chunk_size=CE_CHUNK_ROWS)
        r = torch.arange(n, device=device)[:, None].expand_as(keep)[keep]
        c = torch.arange(n_max, device=device)[None].expand_as(keep)[keep]
        return torch.zeros(n, width, dtype=logp.dtype, device=device).index_put((r, c), logp)


def _collate(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """(prompt ids, completion ids) -> right-padded input_ids / labels (completion only) / mask."""
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p):n] = torch.tensor(c)
        attention[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attention if bool((attention == 0).any()) else None}


def _passes(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Indices split into passes whose padded size (rows x longest) fits the token budget."""
    if not budget:
        return [list(range(len(lengths)))]
    out, cur, width = [], [], 0
    for i, n in enumerate(lengths):
        w = max(width, n)
        if cur and w * (len(cur) + 1) > budget:
            out.append(cur)
            cur, w = [], n
        cur.append(i)
        width = w
    return out + ([cur] if cur else [])


class GrpoTask:
    eval_metric = "mean_reward"
    eval_higher_is_better = True
    # default training.micro_batch on CPU (SFT's is 512): one pass of 4 prompts x 4 completions x 32
    # tokens with 47-token prompts (~570 tokens run) took 15-20% less time than two passes (fewer,
    # larger matmuls, half the per-op overhead), for ~0.3 GB more activations on SmolLM2
    cpu_pass_tokens = 1024

    def __init__(self, s: Setup):
        cfg, g = s.cfg, s.cfg.grpo
        sp = g.sampling
        self.s, self.cfg, self.g, self.sp = s, cfg, g, sp
        tok = s.tokenizer
        self.rows = load_prompts(g.prompts, tok, cfg.training.ctx, sp.max_new_tokens, g.template_variables)
        self.eval_rows = []
        if cfg.evaluation is not None:
            ev_all = load_prompts(cfg.evaluation.data, tok, cfg.training.ctx, sp.max_new_tokens, g.template_variables)
            self.eval_rows = [ev_all[i] for i in evenly_spaced(len(ev_all), cfg.evaluation.max_examples)]
        s.log(f"data: {len(self.rows)} prompts" + (f", {len(self.eval_rows)} evaluation prompts" if self.eval_rows else ""))
        self.rewards = rewards_from_config(g, Path(cfg.source).parent)
        self.rows_per_step = g.prompts_per_update
        self.shuffle = g.prompt_order == "shuffled"
        self.total_steps = g.updates
        self.step_description = (f"{g.prompts_per_update} prompts x {g.group_size} completions "
                                 f"(<= {sp.max_new_tokens} tokens)")
        self.fingerprints = {"data": fingerprint_path(resolve_data_path(g.prompts))}
        if cfg.evaluation is not None:
            self.fingerprints["eval_data"] = fingerprint_path(resolve_data_path(cfg.evaluation.data))
        self.eos_ids = eos_ids(tok, s.model)
        self.logprobs = TokenLogprobs(s.model)
        # a group's completions share their prompt's forward in training (prompts are often most of
        # the tokens); checked equal to one row per completion on llama-architecture models
        self.share_prompts = self.logprobs.fused and s.model.config.model_type in SHARED_PROMPT_MODELS
        self.kl_multiplier, self.stalled = 1.0, 0
        self.stop_reason = None
        self.reference = None
        self.completions_file = None

    # ---- state kept in checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"kl_multiplier": self.kl_multiplier, "stalled": self.stalled}

    def load_state_dict(self, d: dict) -> None:
        self.kl_multiplier, self.stalled = d.get("kl_multiplier", 1.0), d.get("stalled", 0)

    def prepare(self, resume_path) -> None:
        if self.cfg.reference is not None and self.g.kl_coefficient > 0:
            from retrograd.models.load import load_model
            ref = load_model(self.cfg.reference.model, self.cfg.model.dtype, log=self.s.log)
            if ref.tokenizer.get_vocab() != self.s.tokenizer.get_vocab():
                from retrograd.errors import ConfigError
                raise ConfigError(f"reference.model {self.cfg.reference.model}: its tokenizer differs from the "
                                  "trained model's")
            self.reference = TokenLogprobs(ref.model.to(self.s.device).eval())

    def start_run(self, run_dir: Path, step: int) -> None:
        """completions.jsonl in the run folder; on resume the rows after the resumed step are dropped."""
        path = run_dir / "completions.jsonl"
        if path.exists():
            keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in keep))
        self.completions_file = path.open("a", encoding="utf-8")

    def close(self) -> None:
        if self.completions_file:
            self.completions_file.close()
        for r in self.rewards:
            if hasattr(r.fn, "close"):
                r.fn.close()

    # ---- sampling and scoring --------------------------------------------------------------------
    def _stop_check(self):
        return stop_string_check(self.s.tokenizer, list(self.sp.stop or []))

    def _sample(self, prompts, group_size, seed_offset: int, greedy: bool = False):
        gen = None if greedy else torch.Generator().manual_seed(self.sp.seed * 1_000_003 + seed_offset)
        # rollouts in sampling.dtype; greedy evaluation, and "auto", at the model's own precision
        # (dtype None), so the measured accuracy does not depend on a speed setting
        dtype = None if greedy or self.sp.dtype == "auto" else DTYPES[self.sp.dtype]
        return sample(self.s.model, [p.ids for p in prompts], group_size, self.sp.max_new_tokens,
                      eos_ids=self.eos_ids, pad_id=self.s.tokenizer.pad_token_id, generator=gen,
                      temperature=0.0 if greedy else self.sp.temperature, top_k=self.sp.top_k,
                      top_p=self.sp.top_p, stop=self._stop_check(), dtype=dtype)

    def _score(self, prompts, samples) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
        tok = self.s.tokenizer
        texts = [tok.decode(c, skip_special_tokens=True) for c in samples.completion_ids]
        rows = [prompts[i] for i in samples.prompt_index]
        columns = {k: [r.columns[k] for r in rows] for k in rows[0].columns}
        per_fn = {}
        total = torch.zeros(len(texts), dtype=torch.float64)
        for reward in self.rewards:
            values = torch.tensor(reward([r.text for r in rows], texts, columns), dtype=torch.float64)
            per_fn[reward.name] = values
            total += reward.weight * values
        if self.g.overlong_penalty is not None:
            ov = self.g.overlong_penalty
            lengths = torch.tensor([len(c) for c in samples.completion_ids])
            per_fn["overlong_penalty"] = overlong_penalty(lengths, self.sp.max_new_tokens, ov.buffer_tokens, ov.max_penalty)
            total += per_fn["overlong_penalty"]
        return total, per_fn, texts

    # ---- one update ----------------------------------------------------------------------------
    def step(self, prompts) -> dict:
        g, G = self.g, self.g.group_size
        t0 = time.perf_counter()
        samples = self._sample(prompts, G, self.step_index)
        t1 = time.perf_counter()
        rewards, per_fn, texts = self._score(prompts, samples)
        t2 = time.perf_counter()
        groups_sampled = len(prompts)
        if g.dynamic_sampling is not None:  # groups without signal: fresh prompts sampled in their place
            prompts, used = list(prompts), {id(p) for p in prompts}
            for attempt in range(1, g.dynamic_sampling.max_resample_factor):
                dead = zero_signal_groups(rewards, G).nonzero().flatten().tolist()
                if not dead:
                    break
                redo = self._replacements([prompts[i] for i in dead], used, attempt)
                t_s = time.perf_counter()
                more = self._sample(redo, G, self.step_index + 7919 * attempt * 1_000_000)
                t_r = time.perf_counter()
                r2, f2, x2 = self._score(redo, more)
                t2 += time.perf_counter() - t_r
                t1 += t_r - t_s
                groups_sampled += len(redo)
                for j, i in enumerate(dead):
                    prompts[i] = redo[j]
                    src, dst = slice(j * G, (j + 1) * G), slice(i * G, (i + 1) * G)
                    rewards[dst] = r2[src]
                    for k in per_fn:
                        per_fn[k][dst] = f2[k][src]
                    texts[dst] = x2[src]
                    samples.completion_ids[dst] = more.completion_ids[src]
                    samples.behaviour_logprobs[dst] = more.behaviour_logprobs[src]
                    samples.truncated[dst] = more.truncated[src]
        advantages = group_advantages(rewards, G, g.baseline, g.scale_rewards)
        dead_groups = zero_signal_groups(rewards, G)
        live = [i for i in range(len(texts)) if not dead_groups[i // G]
                and not (g.mask_truncated and samples.truncated[i])]
        metrics = self._rollout_metrics(rewards, per_fn, samples, dead_groups, groups_sampled, t1 - t0, t2 - t1)
        self._log_completions(prompts, samples, texts, rewards, advantages)
        if not live:
            self.stalled += 1
            if g.max_stalled_updates and self.stalled >= g.max_stalled_updates:
                self.stop_reason = f"{self.stalled} updates in a row without learning signal (grpo.max_stalled_updates)"
            metrics.update({"train/loss": 0.0, "train/tokens": 0, "time/training_s": 0.0})
            return metrics
        self.stalled = 0
        t3 = time.perf_counter()
        longest = max(len(prompts[samples.prompt_index[i]].ids) + len(samples.completion_ids[i]) for i in live)
        with attention_for_length(self.s.model, longest):
            metrics.update(self._train(prompts, samples, advantages, live))
        metrics["time/training_s"] = time.perf_counter() - t3
        return metrics

    def _replacements(self, dead: list, used: set[int], attempt: int) -> list:
        """Prompts to sample in place of `dead` ones (DAPO's dynamic sampling): rows of the prompt set
        not used in this update yet, drawn by a generator seeded from the sampling seed, the update
        and the attempt (so a resumed run draws the same). When the set has too few unused rows, the
        rest re-draw their own prompt with a fresh seed."""
        pool = [r for r in self.rows if id(r) not in used]
        rng = random.Random(f"{self.sp.seed}:{self.step_index}:{attempt}")
        picks = rng.sample(pool, min(len(pool), len(dead)))
        used.update(id(r) for r in picks)
        return picks + dead[len(picks):]

    def _beta(self) -> float:
        g = self.g
        beta = g.kl_coefficient * self.kl_multiplier
        if g.kl_schedule is not None and g.kl_schedule.warmup_updates:
            beta *= min(1.0, (self.step_index + 1) / g.kl_schedule.warmup_updates)
        return beta

    def _train(self, prompts, samples, advantages, live) -> dict:
        s, g, sp = self.s, self.g, self.sp
        seqs = [(prompts[samples.prompt_index[i]].ids, samples.completion_ids[i]) for i in live]
        adv = advantages[live].to(s.device)
        width = max(len(c) for _, c in seqs)
        n_tok = sum(len(c) for _, c in seqs)
        denominator = {"token": n_tok, "constant": len(seqs) * sp.max_new_tokens, "sequence": len(seqs)}[g.loss_normalisation]
        pad = s.tokenizer.pad_token_id
        if self.share_prompts:  # passes of whole groups, each prompt run once for its completions
            groups: dict[int, list[int]] = {}
            for j, i in enumerate(live):
                groups.setdefault(samples.prompt_index[i], []).append(j)
            passes, cost = [], 0
            for idx in groups.values():  # budget: prompt tokens + completion tokens actually run
                size = len(seqs[idx[0]][0]) + sum(len(seqs[j][1]) for j in idx)
                if passes and s.pass_tokens and cost + size > s.pass_tokens:
                    passes.append([])
                    cost = 0
                if not passes:
                    passes.append([])
                passes[-1].extend(idx)
                cost += size

            prompt_of = [samples.prompt_index[i] for i in live]

            def logprobs_of(scorer, idx):
                uniq = list(dict.fromkeys(prompt_of[j] for j in idx))
                row = {p: n for n, p in enumerate(uniq)}
                return scorer.shared_prompts([prompts[p].ids for p in uniq], [seqs[j][1] for j in idx],
                                             [row[prompt_of[j]] for j in idx], width, pad)
        else:
            passes = _passes([len(p) + len(c) for p, c in seqs], s.pass_tokens)

            def logprobs_of(scorer, idx):
                return scorer(self._batch([seqs[i] for i in idx]), width)
        beta = self._beta()
        ref_logp = {}
        if beta > 0:  # the reference: the adapter disabled, or [reference]
            with torch.no_grad():
                for k, idx in enumerate(passes):
                    if self.reference is not None:
                        ref_logp[k] = logprobs_of(self.reference, idx)
                    else:
                        with s.model.disable_adapter():
                            ref_logp[k] = logprobs_of(self.logprobs, idx)
        old = {}
        stats_all = []
        loss_total = 0.0
        for epoch in range(g.grpo_epochs):
            for k, idx in enumerate(passes):
                logp = logprobs_of(self.logprobs, idx)  # [b, width]
                n_completion = torch.tensor([len(seqs[j][1]) for j in idx], device=logp.device)  # [b]
                mask = n_completion[:, None] > torch.arange(width, device=logp.device)[None, :]
                if epoch == 0:
                    old[k] = logp.detach()
                pass_adv = adv[torch.tensor(idx, device=adv.device)]
                loss, st = policy_loss(logp, old[k], pass_adv, mask, clip_low=g.clip_range_low,
                                       clip_high=g.clip_range_high, level=g.importance_sampling_level,
                                       normalisation=g.loss_normalisation, max_new_tokens=sp.max_new_tokens,
                                       ref_logp=ref_logp.get(k), beta=beta, denominator=denominator)
                loss.backward()
                loss_total += float(loss.detach()) / g.grpo_epochs
                stats_all.append(st)
            if epoch < g.grpo_epochs - 1:
                self.optimizer_step()
        out = {"train/loss": loss_total, "policy/loss": loss_total,
               "train/tokens": sum(len(p) + len(c) for p, c in seqs) * g.grpo_epochs, "policy/beta": beta}
        tok_w = torch.tensor([float(st["tokens"]) for st in stats_all])
        for key in ("clip_fraction", "ratio_mean", "kl"):
            vals = [float(st[key]) for st in stats_all if key in st]
            if vals:
                out[f"policy/{key}"] = float((torch.tensor(vals) * tok_w[:len(vals)]).sum() / tok_w[:len(vals)].sum())
        out["policy/ratio_max"] = max(float(st["ratio_max"]) for st in stats_all)
        out["policy/ratio_min"] = min(float(st["ratio_min"]) for st in stats_all)
        if "policy/kl" in out and g.kl_schedule is not None and g.kl_schedule.target:
            target = g.kl_schedule.target  # adaptive: chase the target KL
            if out["policy/kl"] > 1.5 * target:
                self.kl_multiplier *= 1.5
            elif out["policy/kl"] < target / 1.5:
                self.kl_multiplier /= 1.5
        return out

    def _batch(self, seqs) -> dict:
        return {k: (v.to(self.s.device) if v is not None else None)
                for k, v in _collate(seqs, self.s.tokenizer.pad_token_id).items()}

    # ---- metrics, completions log, evaluation ----------------------------------------------------
    def _rollout_metrics(self, rewards, per_fn, samples, dead_groups, groups_sampled, t_sample, t_reward) -> dict:
        lengths = torch.tensor([len(c) for c in samples.completion_ids], dtype=torch.float64)
        sampled_logp = [x for lp in samples.behaviour_logprobs for x in lp]
        m = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
             "reward/min": float(rewards.min()), "reward/max": float(rewards.max()),
             "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
             "completions/max_length": float(lengths.max()),
             "completions/truncation_fraction": sum(samples.truncated) / len(samples.truncated),
             "batch/zero_std_group_fraction": float(dead_groups.double().mean()),
             "batch/groups_sampled": groups_sampled,
             "policy/entropy": -sum(sampled_logp) / max(1, len(sampled_logp)),
             "time/sampling_s": t_sample, "time/reward_s": t_reward,
             "system/sampling_tokens_per_second": samples.generated_tokens / max(t_sample, 1e-9)}
        for name, v in per_fn.items():
            m[f"reward/{name}/mean"] = float(v.mean())
        return m

    def _log_completions(self, prompts, samples, texts, rewards, advantages) -> None:
        every = self.g.log_completions_every
        if not self.completions_file or not every or (self.step_index + 1) % every:
            return
        for i, text in enumerate(texts):
            row = {"step": self.step_index + 1, "prompt": prompts[samples.prompt_index[i]].text, "completion": text,
                   "reward": float(rewards[i]), "advantage": float(advantages[i]), "tokens": len(samples.completion_ids[i]),
                   "truncated": samples.truncated[i]}
            self.completions_file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.completions_file.flush()

    def evaluate(self) -> dict:
        """Greedy completions of the evaluation prompts, scored by the same rewards."""
        total, per, n = 0.0, {}, 0
        for i in range(0, len(self.eval_rows), 16):
            chunk = self.eval_rows[i:i + 16]
            samples = self._sample(chunk, 1, 0, greedy=True)
            rewards, per_fn, _ = self._score(chunk, samples)
            total += float(rewards.sum())
            n += len(chunk)
            for k, v in per_fn.items():
                per[k] = per.get(k, 0.0) + float(v.sum())
        out = {"eval/mean_reward": total / max(1, n)}
        out.update({f"eval/reward/{k}": v / max(1, n) for k, v in per.items()})
        return out


def train_grpo(cfg, resume: str | None = None, log=print) -> TrainResult:
    return run_training(cfg, GrpoTask, resume, log)
