"""PPO's critics, trained on the TD(lambda) returns of each update.

`critic = "head"` (Critic): a value head on the policy's final hidden states (a linear probe, as
retrograd-rs's).
The features are the detached final hidden states that predicted each completion token (the state
before it), read from the same no-grad pass that records the old policy's log-probabilities, so the
critic costs no forward of its own and never changes the policy's representations. The head is
V(s) = w . h + b in float32 (features stored in `feature_dtype`), fitted with `value_epochs` full-batch
AdamW steps at `value_lr`. Its weights and optimizer state are part of every checkpoint
(critic.safetensors, critic-optimizer.pt), so a resume continues it bit for bit.

`critic = "model"` (ModelCritic): a separate value model, as verl / OpenRLHF users know it: another
causal LM (same tokenizer; often a smaller one) with a LoRA of rank `rank` and a value head on its own
final hidden states, run over prompt + completion, all trained on the returns.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retrograd.algorithms.gae import explained_variance, value_loss
from retrograd.errors import CheckpointError

FEATURE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
WEIGHTS, OPTIMIZER = "critic.safetensors", "critic-optimizer.pt"


class Critic:
    def __init__(self, hidden_size: int, cfg, seed: int):
        self.cfg = cfg
        self.feature_dtype = FEATURE_DTYPES[cfg.feature_dtype]
        gen = torch.Generator().manual_seed(seed)
        # a small random start, so the first update's features already spread the values apart
        self.weight = torch.nn.Parameter(torch.randn(hidden_size, generator=gen) * 1e-3)
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.optimizer = torch.optim.AdamW([self.weight, self.bias], lr=cfg.value_lr, weight_decay=0.0)

    def features(self, states: torch.Tensor) -> torch.Tensor:
        return states.detach().to(self.feature_dtype)

    def values(self, features: torch.Tensor) -> torch.Tensor:
        """[N, T, H] features -> [N, T] values (float32, no gradient)."""
        with torch.no_grad():
            return features.float() @ self.weight + self.bias

    def fit(self, features: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict:
        """value_epochs full-batch steps on (V - R)^2 / 2 over the mask; the value loss before and after,
        and the explained variance of the values the advantages were computed with."""
        x, r = features.float(), returns.float()
        before = self.values(features)
        metrics = {"critic/explained_variance": explained_variance(before, r, mask),
                   "policy/value_loss": float(value_loss(before, r, mask))}
        for _ in range(self.cfg.value_epochs):
            loss = value_loss(x @ self.weight + self.bias, r, mask)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        metrics["critic/value_loss_after_fit"] = float(value_loss(self.values(features), r, mask))
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        save_file({"weight": self.weight.detach().contiguous(), "bias": self.bias.detach().reshape(1)},
                  str(folder / WEIGHTS))
        torch.save(self.optimizer.state_dict(), folder / OPTIMIZER)

    def load(self, folder: Path) -> None:
        if not (folder / WEIGHTS).is_file():
            raise CheckpointError(f"{folder}: no {WEIGHTS} (the critic of a PPO run is part of its checkpoints)")
        t = load_file(str(folder / WEIGHTS))
        if t["weight"].shape != self.weight.shape:
            raise CheckpointError(f"{folder}: the critic has {t['weight'].shape[0]} features, this model "
                                  f"{self.weight.shape[0]}")
        with torch.no_grad():
            self.weight.copy_(t["weight"])
            self.bias.copy_(t["bias"].reshape(()))
        self.optimizer.load_state_dict(torch.load(folder / OPTIMIZER, weights_only=True))


class ModelCritic(Critic):
    """A value model of its own. `features(states)` ignores the policy's states and returns the
    token sequences; `values` and `fit` run the critic model over them."""

    def __init__(self, cfg, seed: int, tokenizer, device, log):
        from retrograd.models.load import load_model
        from retrograd.models.logprobs import Scorer
        from retrograd.models.lora import attach_lora
        loaded = load_model(cfg.model, "float32", log=log)
        if loaded.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise CheckpointError(f"ppo.critic.model {cfg.model}: its tokenizer differs from the policy's; the critic "
                                  "reads the policy's token ids")
        model, _ = attach_lora(loaded.model, cfg.rank, 2.0 * cfg.rank, ["auto"], 0.0, seed)
        self.model = model.to(device).train()
        self.scorer = Scorer(self.model)
        self.cfg, self.device = cfg, device
        self.feature_dtype = torch.float32
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(model.config.hidden_size, generator=gen) * 1e-3)
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.lora = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW([self.weight, self.bias, *self.lora], lr=cfg.value_lr, weight_decay=0.0)

    def bind(self, batch) -> None:
        """The update's rollouts (policy_update.UpdateBatch): what the critic model reads, in the passes
        planned for all of them (under torchrun the policy's passes are then cut to each rank's share;
        every rank fits the critic on every rollout)."""
        self.batch, self.passes = batch, list(batch.passes)

    def features(self, states: torch.Tensor):
        return self.batch

    def _pass_values(self, batch, idx: list[int]) -> torch.Tensor:
        """[len(idx), W] values of rows idx: the critic model over prompt + completion, its final hidden
        states before each completion token through the value head."""
        from retrograd.train.policy_update import collate
        enc = {k: (v.to(self.device) if v is not None else None)
               for k, v in collate([batch.seqs[j] for j in idx], batch.pad_id).items()}
        _, states = self.scorer.token_logprobs(enc, batch.width, states=True, detach=False)
        return states.float() @ self.weight + self.bias

    def values(self, batch) -> torch.Tensor:
        out = torch.zeros(len(batch.seqs), batch.width)
        with torch.no_grad():
            for idx in self.passes:
                out[torch.tensor(idx)] = self._pass_values(batch, idx).cpu()
        return out

    def fit(self, batch, returns: torch.Tensor, mask: torch.Tensor) -> dict:
        before = self.values(batch)
        metrics = {"critic/explained_variance": explained_variance(before, returns, mask),
                   "policy/value_loss": float(value_loss(before, returns.float(), mask))}
        n = mask.sum().clamp(min=1)
        for _ in range(self.cfg.value_epochs):  # passes accumulate into one full-batch step
            for idx in self.passes:
                rows = torch.tensor(idx)
                v, m = self._pass_values(batch, idx), mask[rows].float()
                (0.5 * (((v - returns[rows].float()) ** 2) * m).sum() / n).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        metrics["critic/value_loss_after_fit"] = float(value_loss(self.values(batch), returns.float(), mask))
        return metrics

    def save(self, folder: Path) -> None:
        tensors = {"weight": self.weight.detach().contiguous(), "bias": self.bias.detach().reshape(1)}
        tensors.update({f"lora.{n}": p.detach().contiguous() for n, p in self.model.named_parameters()
                        if p.requires_grad})
        save_file(tensors, str(folder / WEIGHTS))
        torch.save(self.optimizer.state_dict(), folder / OPTIMIZER)

    def load(self, folder: Path) -> None:
        if not (folder / WEIGHTS).is_file():
            raise CheckpointError(f"{folder}: no {WEIGHTS} (the critic of a PPO run is part of its checkpoints)")
        t = load_file(str(folder / WEIGHTS))
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(t) != {"weight", "bias"} | {f"lora.{n}" for n in params}:
            raise CheckpointError(f"{folder}: its critic does not match ppo.critic (model, rank)")
        with torch.no_grad():
            self.weight.copy_(t["weight"])
            self.bias.copy_(t["bias"].reshape(()))
            for n, p in params.items():
                p.copy_(t[f"lora.{n}"])
        self.optimizer.load_state_dict(torch.load(folder / OPTIMIZER, weights_only=True))

