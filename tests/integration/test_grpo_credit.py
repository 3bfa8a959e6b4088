"""Credit assignment and policy losses chosen by name in run.toml, as a user runs them: a retrain
recipe with SEPA resumes bit for bit (its λ schedule and gate are in the checkpoint); plugins named
by dotted path train and are listed by `retrograd plugins`; the sampler's entropies and the
off-policy correction reach the loss; `retrograd trace` shows what a transform does; keys the
chosen modes do not read are refused by name."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tiny import write_grpo_run


def rows(folder, name="grpo"):
    return [json.loads(x) for x in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]


SEPA = """
[grpo]
algorithm_mode = "maxrl_gtpo_sepa"
uncertainty_kind = "predictive_variance"
batch_advantage_norm = true
adv_clip_max = 2.0
grpo_epochs = 2
[grpo.sepa]
delay_steps = 0
steps = 4
correct_rate_gate = 0.0
[grpo.planning]
strategic_grams = ["e", "a"]
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 2
"""


def test_sepa_recipe_trains_and_resumes_bit_exact(tmp_path, tiny_model, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, SEPA, updates=4)
    cli("train", cfg, check=0)
    straight = rows(tmp_path)
    final = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    train = [r for r in straight if "advantage/sepa_lambda" in r]
    # the gate opens at the first update (gate 0): lambda follows the linear ramp 0, 1/4, 2/4, 3/4
    assert [r["advantage/sepa_lambda"] for r in train] == [0.0, 0.25, 0.5, 0.75]
    assert all("advantage/batch_adv_std" in r and "advantage/adv_cap_fraction" in r for r in train)
    assert any(r["advantage/plan_surprisal_mean"] > 0 for r in train)  # "e" / "a" tokens are planning here
    assert all("optimizer/grad_norm/epoch_2" in r for r in train if r["train/tokens"])
    state = json.loads((tmp_path / "ckpt" / "step-000000000002.state" / "progress.json").read_text())
    assert state["task"]["credit"]["sepa"]["gate_open"] is True
    config = (tmp_path / "runs" / "grpo" / "config.toml").read_text()
    assert 'advantage_mode = "maxrl"' in config and 'transform_mode = "gtpo_sepa"' in config

    shutil.rmtree(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "out")
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000004.state"})
    assert killed.returncode != 0
    cli("train", cfg, "--resume", check=0)
    resumed = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time", "system"))} for r in rs]  # noqa: E731
    assert strip(rows(tmp_path)) == strip(straight)


PLUGINS = '''
def centred_rank(rewards, params):
    """rank-based advantages (a plugin)"""
    ranks = rewards.argsort(dim=1).argsort(dim=1).double()
    return params["scale"] * (ranks - ranks.mean(dim=1, keepdim=True))


def reinforce(logp, old_logp, advantages, mask, params):
    """plain REINFORCE: -A logp"""
    return -advantages * logp, {"my_stat": (advantages * mask).abs().sum()}
'''


def test_plugins_by_dotted_path_train_and_are_listed(tmp_path, tiny_model, cli):
    (tmp_path / "my_algos.py").write_text(PLUGINS)
    extra = ('[grpo]\nadvantage_mode = "my_algos:centred_rank"\npolicy_loss = "my_algos:reinforce"\n'
             "[grpo.advantage_params]\nscale = 0.5\n")
    cfg = write_grpo_run(tmp_path, tiny_model, extra, updates=2)
    cli("train", cfg, check=0)
    train = [r for r in rows(tmp_path) if r.get("train/tokens")]
    assert train and all(r["policy/my_stat"] > 0 for r in train)
    logged = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "completions.jsonl").read_text().splitlines()]
    # ranks of 4 completions centred and halved: advantages in {-0.75, -0.25, 0.25, 0.75}
    assert {abs(r["advantage"]) for r in logged} <= {0.25, 0.75}
    listing = cli("plugins", cfg, check=0).stdout
    assert "my_algos:centred_rank" in listing and "rank-based advantages" in listing
    assert "plain REINFORCE" in listing and "maxrl_gtpo_sepa" in listing and "cispo" in listing
    catalog = json.loads(cli("plugins", "--json", check=0).stdout)
    assert {"clip", "gspo", "cispo", "sapo", "gmpo", "kl_cov", "clip_cov"} <= {
        e["name"] for e in catalog["policy losses"]["entries"]}


def test_entropy_uncertainty_and_off_policy_correction(tmp_path, tiny_model, cli):
    extra = ('[grpo]\ntransform_mode = "entropy_mask"\nuncertainty_kind = "shannon_entropy"\npolicy_loss = "cispo"\n'
             'importance_correction = "token_truncate"\nimportance_correction_max = 2.0\n'
             '[grpo.entropy_mask]\nrho = 0.5\n[grpo.sampling]\ndtype = "bfloat16"\n')
    cfg = write_grpo_run(tmp_path, tiny_model, extra, updates=2)
    cli("train", cfg, check=0)
    train = [r for r in rows(tmp_path) if r.get("train/tokens")]
    assert train
    for r in train:
        # bf16 rollouts, fp32 training: the sampler's distribution differs a little from the policy's
        assert r["off_policy/is_ratio_mean"] != 1.0 and r["off_policy/is_ratio_max"] < 1.5
        assert 0.4 <= r["advantage/entropy_mask_fraction"] <= 0.6


def test_trace_shows_what_a_transform_does(tmp_path, tiny_model, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, updates=1)
    plain = json.loads(cli("trace", cfg, "--json", check=0).stdout)
    for c in plain["completions"]:  # transform none: every token carries the episode advantage
        assert all(t["advantage"] == pytest.approx(c["episode_advantage"]) for t in c["tokens"])
    hicra = json.loads(cli("trace", cfg, "--json", "--set", "grpo.transform_mode=gtpo_hicra", check=0).stdout)
    planning = [t for c in hicra["completions"] for t in c["tokens"] if t["planning"]]
    assert [t["token"] for t in planning][:3] == ["Let", "me", "think"]
    positive = [c for c in hicra["completions"] if c["episode_advantage"] > 0]
    assert any(t["advantage"] > c["episode_advantage"] for c in positive for t in c["tokens"] if t["planning"])
    text = cli("trace", cfg, "--set", "grpo.algorithm_mode=maxrl_gtpo_sepa", check=0).stdout
    assert "SEPA lambda 0.500" in text and "uncertainty" in text and "step 300" in text
    sft = tmp_path / "sft.toml"
    sft.write_text('[run]\nalgorithm = "sft"\n[model]\npath = "x"\n[output]\npath = "o"\n[sft]\ndata = "d.jsonl"\n')
    assert "runs an RL run's advantage pipeline" in cli("trace", sft, check=2).stderr


@pytest.mark.parametrize("extra,message", [
    ('[grpo]\ntransform_mode = "gtpo"\n[grpo.sepa]\nsteps = 10', "[grpo.sepa] is not read by transform_mode = 'gtpo'"),
    ('[grpo]\nuncertainty_kind = "surprisal"', "uncertainty_kind is not read by transform_mode = 'none'"),
    ('[grpo]\nadvantage_mode = "maxrll"', "unknown advantage_mode 'maxrll'; built in: grpo, rloo"),
    ('[grpo]\nalgorithm_mode = "maxrl_none"\nadvantage_mode = "grpo"', "give either the recipe or the two modes"),
    ('[grpo]\nalgorithm_mode = "maxrl_best"', "grpo.algorithm_mode 'maxrl_best' is not a recipe"),
    ('[grpo]\ntransform_mode = "gtpo"\n[grpo.transform_params]\nx = 1', "read by plugin transforms only"),
    ('[grpo]\npolicy_loss = "sapo"\n[grpo.policy_loss_params]\ntau = 1.0', "['tau'] not read by 'sapo'"),
    ("[grpo]\nclip_ratio_c = 0.5", "clip_ratio_c = 0.5 must be > 1"),
    ('[grpo]\npolicy_loss = "cispo"\nimportance_sampling_level = "sequence"', "does not apply to policy_loss = 'cispo'"),
    ('[grpo]\nbaseline = "rloo"\nadvantage_mode = "maxrl"', "applies to advantage_mode = 'grpo' only"),
    ('[grpo]\ntransform_mode = "gtpo"\n[grpo.gtpo]\nbeta = "high"', "grpo.gtpo.beta: expected float"),
    ('[grpo]\ntransform_mode = "gtpo"\n[grpo.gtpo]\nbeat = 0.2', "unknown key 'beat' in [grpo.gtpo]"),
    ('[grpo]\npolicy_loss = "nowhere:fn"', "grpo.policy_loss: cannot import 'nowhere:fn'"),
])
def test_config_errors_name_the_key(tmp_path, tiny_model, cli, extra, message):
    cfg = write_grpo_run(tmp_path, tiny_model, extra, updates=1)
    proc = cli("train", cfg, check=2)
    assert message in proc.stderr
