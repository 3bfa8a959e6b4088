"""GRPO on a tiny model, as a user runs it: the reward rises; metrics, completions.jsonl and the
evaluation's mean reward (best.state = highest) are written; a killed run resumes bit for bit
(the sampler is seeded per update); configs and rewards that cannot work are refused clearly."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tiny import write_grpo_run

FULL = """
[training]
trainable = "full"
lr = 0.01
[grpo]
group_size = 8
"""


def rows(folder, name="grpo"):
    return [json.loads(x) for x in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype,model_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("auto", "bfloat16")])
def test_full_fine_tune_learns_the_reward(tmp_path, tiny_model, cli, dtype, model_dtype):
    # sampling bfloat16: rollouts from bf16 copies of the weights (remade after every optimizer
    # step), training stays float32; a bfloat16 model samples and trains in bf16
    cfg = write_grpo_run(tmp_path, tiny_model, FULL + f'[grpo.sampling]\ndtype = "{dtype}"\n', updates=30)
    text = cfg.read_text().replace("[lora]\nrank = 4\nalpha = 8\n", "")
    cfg.write_text(text.replace("[model]\n", f'[model]\ndtype = "{model_dtype}"\n', 1))
    assert f'dtype = "{model_dtype}"' in cfg.read_text()
    cli("train", cfg, check=0)
    r = [x["reward/mean"] for x in rows(tmp_path) if "reward/mean" in x]
    assert len(r) == 30 and sum(r[-5:]) / 5 > sum(r[:5]) / 5 + 0.3
    # the last update that trained (once every completion earns the full reward, groups carry no signal)
    last = [x for x in rows(tmp_path) if "policy/ratio_mean" in x][-1]
    for key in ("policy/clip_fraction", "policy/entropy", "completions/mean_length", "completions/truncation_fraction",
                "batch/zero_std_group_fraction", "time/sampling_s", "time/reward_s", "time/training_s",
                "reward/tiny_rewards:share_of_lowercase/mean", "system/sampling_tokens_per_second"):
        assert key in last, key
    assert last["policy/ratio_mean"] == 1.0  # one epoch: on-policy
    logged = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 30 * 2 * 8 and {"prompt", "completion", "reward", "advantage"} <= set(logged[0])


EXTRA = """
[training]
threads = 2
lr = 0.05
[lora]
dropout = 0.1
[grpo]
grpo_epochs = 2
kl_coefficient = 0.05
importance_sampling_level = "sequence"
clip_range_low = 0.05
clip_range_high = 0.05
[evaluation]
data = "prompts.jsonl"
every_steps = 3
max_examples = 4
[checkpoint]
directory = "ckpt"
mode = "steps_and_best_eval"
every_steps = 3
"""


def test_lora_kl_gspo_run_resumes_bit_exact(tmp_path, tiny_model, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, EXTRA, updates=6)
    cli("train", cfg, check=0)
    straight = rows(tmp_path)
    final = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    completions = (tmp_path / "runs" / "grpo" / "completions.jsonl").read_text()
    train = [r for r in straight if "policy/loss" in r]
    assert train[-1]["policy/kl"] > 0 and train[-1]["policy/beta"] == 0.05
    assert any(r["policy/ratio_mean"] != 1.0 for r in train)  # the second epoch moved off-policy
    evals = [r for r in straight if "eval/mean_reward" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    best = json.loads((tmp_path / "ckpt" / "best.state" / "progress.json").read_text())["best_eval"]
    assert best == max(r["eval/mean_reward"] for r in evals)

    shutil.rmtree(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "out")
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000006.state"})
    assert killed.returncode != 0
    cli("train", cfg, "--resume", check=0)
    resumed = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time", "system"))} for r in rs]  # noqa: E731
    assert strip(rows(tmp_path)) == strip(straight)
    assert (tmp_path / "runs" / "grpo" / "completions.jsonl").read_text() == completions


@pytest.mark.parametrize("extra,message", [
    ("[grpo]\nrewards = []", "[grpo] needs at least one reward"),
    ('[reference]\nmodel = "x"', "[reference] is only used by the KL term"),
    ("[grpo.sampling]\nmax_new_tokns = 4", "unknown key 'max_new_tokns' in [grpo.sampling]"),
    ("[grpo.sampling]\nmax_new_tokens = 64", "leaves no room for the prompt"),
    ('[grpo]\nrewards = [{ type = "python", function = "nowhere:fn" }]', "cannot import 'nowhere:fn'"),
    ("[grpo]\ngroup_size = 1", "grpo.group_size"),
])
def test_config_errors(tmp_path, tiny_model, cli, extra, message):
    cfg = write_grpo_run(tmp_path, tiny_model, extra, updates=1)
    proc = cli("train", cfg, check=2)
    assert message in proc.stderr


def test_a_failing_reward_stops_the_run_naming_it(tmp_path, tiny_model, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, updates=2)
    (tmp_path / "tiny_rewards.py").write_text("def share_of_lowercase(prompts, completions, **kw):\n"
                                              "    return [float('nan')] * len(completions)\n")
    proc = cli("train", cfg, check=2)
    assert "reward 'tiny_rewards:share_of_lowercase' returned nan for the completion of prompt" in proc.stderr


def test_eval_reports_mean_reward_base_and_trained(tmp_path, tiny_model, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, '[evaluation]\ndata = "prompts.jsonl"', updates=2)
    cli("train", cfg, check=0)
    out = json.loads(cli("eval", cfg, "--json", check=0).stdout)
    assert out["prompts"] == 12 and out["trained_from"].endswith("adapter")
    assert 0 <= out["base/mean_reward"] <= 1 and "trained/tiny_rewards:share_of_lowercase/mean" in out
    evals = [r for r in rows(tmp_path) if "eval/mean_reward" in r]
    assert out["trained/mean_reward"] == pytest.approx(evals[-1]["eval/mean_reward"], abs=1e-9)


def test_dynamic_sampling_replaces_groups_without_signal_with_new_prompts(tmp_path, tiny_model, cli):
    extra = '[grpo]\nprompt_order = "sequential"\n[grpo.dynamic_sampling]\nmax_resample_factor = 3\n'
    cfg = write_grpo_run(tmp_path, tiny_model, extra, updates=2)
    # the first update's prompts ("red", "green") give every completion the same reward: no signal
    (tmp_path / "tiny_rewards.py").write_text(
        "def share_of_lowercase(prompts, completions, **columns):\n"
        "    return [0.0 if p in ('red', 'green') else sum('a' <= ch <= 'z' for ch in c) / max(1, len(c))\n"
        "            for p, c in zip(prompts, completions)]\n")
    cli("train", cfg, check=0)
    log = tmp_path / "runs" / "grpo" / "completions.jsonl"
    logged = [json.loads(x) for x in log.read_text().splitlines()]
    first = [r["prompt"] for r in logged if r["step"] == 1]
    assert len(first) == 8 and len(set(first)) == 2 and not {"red", "green"} & set(first)
    step1 = [r for r in rows(tmp_path) if "batch/groups_sampled" in r][0]
    # 2 groups drawn, then replacements until 2 have signal (a replacement can itself come out flat)
    assert step1["batch/groups_sampled"] >= 4 and step1["batch/zero_std_group_fraction"] == 0
    assert step1["train/tokens"] > 0  # the update trained on the replacements
    before = log.read_text()
    shutil.rmtree(tmp_path / "runs")
    cli("train", cfg, check=0)  # the same seed draws the same replacements
    assert log.read_text() == before
