"""Preference optimisation (DPO, IPO, SimPO, ORPO) as a Task of the offline loop (train/offline.py).

A step takes `pairs_per_step` pairs; each forward/backward pass holds whole pairs (both sides), as
many as fit in the pass token budget. The policy's summed response log-probabilities S come from
the fused chunked head (no [B, T, V] logits), with each pair's prompt run once for both of its
sides (`pair_logprobs`); the loss (algorithms/preference.py) is averaged over the step's pairs, so
accumulation over passes gives the same update as one pass.

The reference (DPO/IPO) is scored once before the first step: the policy as it starts
(`reference = "initial"`), the base model with the adapter disabled (`"base"`), or
`[reference] model`, which is loaded, scored and freed, so training never holds a second model.
The scores are cached beside the checkpoints (train/reference_cache.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from retrograd.algorithms.preference import NEEDS_REFERENCE, PreferenceParams, preference_loss
from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.data.preference import Pair, flatten, load_pairs, prompt_length, response_lengths, split_pairs
from retrograd.data.sampler import evenly_spaced
from retrograd.data.sft import IGNORE, Renderer, collate, resolve_data_path
from retrograd.errors import ConfigError
from retrograd.models.logprobs import Scorer, to_device
from retrograd.train import reference_cache
from retrograd.train.offline import train_offline
from retrograd.train.setup import Run, TrainResult

# Reference scoring and evaluation run without gradient, so a pass holds no activations for a backward
# and can take more tokens than a training pass: 4x (2,048 tokens at the CPU default) scored the
# reference of 20 pairs of SmolLM2 in 4.4 s instead of 5.6 s on a 2-core Xeon (fewer, fuller matmuls
# and one run of the shared prefix per pass); 8x was no faster.
SCORING_PASS_FACTOR = 4


def pair_logprobs(scorer: Scorer, pairs: list[Pair], pad_id: int, device) -> torch.Tensor:
    """[2 x len(pairs)] float32 summed response log-probs, (chosen, rejected) per pair in order. A
    pair's two sides share their prompt token for token (data/preference.py checks it), so where the
    model allows it the prompt runs once for both sides, and the prompts' common prefix (a chat
    template's system prompt) once for the whole pass: same values as one row per side (tested)."""
    if not scorer.shares_prompts:
        return scorer.sequence_logprobs(to_device(collate(flatten(pairs), pad_id), device))
    prompts, completions, scored = [], [], []
    for pair in pairs:
        k = prompt_length(pair.chosen)
        prompts.append(pair.chosen.input_ids[:k])
        for side in (pair.chosen, pair.rejected):
            completions.append(side.input_ids[k:])
            scored.append([label != IGNORE for label in side.labels[k:]])
    owner = [i for i in range(len(pairs)) for _ in range(2)]
    return scorer.shared_prompt_sums(prompts, completions, owner, scored, pad_id)


def score_pairs(scorer: Scorer, model, pairs: list[Pair], pass_tokens, pad_id: int, device) -> torch.Tensor:
    """[len(pairs), 2] float64 summed log-probs (chosen, rejected), no gradient, dropout off."""
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for chunk in split_pairs(pairs, pass_tokens):
            s = pair_logprobs(scorer, chunk, pad_id, device).double().cpu()
            out.append(s.view(-1, 2))
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.float64)


def _mean(stats: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    return {k: float(torch.cat(v).mean()) for k, v in stats.items()}


class PreferenceTask:
    eval_metric = "preference_loss"

    def __init__(self, s: Run):
        cfg, tr, pc, ev = s.cfg, s.cfg.training, s.cfg.preference, s.cfg.evaluation
        self.s, self.cfg, self.tr, self.pc, self.ev = s, cfg, tr, pc, ev
        renderer = Renderer(s.tokenizer, tr.ctx, True, pc.template_variables)
        self.rows = load_pairs(pc.data, renderer)
        self.eval_rows: list[Pair] = []
        if ev is not None:
            eval_all = load_pairs(ev.data, renderer)
            self.eval_rows = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
        s.log(f"data: {len(self.rows)} training pairs" + (f", {len(self.eval_rows)} evaluation pairs" if ev else ""))
        self.params = PreferenceParams(pc.loss, pc.beta, pc.label_smoothing or 0.0, pc.gamma_beta_ratio or 0.5)
        self.shuffle = pc.shuffle
        self.epochs = tr.epochs
        self.rows_per_step = pc.pairs_per_step or tr.batch_size * tr.gradient_accumulation
        self.step_description = f"{self.rows_per_step} pairs ({pc.loss}, beta {pc.beta})"
        self.fingerprints = {"data": fingerprint_path(resolve_data_path(pc.data))}
        if ev is not None:
            self.fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
        if cfg.reference is not None:
            self.fingerprints["reference_model"] = _reference_fingerprint(cfg.reference.model)
        self.scorer = Scorer(s.model)
        self.pad_id = s.tokenizer.pad_token_id
        # token budget of a no-gradient pass (reference scoring, evaluation); None: unlimited
        self.score_tokens = s.pass_tokens * SCORING_PASS_FACTOR if s.pass_tokens else None
        self.ref_train = self.ref_eval = None
        self.warned_drop = False
        self.loss_scale = 1.0  # the offline loop sets it under FSDP2

    # ---- the reference, scored once ------------------------------------------------------------
    def _reference_key(self) -> dict:
        cfg = self.cfg
        source = (f"model:{self.fingerprints['reference_model']}" if cfg.reference is not None
                  else self.pc.reference or "initial")
        init = cfg.lora.init_adapter if cfg.lora is not None else None
        return {"reference": source, "model": self.s.loaded.fingerprint, "dtype": cfg.model.dtype,
                "init_adapter": fingerprint_path(Path(init)) if init and source == "initial" else None,
                "data": self.fingerprints["data"], "eval_data": self.fingerprints.get("eval_data"),
                "ctx": self.tr.ctx, "template_variables": self.pc.template_variables,
                "eval_pairs": [p.index for p in self.eval_rows]}

    def prepare(self, resume_path) -> None:
        if self.pc.loss not in NEEDS_REFERENCE:
            return
        ck = self.cfg.checkpoint
        key = self._reference_key()
        cached = reference_cache.load_reference(Path(ck.directory), key, required=bool(resume_path)) if ck else None
        if cached is not None:
            self.ref_train, self.ref_eval = cached
            self.s.log(f"reference scores read from {Path(ck.directory) / reference_cache.BIN}")
            return
        self.s.log(f"scoring the reference ({key['reference']}) on {len(self.rows) + len(self.eval_rows)} pairs, once")
        self.ref_train, self.ref_eval = self._score_reference()
        if ck is not None and self.s.world.main:
            reference_cache.save_reference(Path(ck.directory), key, self.ref_train, self.ref_eval)

    def _score_reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        if self.cfg.reference is not None:
            from retrograd.models.load import load_model
            ref = load_model(self.cfg.reference.model, self.cfg.model.dtype, log=s.log)
            if ref.tokenizer.get_vocab() != s.tokenizer.get_vocab():
                raise ConfigError(f"reference.model {self.cfg.reference.model}: its tokenizer differs from the trained "
                                  "model's; the reference must score the very same token ids")
            ref.model.to(s.device)
            scorer = Scorer(ref.model)
            out = (score_pairs(scorer, ref.model, self.rows, self.score_tokens, self.pad_id, s.device),
                   score_pairs(scorer, ref.model, self.eval_rows, self.score_tokens, self.pad_id, s.device))
            del ref, scorer
            return out
        # a fresh adapter (B = 0) adds exact zeros, so "initial" is scored with it disabled too (~5 % faster)
        fresh = self.cfg.lora is not None and not self.cfg.lora.init_adapter
        use_base = (self.pc.reference == "base" or fresh) and hasattr(s.model, "disable_adapter")
        # the same passes as evaluation: a float result depends on the batch it was computed in, and
        # scoring exactly like evaluate() makes the step-0 evaluation exactly ln 2 / accuracy 0.5

        def score(pairs):
            if use_base:
                with s.model.disable_adapter():
                    return score_pairs(self.scorer, s.model, pairs, self.score_tokens, self.pad_id, s.device)
            return score_pairs(self.scorer, s.model, pairs, self.score_tokens, self.pad_id, s.device)
        return score(self.rows), score(self.eval_rows)

    # ---- one step, evaluation ------------------------------------------------------------------
    def _loss(self, pairs: list[Pair], logps: torch.Tensor, r: torch.Tensor | None):
        """r: the pairs' reference scores [P, 2] (None for SimPO/ORPO)."""
        s = logps.view(-1, 2)  # [P, 2]
        n_c, n_r = response_lengths(pairs)
        return preference_loss(self.params, s[:, 0], s[:, 1], n_c, n_r,
                               r[:, 0] if r is not None else None, r[:, 1] if r is not None else None)

    def _pass_backward(self, chunk: list[Pair], n_pairs: int) -> tuple[torch.Tensor, dict]:
        """One pass's forward and backward: (its pairs' detached losses, its stats). Its own function so
        that the pass's graph dies before the next pass allocates (why: train/sft.py SftTask._pass_backward)."""
        logps = pair_logprobs(self.scorer, chunk, self.pad_id, self.s.device).cpu()
        ref = self.ref_train[[p.index for p in chunk]] if self.ref_train is not None else None
        loss, st = self._loss(chunk, logps, ref)
        (loss.sum() / n_pairs * self.loss_scale).backward()
        return loss.detach(), st

    def step(self, pairs: list[Pair]) -> dict:
        stats: dict[str, list[torch.Tensor]] = {}
        losses, n_tokens = [], 0
        for chunk in split_pairs(pairs, self.s.pass_tokens):
            loss, st = self._pass_backward(chunk, len(pairs))
            losses.append(loss)
            for k, v in st.items():
                stats.setdefault(k, []).append(v)
            n_tokens += sum(p.tokens for p in chunk)
        m = _mean(stats)
        if self.ref_train is not None and not self.warned_drop:
            idx = [p.index for p in pairs]
            drop = float((torch.cat(stats["chosen_logps"]) - self.ref_train[idx, 0]).mean())
            if drop < -self.pc.logps_drop_warn:
                self.warned_drop = True
                self.s.log(f"warning: the chosen responses' log-probability fell {-drop:.2f} nats below the "
                           f"reference (preference.logps_drop_warn = {self.pc.logps_drop_warn}): the policy is "
                           "pushing both sides down; consider a lower lr or a larger beta")
        loss = float(torch.cat(losses).mean())
        out = {"train/loss": loss, "train/tokens": n_tokens, "preference/loss": loss,
               "preference/pairs_per_step": len(pairs)}
        out.update({f"preference/{k}": v for k, v in m.items()})
        return out

    def loss_weight(self, pairs: list[Pair]) -> float:
        return float(len(pairs))  # step's loss is a mean over pairs

    def evaluate(self) -> dict:
        model = self.s.model
        was_training = model.training
        model.eval()
        stats: dict[str, list[torch.Tensor]] = {}
        losses, done = [], 0
        with torch.no_grad():
            for chunk in split_pairs(self.eval_rows, self.score_tokens):
                logps = pair_logprobs(self.scorer, chunk, self.pad_id, self.s.device).cpu()
                # ref_eval rows follow eval_rows (the evaluated subset), in order
                ref = self.ref_eval[done:done + len(chunk)] if self.ref_eval is not None else None
                done += len(chunk)
                loss, st = self._loss(chunk, logps, ref)
                losses.append(loss)
                for k, v in st.items():
                    stats.setdefault(k, []).append(v)
        model.train(was_training)
        m = _mean(stats)
        out = {"eval/preference_loss": float(torch.cat(losses).mean())}
        out.update({f"eval/{k}": m[k] for k in ("accuracy", "margin", "chosen_reward", "rejected_reward",
                                                 "chosen_logps", "rejected_logps")})
        return out


def _reference_fingerprint(path: str) -> str:
    from retrograd.models.load import model_fingerprint
    return model_fingerprint(path)


def train_preference(cfg, resume: str | None = None, log=print) -> TrainResult:
    return train_offline(cfg, PreferenceTask, resume, log)
