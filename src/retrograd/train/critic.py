"""PPO's critic: a value head on the policy's final hidden states (a linear probe, as retrograd-rs's),
trained on the TD(lambda) returns of each update.

The features are the detached final hidden states that predicted each completion token (the state
before it), read from the same no-grad pass that records the old policy's log-probabilities, so the
critic costs no forward of its own and never changes the policy's representations. The head is
V(s) = w . h + b in float32 (features stored in `feature_dtype`), fitted with `value_epochs` full-batch
AdamW steps at `value_lr`. Its weights and optimizer state are part of every checkpoint
(critic.safetensors, critic-optimizer.pt), so a resume continues it bit for bit.
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
