"""Credit assignment for the RL loops: one update's rollouts -> per-token advantages, through the
configured pipeline (algorithms/pipeline.py: episode advantage x token transform, batch norm, clip),
and the state that pipeline carries from update to update (SEPA's λ schedule and correctness gate,
delight's adaptive η), saved in checkpoints.

What the transforms read besides rewards comes from the rollouts: the sampler's log-probabilities
of the sampled tokens (surprisal), the entropy of each sampled distribution (uncertainty_kind =
"shannon_entropy", computed by the sampler), and a planning-token mask from the completion's token
strings (HICRA and SEPA's planning / execution split).
"""
from __future__ import annotations

from pathlib import Path

import torch

from retrograd.algorithms.pipeline import token_advantages
from retrograd.algorithms.planning import regex_planning_mask, semantic_planning_mask, sentence_transformer_embedder
from retrograd.algorithms.sepa import SepaController, execution_surprisals
from retrograd.algorithms.transforms import TOKEN_TRANSFORMS, TokenContext
from retrograd.errors import ConfigError


def padded(rows: list[list[float]], width: int, dtype=torch.float32) -> torch.Tensor:
    """Ragged rows -> [N, width], 0 beyond each row."""
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


class Credit:
    def __init__(self, g, tokenizer, search_path: Path | None = None):
        self.g, self.tokenizer, self.search_path = g, tokenizer, search_path
        entry = TOKEN_TRANSFORMS.entry(g.transform_mode, search_path)
        self.tables = {t: getattr(g, t) for t in entry.tables}
        self.sepa = SepaController(**g.sepa) if g.sepa is not None else None
        self.needs_planning = "planning" in entry.tables
        self.needs_entropy = g.uncertainty_kind == "shannon_entropy"
        self.state: dict = {}  # a transform's own carry-over (delight's η EMA), saved in checkpoints
        self._embed = None
        if self.needs_planning and g.planning["detector"] == "semantic":
            try:
                self._embed = sentence_transformer_embedder(g.planning["model"])
            except ImportError as e:
                raise ConfigError(f"[grpo.planning] detector = 'semantic': {e}") from None

    # ---- checkpointed state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"sepa": self.sepa.state_dict() if self.sepa else None, "transform": self.state}

    def load_state_dict(self, d: dict) -> None:
        if self.sepa is not None and d.get("sepa") is not None:
            self.sepa.load_state_dict(d["sepa"])
        self.state = dict(d.get("transform") or {})

    # ---- one update --------------------------------------------------------------------------------
    def planning_mask(self, completions: list[list[int]], width: int) -> torch.Tensor:
        """[N, width] bool: tokens inside a planning phrase ("wait let me check", ...)."""
        mask = torch.zeros(len(completions), width, dtype=torch.bool)
        grams = self.g.planning["strategic_grams"] or None
        for i, ids in enumerate(completions):
            tokens = self.tokenizer.convert_ids_to_tokens(ids)
            if self._embed is not None:
                row = semantic_planning_mask(tokens, self._embed, self.g.planning["threshold"])
            else:
                row = regex_planning_mask(tokens, grams)
            mask[i, :len(row)] = torch.tensor(row, dtype=torch.bool)
        return mask

    def assign(self, rollouts, step: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(token advantages [N, T] float64, episode advantages [N] float64, metrics) for an update's
        rollouts (N = groups x group_size completions, T = the longest completion)."""
        g, s = self.g, rollouts.samples
        G = g.group_size
        width = max(len(c) for c in s.completion_ids)
        lengths = torch.tensor([len(c) for c in s.completion_ids])
        mask = lengths[:, None] > torch.arange(width)[None, :]  # [N, T]
        logprobs = padded(s.behaviour_logprobs, width)
        entropy = padded(s.entropies, width) if s.entropies is not None else None
        planning = self.planning_mask(s.completion_ids, width) if self.needs_planning else None
        sepa_lambda = self.sepa.lambda_for(step) if self.sepa else 0.0
        ctx = TokenContext(advantages=torch.zeros(len(lengths), dtype=torch.float64), logprobs=logprobs, mask=mask,
                           group=torch.arange(len(lengths)) // G, planning=planning, entropy=entropy,
                           sepa_lambda=sepa_lambda, step=step)
        token_adv, episode_adv, metrics = token_advantages(
            rollouts.rewards.view(-1, G), ctx, advantage_mode=g.advantage_mode, transform_mode=g.transform_mode,
            uncertainty_kind=g.uncertainty_kind or "surprisal", tables=self.tables, advantage_params=g.advantage_params,
            transform_params=g.transform_params, batch_norm=g.batch_advantage_norm, adv_clip_max=g.adv_clip_max,
            state=self.state, search_path=self.search_path)
        if self.sepa is not None:
            metrics["sepa_lambda"] = sepa_lambda
            # after the step's advantages, as retrain: the execution tokens' surprisal and the correct rate
            self.sepa.observe(execution_surprisals(logprobs, mask, planning),
                              float((rollouts.rewards > 0.5).double().mean()))
            metrics["sepa_gate_open"] = float(self.sepa.gate_open)
        return token_adv, episode_adv, {f"advantage/{k}": v for k, v in metrics.items()}
