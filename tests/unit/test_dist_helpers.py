"""The pure parts of retrograd/dist.py: how a step's rows are shared out and how the ranks' metrics
combine into the one-process numbers."""
from __future__ import annotations

import pytest

from retrograd import dist


def test_shards_cover_the_step_once_in_order():
    rows = list(range(11))
    shares = [dist.shard(rows, dist.World(rank=r, size=3)) for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert sorted(sum(shares, [])) == rows
    assert dist.shard(rows, dist.World()) == rows


def test_metrics_combine_as_one_process_would():
    # rank 0: 3 target tokens with losses (1, 2, 3); rank 1: 1 token with loss 6; one process: 12 / 4 = 3
    parts = [({"train/loss": 2.0, "train/tokens": 10, "only/rank0": 5.0}, 3.0),
             ({"train/loss": 6.0, "train/tokens": 4}, 1.0)]
    out = dist.combine_metrics(parts, {"train/tokens"})
    assert out["train/loss"] == pytest.approx(3.0)
    assert out["train/tokens"] == 14
    assert out["only/rank0"] == 5.0  # reported by one rank: its value
    # a rank without rows (weight 0, no metrics) changes nothing
    assert dist.combine_metrics(parts + [({}, 0.0)], {"train/tokens"}) == out


def test_one_process_needs_no_group_and_refusals_name_the_fix():
    assert dist.resolve_strategy("auto", "lora", 1, "grpo", "run.toml") == "none"
    assert dist.resolve_strategy("auto", "full", 2, "sft", "run.toml") == "fsdp2"
    assert dist.resolve_strategy("auto", "lora", 2, "sft", "run.toml") == "ddp"
    # a full fine-tune of an RL loop is sharded too (it samples from the weights gathered whole) ...
    assert dist.resolve_strategy("auto", "full", 2, "grpo", "run.toml") == "fsdp2"
    assert dist.resolve_strategy("auto", "full", 2, "distill", "run.toml") == "fsdp2"
    # ... and so are PPO's and offline top-k distillation's; a LoRA keeps DDP
    assert dist.resolve_strategy("auto", "full", 2, "ppo", "run.toml") == "fsdp2"
    assert dist.resolve_strategy("auto", "full", 2, "distill-offline", "run.toml") == "fsdp2"
    assert dist.resolve_strategy("auto", "lora", 2, "grpo", "run.toml") == "ddp"
    assert dist.resolve_strategy("auto", "lora", 2, "ppo", "run.toml") == "ddp"
    assert dist.resolve_strategy("fsdp2", "lora", 2, "grpo", "run.toml") == "fsdp2"
    assert dist.resolve_strategy("ddp", "full", 2, "grpo", "run.toml") == "ddp"
    assert dist.resolve_strategy("ddp", "full", 2, "preference", "run.toml") == "ddp"
    with pytest.raises(dist.ConfigError, match="runs in one process in this version"):
        dist.resolve_strategy("auto", "lora", 2, "agent_grpo", "run.toml")
    assert dist.resolve_strategy("fsdp2", "lora", 2, "sft", "run.toml") == "fsdp2"  # a base too big for one device
    assert dist.resolve_strategy("fsdp2", "lora", 2, "ppo", "run.toml") == "fsdp2"
    with pytest.raises(dist.ConfigError, match="mixed_precision = 'bf16' applies to fsdp2"):
        dist.resolve_strategy("auto", "lora", 2, "sft", "run.toml", None, "bf16")
    with pytest.raises(dist.ConfigError, match=r"\[grpo.judge\] runs on one process"):
        dist.resolve_strategy("auto", "lora", 2, "grpo", "run.toml", ["[grpo.judge]"])
    # without torchrun every collective is the identity
    assert dist.reduce_metrics({"a": 1.0}, 2.0, set()) == {"a": 1.0}
    assert dist.any_rank(True) and not dist.any_rank(False)
    assert dist.gather_objects("x") == ["x"]
