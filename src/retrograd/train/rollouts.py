"""Rollouts for the RL loops: sample a group of completions per prompt with the live policy, score
them with the reward functions, and (DAPO's dynamic sampling) replace groups without learning signal
by fresh prompts; plus the completions log and the rollout metrics.

Randomness: every draw is seeded by (sampling seed, update, attempt) and each group by its place in
the update, so a resumed run samples and replaces exactly what the straight run did, and the ranks of
a torchrun launch (collect_sharded) draw exactly what one process would.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from retrograd.algorithms.advantages import overlong_penalty, zero_signal_groups
from retrograd.device import auto_sampling_dtype
from retrograd.models.load import DTYPES
from retrograd.rl.sampler import GroupStreams, Samples, sample, stop_string_check, whole_weights

# seeds of dynamic sampling's extra draws, far from the updates' own (update + attempt * this)
RESAMPLE_SEED_STRIDE = 7919 * 1_000_000


@dataclass
class Rollouts:
    """One update's groups: prompts[p] owns completions p*G .. p*G+G-1 (samples.prompt_index)."""
    prompts: list  # data.prompts.Prompt rows, one per group
    samples: Samples
    rewards: torch.Tensor  # [N] float64, the weighted sum (+ overlong penalty, + judge_weight x verdict)
    per_reward: dict[str, torch.Tensor]  # name -> [N] unweighted values ("judge": the verdicts)
    texts: list[str]  # decoded completions
    groups_sampled: int  # groups drawn, dynamic sampling's replacements included
    sampling_s: float
    reward_s: float
    judge_failed: torch.Tensor | None = None  # [N] bool: the judge failed on the row's group (it must not train)
    judge_metrics: dict = field(default_factory=dict)


def draw(model, tokenizer, prompts: list, group_size: int, sp, eos: set[int], seed_offset: int, *,
         greedy: bool = False, entropy: bool = False, group_ids: list[int] | None = None) -> Samples:
    """group_size completions of each prompt. Rollouts sample in sampling.dtype; greedy evaluation (and
    "auto") at the model's own precision (dtype None), so measured accuracy never depends on a speed
    setting. Each group draws from its own stream, seeded by (sampling.seed, seed_offset, its place
    `group_ids` in the whole update: by default its place in `prompts`)."""
    ids = group_ids if group_ids is not None else list(range(len(prompts)))
    gen = None if greedy else GroupStreams(sp.seed * 1_000_003 + seed_offset, ids, group_size)
    if greedy:
        dtype = None
    elif sp.dtype == "auto":  # the model's precision, unless bf16 is the slow path on this CPU
        param = next(model.parameters())
        dtype = auto_sampling_dtype(param.dtype, param.device)
    else:
        dtype = DTYPES[sp.dtype]
    return sample(model, [p.ids for p in prompts], group_size, sp.max_new_tokens, eos_ids=eos,
                  pad_id=tokenizer.pad_token_id, generator=gen, temperature=0.0 if greedy else sp.temperature,
                  top_k=sp.top_k, top_p=sp.top_p, stop=stop_string_check(tokenizer, list(sp.stop or [])), dtype=dtype,
                  entropy=entropy and not greedy)


def score(rewards: list, tokenizer, prompts: list, samples: Samples, max_new_tokens: int, overlong=None):
    """(total [N] float64, per reward [N], decoded texts). Each reward sees TRL's signature
    fn(prompts, completions, **columns); `overlong` ([grpo.overlong_penalty]) adds DAPO's soft penalty."""
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in samples.completion_ids]
    rows = [prompts[i] for i in samples.prompt_index]
    columns = {k: [r.columns[k] for r in rows] for k in rows[0].columns}
    per_reward, total = {}, torch.zeros(len(texts), dtype=torch.float64)
    for reward in rewards:
        values = torch.tensor(reward([r.text for r in rows], texts, columns), dtype=torch.float64)
        per_reward[reward.name] = values
        total += reward.weight * values
    if overlong is not None:
        lengths = torch.tensor([len(c) for c in samples.completion_ids])
        per_reward["overlong_penalty"] = overlong_penalty(lengths, max_new_tokens, overlong.buffer_tokens,
                                                          overlong.max_penalty)
        total += per_reward["overlong_penalty"]
    return total, per_reward, texts


def collect(model, tokenizer, prompts: list, pool: list, rewards: list, sp, G: int, eos: set[int], update: int, *,
            overlong=None, dynamic=None, entropy: bool = False, judge=None) -> Rollouts:
    """Sample and score one update's groups of G completions per prompt (sampling table `sp`); a
    `judge` (rl/judge.py) adds judge.weight x its verdict to each reward. With a dynamic sampling table,
    groups without learning signal (rewards all equal, or the judge failed on them) are replaced by
    groups of prompts from `pool` not used in this update, up to max_resample_factor draws."""
    t0 = time.perf_counter()
    samples = draw(model, tokenizer, prompts, G, sp, eos, update, entropy=entropy)
    t1 = time.perf_counter()
    total, per_reward, texts = score(rewards, tokenizer, prompts, samples, sp.max_new_tokens, overlong)
    judged = [_judge(judge, prompts, texts, G, update, total, per_reward)] if judge is not None else []
    out = Rollouts(list(prompts), samples, total, per_reward, texts, len(prompts), t1 - t0, time.perf_counter() - t1,
                   judged[0].failed_groups.repeat_interleave(G) if judged else None)
    if dynamic is not None:
        _resample(out, model, tokenizer, pool, rewards, sp, G, eos, update, overlong, dynamic, entropy, judge, judged)
    if judge is not None:
        from retrograd.rl.judge import judge_metrics
        out.judge_metrics = judge_metrics([r for j in judged for r in j.replies], out.per_reward["judge"],
                                          out.judge_failed.view(-1, G)[:, 0], G, [x for j in judged for x in j.spreads])
    return out


def collect_sharded(model, tokenizer, prompts: list, rewards: list, sp, G: int, eos: set[int], update: int, world, *,
                    overlong=None, entropy: bool = False) -> Rollouts:
    """collect() split over the ranks of a torchrun launch: each samples and scores every world-size-th
    group of the update (its own random stream per group, so exactly what one process would draw),
    then the ranks exchange their groups and every rank returns the whole update, in one process's
    order. (Completions are a few KB; the exchange is one all_gather of Python objects.) An FSDP2
    model samples from its weights gathered whole (whole_weights; every rank enters, one without
    groups too)."""
    from retrograd import dist
    mine = list(range(world.rank, len(prompts), world.size))
    t0 = time.perf_counter()
    part = None
    with whole_weights(model):
        samples = draw(model, tokenizer, [prompts[g] for g in mine], G, sp, eos, update, entropy=entropy,
                       group_ids=mine) if mine else None
    if mine:
        t1 = time.perf_counter()
        total, per_reward, texts = score(rewards, tokenizer, [prompts[g] for g in mine], samples, sp.max_new_tokens,
                                         overlong)
        part = (mine, samples, total, per_reward, texts, t1 - t0, time.perf_counter() - t1)
    parts = [p for p in dist.gather_objects(part) if p is not None]
    return merge_groups(prompts, parts, G)


def merge_groups(prompts: list, parts: list, G: int) -> Rollouts:
    """One update's Rollouts from the ranks' parts (group ids, Samples, rewards, per-reward values,
    texts, sampling s, reward s), groups back in the update's order."""
    where = {g: (part, j) for part in parts for j, g in enumerate(part[0])}
    names = list(parts[0][3])
    ids, logps, trunc, texts, ents, totals = [], [], [], [], [], []
    per = {name: [] for name in names}
    for g in range(len(prompts)):
        (_, s, total, per_reward, text, _, _), j = where[g]
        rows = slice(j * G, j * G + G)
        ids += s.completion_ids[rows]
        logps += s.behaviour_logprobs[rows]
        trunc += s.truncated[rows]
        texts += text[rows]
        totals.append(total[rows])
        for name in names:
            per[name].append(per_reward[name][rows])
        if s.entropies is not None:
            ents += s.entropies[rows]
    samples = Samples([i // G for i in range(len(ids))], ids, logps, trunc, sum(p[1].generated_tokens for p in parts),
                      ents if parts[0][1].entropies is not None else None)
    return Rollouts(list(prompts), samples, torch.cat(totals), {k: torch.cat(v) for k, v in per.items()}, texts,
                    len(prompts), max(p[5] for p in parts), max(p[6] for p in parts))


def _judge(judge, prompts: list, texts: list[str], G: int, update: int, total: torch.Tensor, per_reward: dict):
    """The judge's verdicts added to `total` in place (recorded as per_reward["judge"]); the Judgement."""
    j = judge.score(prompts, texts, G, update)
    per_reward["judge"] = j.verdicts
    total += judge.weight * j.verdicts
    return j


def _resample(out: Rollouts, model, tokenizer, pool, rewards, sp, G, eos, update, overlong, dynamic, entropy,
              judge, judged: list) -> None:
    used = {id(p) for p in out.prompts}
    for attempt in range(1, dynamic.max_resample_factor):
        dead_groups = zero_signal_groups(out.rewards, G)
        if out.judge_failed is not None:
            dead_groups |= out.judge_failed.view(-1, G)[:, 0]
        dead = dead_groups.nonzero().flatten().tolist()
        if not dead:
            break
        redo = _replacements([out.prompts[i] for i in dead], pool, used, sp.seed, update, attempt)
        t0 = time.perf_counter()
        more = draw(model, tokenizer, redo, G, sp, eos, update + RESAMPLE_SEED_STRIDE * attempt, entropy=entropy)
        t1 = time.perf_counter()
        r2, f2, x2 = score(rewards, tokenizer, redo, more, sp.max_new_tokens, overlong)
        if judge is not None:
            judged.append(_judge(judge, redo, x2, G, update + RESAMPLE_SEED_STRIDE * attempt, r2, f2))
        out.sampling_s += t1 - t0
        out.reward_s += time.perf_counter() - t1
        out.groups_sampled += len(redo)
        for j, i in enumerate(dead):
            out.prompts[i] = redo[j]
            src, dst = slice(j * G, (j + 1) * G), slice(i * G, (i + 1) * G)
            out.rewards[dst] = r2[src]
            for k in out.per_reward:
                out.per_reward[k][dst] = f2[k][src]
            out.texts[dst] = x2[src]
            if judge is not None:
                out.judge_failed[dst] = judged[-1].failed_groups[j]
            for name in ("completion_ids", "behaviour_logprobs", "truncated", "entropies"):
                mine, theirs = getattr(out.samples, name), getattr(more, name)
                if mine is not None:
                    mine[dst] = theirs[src]
        out.samples.generated_tokens += more.generated_tokens


def _replacements(dead: list, pool: list, used: set[int], seed: int, update: int, attempt: int) -> list:
    """Prompts to sample in place of `dead` ones: rows of `pool` not used in this update yet, drawn by a
    generator seeded from the sampling seed, the update and the attempt (so a resumed run draws the
    same). When the pool has too few unused rows, the rest re-draw their own prompt with a fresh seed."""
    free = [r for r in pool if id(r) not in used]
    rng = random.Random(f"{seed}:{update}:{attempt}")
    picks = rng.sample(free, min(len(free), len(dead)))
    used.update(id(r) for r in picks)
    return picks + dead[len(picks):]


def rollout_metrics(r: Rollouts, dead_groups: torch.Tensor) -> dict:
    lengths = torch.tensor([len(c) for c in r.samples.completion_ids], dtype=torch.float64)
    sampled_logp = [x for lp in r.samples.behaviour_logprobs for x in lp]
    m = {"reward/mean": float(r.rewards.mean()), "reward/std": float(r.rewards.std()) if len(r.rewards) > 1 else 0.0,
         "reward/min": float(r.rewards.min()), "reward/max": float(r.rewards.max()),
         # "correct": reward above 0.5, retrain's convention (SEPA's correctness gate reads it)
         "reward/correct_rate": float((r.rewards > 0.5).double().mean()),
         "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
         "completions/max_length": float(lengths.max()),
         "completions/truncation_fraction": sum(r.samples.truncated) / len(r.samples.truncated),
         "batch/zero_std_group_fraction": float(dead_groups.double().mean()),
         "batch/groups_sampled": r.groups_sampled,
         "policy/entropy": -sum(sampled_logp) / max(1, len(sampled_logp)),
         "time/sampling_s": r.sampling_s, "time/reward_s": r.reward_s,
         "system/sampling_tokens_per_second": r.samples.generated_tokens / max(r.sampling_s, 1e-9)}
    for name, v in r.per_reward.items():
        m[f"reward/{name}/mean"] = float(v.mean())
    return m


class CompletionsLog:
    """completions.jsonl in the run folder, every `every` updates; on resume the rows after the resumed
    step (written after the last checkpoint) are dropped, so the file reads as one run."""

    def __init__(self, run_dir: Path, step: int, every: int):
        self.every = every
        path = Path(run_dir) / "completions.jsonl"
        if path.exists():
            # split on "\n" only: completions may hold U+2028 and other characters splitlines() breaks on
            lines = path.read_text(encoding="utf-8").split("\n")
            keep = [line for line in lines if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in keep))
        self.file = path.open("a", encoding="utf-8")

    def write(self, step: int, r: Rollouts, advantages: torch.Tensor) -> None:
        if not self.every or step % self.every:
            return
        for i, text in enumerate(r.texts):
            row = {"step": step, "prompt": r.prompts[r.samples.prompt_index[i]].text, "completion": text,
                   "reward": float(r.rewards[i]), "advantage": float(advantages[i]),
                   "tokens": len(r.samples.completion_ids[i]), "truncated": r.samples.truncated[i]}
            self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def greedy_rewards(model, tokenizer, prompts: list, rewards: list, sp, eos: set[int], overlong=None,
                   chunk: int = 16) -> dict:
    """Mean reward of greedy completions of `prompts` ({"mean_reward": m, "<reward name>": mean}):
    the RL loops' held-out evaluation, in training and in `retrograd eval`."""
    total, per, n = 0.0, {}, 0
    for i in range(0, len(prompts), chunk):
        rows = prompts[i:i + chunk]
        samples = draw(model, tokenizer, rows, 1, sp, eos, 0, greedy=True)
        values, per_reward, _ = score(rewards, tokenizer, rows, samples, sp.max_new_tokens, overlong)
        total += float(values.sum())
        n += len(rows)
        for k, v in per_reward.items():
            per[k] = per.get(k, 0.0) + float(v.sum())
    return {"mean_reward": total / max(1, n), **{k: v / max(1, n) for k, v in per.items()}}
