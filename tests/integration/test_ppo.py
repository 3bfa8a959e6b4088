"""PPO on a tiny model, as a user runs it: it learns the reward with the value head and GAE, and
without a critic; the critic is in every checkpoint and a killed run resumes bit for bit (policy and
critic); `retrograd eval` reads a PPO run; configs that cannot work are refused by name."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tiny import write_ppo_run


def rows(folder, name="ppo"):
    return [json.loads(x) for x in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _full(cfg):
    cfg.write_text(cfg.read_text().replace("[lora]\nrank = 4\nalpha = 8\n", ""))
    return cfg


@pytest.mark.parametrize("critic", [True, False], ids=["value_head", "no_critic"])
def test_full_fine_tune_learns_the_reward(tmp_path, tiny_model, cli, critic):
    extra = '[training]\ntrainable = "full"\nlr = 0.01\n[ppo]\nrollout_batch_size = 16\n'
    cfg = _full(write_ppo_run(tmp_path, tiny_model, extra, updates=30))
    if not critic:
        cfg.write_text(cfg.read_text().replace("value_lr = 0.05", "enabled = false"))
    cli("train", cfg, check=0)
    r = [x for x in rows(tmp_path) if "reward/mean" in x]
    assert len(r) == 30
    first, last = sum(x["reward/mean"] for x in r[:5]) / 5, sum(x["reward/mean"] for x in r[-5:]) / 5
    assert last > first + 0.3, (first, last)
    for key in ("policy/clip_fraction", "policy/loss", "optimizer/grad_norm/epoch_2", "reward/correct_rate"):
        assert key in r[-1], key
    critic_keys = {"policy/value_loss", "critic/explained_variance", "critic/returns_mean", "critic/value_mean"}
    assert critic_keys <= set(r[-1]) if critic else not critic_keys & set(r[-1])


EXTRA = """
[training]
threads = 2
lr = 0.05
[lora]
dropout = 0.1
[ppo]
kl_coefficient = 0.05
clip_range_high = 0.28
[evaluation]
data = "prompts.jsonl"
every_steps = 3
max_examples = 4
[checkpoint]
directory = "ckpt"
mode = "steps_and_best_eval"
every_steps = 3
"""


def test_lora_kl_run_resumes_bit_exact_with_its_critic(tmp_path, tiny_model, cli):
    cfg = write_ppo_run(tmp_path, tiny_model, EXTRA, updates=6)
    cli("train", cfg, check=0)
    straight = rows(tmp_path)
    final = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    critic = load_file(tmp_path / "ckpt" / "step-000000000006.state" / "critic.safetensors")
    train = [r for r in straight if "policy/loss" in r]
    assert train[-1]["policy/beta"] == 0.05 and any(r["policy/kl"] > 0 for r in train)  # the 2nd epoch moved
    assert [r["step"] for r in straight if "eval/mean_reward" in r] == [0, 3, 6]
    manifest = json.loads((tmp_path / "ckpt" / "step-000000000003.state" / "manifest.json").read_text())
    assert "critic.safetensors" in manifest["files"] and "critic-optimizer.pt" in manifest["files"]

    shutil.rmtree(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "out")
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000006.state"})
    assert killed.returncode != 0
    cli("train", cfg, "--resume", check=0)
    resumed = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    again = load_file(tmp_path / "ckpt" / "step-000000000006.state" / "critic.safetensors")
    assert all(torch.equal(again[k], critic[k]) for k in critic)  # the critic resumed too
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time", "system"))} for r in rs]  # noqa: E731
    assert strip(rows(tmp_path)) == strip(straight)

    out = json.loads(cli("eval", cfg, "--json", check=0).stdout)
    assert out["prompts"] == 12 and "trained/mean_reward" in out and "base/mean_reward" in out


@pytest.mark.parametrize("extra,message", [
    ("[ppo]\nrewards = []", "[ppo] needs at least one reward"),
    ("[ppo.critic]\nenabled = false", "its other keys are not read"),
    ("[ppo]\nclip_ratio_c = 0.5", "clip_ratio_c = 0.5 must be > 1"),
    ("[ppo]\nclip_range = 1.5", "ppo.clip_range"),
    ("[ppo.critic]\nfeature_dtype = \"f8\"", "ppo.critic.feature_dtype"),
    ('[reference]\nmodel = "x"', "[reference] does not apply"),
    ("[grpo]\ngroup_size = 4", "table [grpo] does not apply to run.algorithm = 'ppo'"),
])
def test_config_errors(tmp_path, tiny_model, cli, extra, message):
    cfg = write_ppo_run(tmp_path, tiny_model, extra, updates=1)
    assert message in cli("train", cfg, check=2).stderr


def test_a_separate_value_model_critic(tmp_path, tiny_model, cli):
    extra = f'[ppo.critic]\ncritic = "model"\nmodel = "{tiny_model}"\nrank = 2\nvalue_epochs = 4\nvalue_lr = 0.002\n[checkpoint]\n' \
            'directory = "ckpt"\nmode = "steps"\nevery_steps = 2\n'
    cfg = write_ppo_run(tmp_path, tiny_model, extra, updates=2)
    cli("train", cfg, check=0)
    r = [x for x in rows(tmp_path) if "reward/mean" in x]
    assert all("critic/explained_variance" in x and "critic/value_loss_after_fit" in x for x in r)
    assert r[-1]["critic/value_loss_after_fit"] < r[-1]["policy/value_loss"]  # the value model fitted the returns
    saved = load_file(tmp_path / "ckpt" / "step-000000000002.state" / "critic.safetensors")
    assert any(k.startswith("lora.") and "lora_A" in k for k in saved) and "weight" in saved
    cli("train", cfg, "--resume", check=0)  # the critic model's checkpoint loads back
    bad = write_ppo_run(tmp_path, tiny_model, '[ppo.critic]\ncritic = "model"', updates=1, name="bad.toml")
    assert "ppo.critic.model names the value model" in cli("train", bad, check=2).stderr
