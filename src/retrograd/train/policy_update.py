"""The forward/backward of an RL update, called by the RL loops once per epoch:

  rows = trainable_rows(...)           groups with a learning signal (the others leave the update)
  batch = build_batch(...)             those completions, laid out in passes within the budget
  ref = reference_logprobs(...)        the KL reference's log-probs, once per update (beta > 0)
  for epoch: epoch_backward(...)       per pass: teacher-forced log-probs, the registered policy loss
                                       against the first epoch's log-probs ("old"), off-policy weights,
                                       + beta * k3 KL, aggregated over the whole update, backward

Gradients accumulate across passes; the caller steps the optimizer. Splitting an update into passes
gives the gradient of one pass (the normalisation's denominator is the whole update's), tested.

Under torchrun keep_share gives each rank its share of the passes. With FSDP2 (retrograd/dist.py) every
forward and backward of the sharded model is a collective, so: the no-grad passes (reference, old
policy) run on the weights gathered whole (dist.unsharded: no collectives, any number of passes); each
training pass's loss is scaled by the world size (the backward averages the ranks' gradients, and the
passes' losses are already divided by the whole update's denominator, so the sum is one process's);
and a rank with fewer passes runs zero-weight ones (dist.pad_passes) so the collectives pair up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from retrograd import dist
from retrograd.algorithms.advantages import zero_signal_groups
from retrograd.algorithms.off_policy import importance_weights
from retrograd.algorithms.policy_losses import aggregate, k3_kl
from retrograd.models.fused_head import IGNORE
from retrograd.models.logprobs import Scorer


@dataclass
class UpdateBatch:
    seqs: list[tuple[list[int], list[int]]]  # (prompt ids, completion ids) of each training row
    prompt_of: list[int] | None  # each row's group when a group's prompt runs once, else None
    passes: list[list[int]]  # row indices of each forward/backward pass
    advantages: torch.Tensor  # [L, W] token advantages
    behaviour: torch.Tensor  # [L, W] the sampler's log-probs of the sampled tokens
    width: int  # W: the longest completion
    normalisation: str  # token | constant | sequence
    max_new_tokens: int
    pad_id: int
    loss_scale: float = 1.0  # a factor on every pass's backward (the world size under FSDP2: keep_share)
    # filled by the first epoch: the policy before the update and the off-policy weights, per pass
    old: dict = field(default_factory=dict)
    is_weights: dict = field(default_factory=dict)

    @property
    def denominator(self) -> float:
        """The whole update's divisor, so that passes add up to the loss of one pass."""
        return {"token": sum(len(c) for _, c in self.seqs), "constant": len(self.seqs) * self.max_new_tokens,
                "sequence": len(self.seqs)}[self.normalisation]

    def tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in self.seqs)


def trainable_rows(rewards: torch.Tensor, group_size: int, truncated: list[bool], mask_truncated: bool,
                   excluded: torch.Tensor | None = None) -> list[int]:
    """The completions an update trains on: every row of each group with a learning signal (rewards
    not all equal), less those that hit max_new_tokens when mask_truncated and the `excluded` rows
    (a group the judge failed on)."""
    dead = zero_signal_groups(rewards, group_size)
    return [i for i in range(len(truncated)) if not dead[i // group_size] and not (mask_truncated and truncated[i])
            and not (excluded is not None and excluded[i])]


def build_batch(seqs, prompt_of: list[int] | None, advantages: torch.Tensor, behaviour: list[list[float]],
                budget: int | None, normalisation: str, max_new_tokens: int, pad_id: int, device) -> UpdateBatch:
    """`advantages` [L, >= W] of the rows `seqs`; `prompt_of` None runs every row with its own prompt."""
    width = max(len(c) for _, c in seqs)
    behaviour_t = torch.zeros(len(seqs), width)
    for i, lp in enumerate(behaviour):
        behaviour_t[i, :len(lp)] = torch.tensor(lp)
    return UpdateBatch(seqs, prompt_of, plan_passes(seqs, prompt_of, budget), advantages[:, :width].to(device),
                       behaviour_t.to(device), width, normalisation, max_new_tokens, pad_id)


def plan_passes(seqs, prompt_of: list[int] | None, budget: int | None) -> list[list[int]]:
    """Indices of `seqs` per pass, within the token budget. Shared prompts: passes of whole groups,
    costed at the prompt once + the completions; otherwise rows x the longest row."""
    if prompt_of is not None:
        groups: dict[int, list[int]] = {}
        for j, p in enumerate(prompt_of):
            groups.setdefault(p, []).append(j)
        passes, cost = [], 0
        for idx in groups.values():
            size = len(seqs[idx[0]][0]) + sum(len(seqs[j][1]) for j in idx)
            if not passes or (budget and cost + size > budget):
                passes.append([])
                cost = 0
            passes[-1].extend(idx)
            cost += size
        return passes
    if not budget:
        return [list(range(len(seqs)))]
    out, cur, width = [], [], 0
    for i, (p, c) in enumerate(seqs):
        w = max(width, len(p) + len(c))
        if cur and w * (len(cur) + 1) > budget:
            out.append(cur)
            cur, w = [], len(p) + len(c)
        cur.append(i)
        width = w
    return out + ([cur] if cur else [])


def keep_share(batch: UpdateBatch, world) -> UpdateBatch:
    """Under torchrun: re-plan the passes so each rank gets some (at most a world-size-th of the tokens per
    pass), and keep this rank's every world-size-th pass. The denominator stays the whole update's, so
    the ranks' summed gradients are one process's (dist.sum_gradients; under FSDP2, whose backward
    averages them, each pass's loss is scaled by the world size)."""
    if not world.distributed:
        return batch
    if batch.prompt_of is not None:
        cost = sum(len(batch.seqs[j][1]) for j in range(len(batch.seqs))) + sum(
            len(batch.seqs[j][0]) for j in {p: j for j, p in enumerate(batch.prompt_of)}.values())
    else:
        cost = max(len(p) + len(c) for p, c in batch.seqs) * len(batch.seqs)
    budget = -(-cost // world.size)
    planned = plan_passes(batch.seqs, batch.prompt_of, budget)
    if len(planned) < len(batch.passes):  # the caller's budget was the tighter one
        planned = batch.passes
    batch.passes = planned[world.rank::world.size]
    if world.strategy == "fsdp2":
        batch.loss_scale = float(world.size)
    return batch


def pass_logprobs(scorer: Scorer, batch: UpdateBatch, idx: list[int], states: bool = False):
    """[len(idx), W] per-token log-probs of the completions of rows idx (0 beyond each); with
    `states`, also the detached final hidden states that predicted them [len(idx), W, H]."""
    seqs, prompt_of = batch.seqs, batch.prompt_of
    if prompt_of is not None:
        uniq = list(dict.fromkeys(prompt_of[j] for j in idx))
        row = {p: n for n, p in enumerate(uniq)}
        first = {prompt_of[j]: j for j in reversed(idx)}
        return scorer.shared_prompt_logprobs([seqs[first[p]][0] for p in uniq], [seqs[j][1] for j in idx],
                                             [row[prompt_of[j]] for j in idx], batch.width, batch.pad_id, states)
    device = scorer.head.weight.device
    return scorer.token_logprobs({k: (v.to(device) if v is not None else None)
                                  for k, v in collate([seqs[j] for j in idx], batch.pad_id).items()}, batch.width,
                                 states)


def collate(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
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


@torch.no_grad()
def score_old_policy(scorer: Scorer, batch: UpdateBatch, correction: tuple = ("none", 3.0, None)) -> torch.Tensor:
    """Before an update whose advantages need the policy's states (PPO's critic): one pass without
    gradient records each pass's log-probs as the old policy (and the off-policy weights), and
    returns the detached final hidden states of every row [L, W, H] (the value head's features)."""
    with dist.unsharded(scorer.base):  # FSDP2: the whole weights, no collective per pass
        return _score_old_policy(scorer, batch, correction)


def _score_old_policy(scorer: Scorer, batch: UpdateBatch, correction: tuple) -> torch.Tensor:
    out = None
    for k, idx in enumerate(batch.passes):
        logp, states = pass_logprobs(scorer, batch, idx, states=True)
        rows = torch.tensor(idx, device=logp.device)
        n_completion = torch.tensor([len(batch.seqs[j][1]) for j in idx], device=logp.device)
        mask = (n_completion[:, None] > torch.arange(batch.width, device=logp.device)[None]).to(logp.dtype)
        batch.old[k] = logp
        batch.is_weights[k], _ = importance_weights(logp, batch.behaviour[rows], mask, *correction)
        if out is None:
            out = states.new_zeros(len(batch.seqs), batch.width, states.shape[-1])
        out[rows] = states
    return out


@torch.no_grad()
def reference_logprobs(scorer: Scorer, batch: UpdateBatch) -> dict[int, torch.Tensor]:
    """Per pass, the log-probs under `scorer` (the reference model, or the policy with its adapter
    disabled by the caller), without gradient. Under FSDP2 on the weights gathered whole (no collective
    per pass, so ranks with different numbers of passes need no padding)."""
    with dist.unsharded(scorer.base):
        return {k: pass_logprobs(scorer, batch, idx) for k, idx in enumerate(batch.passes)}


def epoch_backward(scorer: Scorer, batch: UpdateBatch, loss_fn, loss_params: dict, *, correction: tuple = ("none", 3.0, None),
                   ref_logp: dict | None = None, beta: float = 0.0) -> tuple[float, list[dict]]:
    """One epoch over the update's passes: backward of the aggregated loss (gradients accumulate).
    The first call records each pass's log-probs as the old policy and the off-policy weights of
    the sampler's distribution (`correction` = (mode, max, min)). Returns (loss, per-pass stats).
    A sharded (FSDP2) model: zero-weight passes until this rank has run as many as the busiest one."""
    total, stats = 0.0, []
    for k, idx in enumerate(batch.passes):
        loss, st = _pass_backward(scorer, batch, k, idx, loss_fn, loss_params, beta, ref_logp, correction)
        total += loss
        stats.append(st)
    if dist.is_sharded(scorer.base):
        dist.pad_passes(scorer.base, len(batch.passes), batch.pad_id, scorer.head.weight.device)
    return total, stats


def _pass_backward(scorer: Scorer, batch: UpdateBatch, k: int, idx: list[int], loss_fn, loss_params: dict, beta: float,
                   ref_logp: dict | None, correction: tuple) -> tuple[float, dict]:
    """Pass k's forward and backward: (its loss, its stats). Its own function so that the pass's graph
    dies before the next pass allocates (why: train/sft.py SftTask._pass_backward)."""
    logp = pass_logprobs(scorer, batch, idx)  # [b, W]
    rows = torch.tensor(idx, device=logp.device)
    n_completion = torch.tensor([len(batch.seqs[j][1]) for j in idx], device=logp.device)
    mask = (n_completion[:, None] > torch.arange(batch.width, device=logp.device)[None]).to(logp.dtype)
    first = k not in batch.old
    if first:  # the policy before this update: "old" for every epoch
        batch.old[k] = logp.detach()
        batch.is_weights[k], is_stats = importance_weights(batch.old[k], batch.behaviour[rows], mask, *correction)
    per_token, st = loss_fn(logp, batch.old[k], batch.advantages[rows].to(logp.dtype), mask, loss_params)
    if not isinstance(per_token, torch.Tensor) or per_token.shape != logp.shape:
        raise ValueError(f"the policy loss returned {getattr(per_token, 'shape', type(per_token).__name__)}, "
                         f"expected a per-token tensor {tuple(logp.shape)} (and a stats dict)")
    st = {**st, "tokens": mask.sum()}  # every loss's stats are weighted by its pass's tokens
    per_token = per_token * batch.is_weights[k]
    if beta > 0:
        kl = k3_kl(logp, ref_logp[k])
        per_token = per_token + beta * kl
        st["kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
    if first and correction[0] != "none":
        st.update({f"off_policy/{n}": v for n, v in is_stats.items()})
    loss = aggregate(per_token, mask, batch.normalisation, max_new_tokens=batch.max_new_tokens,
                     denominator=batch.denominator)
    (loss * batch.loss_scale if batch.loss_scale != 1.0 else loss).backward()
    return float(loss.detach()), st


def policy_metrics(stats: list[dict], loss: float, beta: float) -> dict:
    """Token-weighted means of the passes' statistics (ratio, clipping, KL, off-policy weights)."""
    out = {"train/loss": loss, "policy/loss": loss, "policy/beta": beta}
    tokens = [float(st["tokens"]) for st in stats]
    for key in sorted({k for st in stats for k in st} - {"tokens", "ratio_max", "ratio_min"}):
        have = [(float(st[key]), w) for st, w in zip(stats, tokens) if key in st]
        weight = sum(w for _, w in have)
        name = key if "/" in key else f"policy/{key}"
        out[name] = sum(v * w for v, w in have) / weight if weight > 0 else 0.0
    if all("ratio_max" in st for st in stats):
        out["policy/ratio_max"] = max(float(st["ratio_max"]) for st in stats)
        out["policy/ratio_min"] = min(float(st["ratio_min"]) for st in stats)
    return out
