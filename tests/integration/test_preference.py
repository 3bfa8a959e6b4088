"""Preference runs on a tiny model, the way a user runs them: DPO starts at ln 2 / accuracy 0.5 and
learns; the reference is scored once and cached beside the checkpoints; a killed run resumes bit
for bit from the cache; a missing or stale cache refuses the resume; SimPO/ORPO run without a
reference; bad pairs and keys a loss does not read are refused by file:line / key."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tiny import pref_rows, write_jsonl, write_pref_run

EXTRA = """
[training]
lr = 0.003
threads = 2
[preference]
beta = 1.0
[evaluation]
data = "pairs.jsonl"
every_steps = 4
[checkpoint]
directory = "ckpt"
mode = "steps_and_best_eval"
every_steps = 6
"""


def metrics(folder, name="pref"):
    return [json.loads(x) for x in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_dpo_learns_caches_the_reference_and_resumes_bit_exact(tmp_path, tiny_model, cli):
    cfg = write_pref_run(tmp_path, tiny_model, EXTRA, steps=12)
    cli("train", cfg, check=0)
    rows = metrics(tmp_path)
    evals = [r for r in rows if "eval/preference_loss" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/preference_loss"] == pytest.approx(math.log(2), abs=1e-9)
    assert evals[0]["eval/accuracy"] == 0.5
    assert evals[-1]["eval/preference_loss"] < 0.66 and evals[-1]["eval/accuracy"] > 0.6
    train = [r for r in rows if "preference/loss" in r]
    for key in ("accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_logps", "rejected_logps"):
        assert f"preference/{key}" in train[-1]
    ck = tmp_path / "ckpt"
    assert (ck / "preference-reference.bin").stat().st_size == 8 * 2 * (24 + 24)  # train + eval pairs, float64
    assert json.loads((ck / "best.state" / "progress.json").read_text())["best_eval"] == \
        min(r["eval/preference_loss"] for r in evals)
    final = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")

    # SIGKILL while saving step 12, resume from step 6 with the cached reference: same weights, same metrics
    shutil.rmtree(tmp_path / "out")
    shutil.rmtree(ck)
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000012.state"})
    assert killed.returncode != 0
    proc = cli("train", cfg, "--resume", check=0)
    assert "reference scores read from" in proc.stdout + proc.stderr
    resumed = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert resumed.keys() == final.keys() and all(torch.equal(resumed[k], final[k]) for k in final)
    assert [r.get("preference/loss") for r in metrics(tmp_path)] == [r.get("preference/loss") for r in rows]

    # a stale cache (another run's numbers) and a missing one refuse the resume
    meta = json.loads((ck / "preference-reference.json").read_text())
    meta["key"]["ctx"] = 999
    (ck / "preference-reference.json").write_text(json.dumps(meta))
    proc = cli("train", cfg, "--resume", ck / "step-000000000006.state", check=2)
    assert "scored for a different reference/model/data (differs in: ctx)" in proc.stderr
    (ck / "preference-reference.bin").unlink()
    proc = cli("train", cfg, "--resume", ck / "step-000000000006.state", check=2)
    assert "preference-reference.bin" in proc.stderr and "is missing" in proc.stderr


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_other_losses_train(tmp_path, tiny_model, cli, loss):
    beta = {"ipo": 'beta = 0.5', "simpo": 'beta = 2.0\ngamma_beta_ratio = 0.1', "orpo": "beta = 0.5"}[loss]
    cfg = write_pref_run(tmp_path, tiny_model, EXTRA.replace("beta = 1.0", f'loss = "{loss}"\n{beta}'), steps=8)
    proc = cli("train", cfg, check=0)
    rows = metrics(tmp_path)
    evals = [r["eval/preference_loss"] for r in rows if "eval/preference_loss" in r]
    assert evals[-1] < evals[0]
    scored = (tmp_path / "ckpt" / "preference-reference.bin").exists()
    assert scored == (loss == "ipo") and ("scoring the reference" in proc.stdout + proc.stderr) == scored
    if loss == "orpo":
        train = [r for r in rows if "preference/loss" in r][-1]
        assert {"preference/nll", "preference/log_odds", "preference/orpo_clamped"} <= set(train)


def test_reference_base_and_reference_model(tmp_path, tiny_model, cli):
    cfg = write_pref_run(tmp_path, tiny_model, '[preference]\nreference = "base"', steps=2)
    cli("train", cfg, check=0)
    cfg = write_pref_run(tmp_path, tiny_model, f'[reference]\nmodel = "{tiny_model}"', steps=2, name="refm.toml")
    proc = cli("train", cfg, check=0)
    assert "scoring the reference (model:" in proc.stdout + proc.stderr


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a", "chosen": " b"}, "missing 'rejected'"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": "same", "rejected": "same"}, "identical"),
    ({"prompt": "ab", "chosen": "c", "rejected": "x" * 100}, "longer than training.ctx = 64"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": 3, "rejected": "b"}, "'chosen' must be"),
])
def test_bad_pairs_are_refused_with_file_and_line(tmp_path, tiny_model, cli, row, message):
    cfg = write_pref_run(tmp_path, tiny_model, steps=1)
    write_jsonl(tmp_path / "pairs.jsonl", pref_rows(3) + [row])
    proc = cli("train", cfg, check=2)
    assert "pairs.jsonl:4: " in proc.stderr and message in proc.stderr


def test_prompt_merged_into_the_response_is_refused(tmp_path, cli):
    from tiny import make_model_dir, make_tokenizer
    model = make_model_dir(tmp_path / "m", tokenizer=make_tokenizer(("a b",)))
    cfg = write_pref_run(tmp_path, model, steps=1)
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "xa", "chosen": "b", "rejected": "c"}])
    proc = cli("train", cfg, check=2)
    assert "pairs.jsonl:1: " in proc.stderr and "do not share the prompt token for token" in proc.stderr


@pytest.mark.parametrize("extra,message", [
    ('[preference]\nloss = "simpo"\nlabel_smoothing = 0.1', "preference.label_smoothing is not read by loss = 'simpo'"),
    ('[preference]\ngamma_beta_ratio = 0.3', "preference.gamma_beta_ratio is not read by loss = 'dpo'"),
    ('[preference]\nloss = "orpo"\nreference = "base"', "preference.reference is not read by loss = 'orpo'"),
    ('[preference]\nloss = "simpo"\n[reference]\nmodel = "x"', "[reference] is not read by preference.loss = 'simpo'"),
    ('[preference]\nlabel_smoothing = 0.5', "label_smoothing"),
    ('[sft]\ndata = "x.jsonl"', "table [sft] does not apply to run.algorithm = 'preference'"),
])
def test_config_errors(tmp_path, tiny_model, cli, extra, message):
    cfg = write_pref_run(tmp_path, tiny_model, extra, steps=1)
    proc = cli("train", cfg, check=2)
    assert message in proc.stderr


def test_eval_compares_base_and_trained_pairs(tmp_path, tiny_model, cli):
    cfg = write_pref_run(tmp_path, tiny_model, EXTRA, steps=8)
    cli("train", cfg, check=0)
    out = json.loads(cli("eval", cfg, "--json", check=0).stdout)
    assert out["pairs"] == 24 and out["trained_from"].endswith("adapter")
    assert out["trained/accuracy"] >= out["base/accuracy"]
    assert out["trained/preference_loss"] == pytest.approx(
        [r for r in metrics(tmp_path) if "eval/preference_loss" in r][-1]["eval/preference_loss"], abs=1e-6)


def test_full_fine_tune_dpo(tmp_path, tiny_model, cli):
    cfg = write_pref_run(tmp_path, tiny_model, EXTRA.replace("lr = 0.003", 'lr = 0.001\ntrainable = "full"'), steps=6)
    cfg.write_text(cfg.read_text().replace("[lora]\nrank = 4\nalpha = 8\n", ""))
    cli("train", cfg, check=0)
    evals = [r for r in metrics(tmp_path) if "eval/preference_loss" in r]
    assert evals[0]["eval/preference_loss"] == pytest.approx(math.log(2), abs=1e-9)
    assert evals[-1]["eval/preference_loss"] < evals[0]["eval/preference_loss"]
    assert (tmp_path / "out" / "adapter" / "model.safetensors").is_file()  # an HF model folder


def test_reference_and_evaluation_score_in_the_same_larger_no_gradient_passes(tmp_path, tiny_model, monkeypatch):
    # the reference is scored in the passes evaluation uses (so step 0 evaluates to exactly ln 2 on any
    # model), and those no-gradient passes are SCORING_PASS_FACTOR times a training pass
    from retrograd.config import load_config
    from retrograd.train import preference
    budgets = []
    real = preference.split_pairs

    def spy(pairs, budget):
        budgets.append((torch.is_grad_enabled(), budget))
        return real(pairs, budget)
    monkeypatch.setattr(preference, "split_pairs", spy)
    cfg = write_pref_run(tmp_path, tiny_model, EXTRA.replace("threads = 2", "threads = 2\nmicro_batch = 8"), steps=1)
    preference.train_preference(load_config(cfg), log=lambda m: None)
    assert {b for grad, b in budgets if grad} == {8}
    assert {b for grad, b in budgets if not grad} == {8 * preference.SCORING_PASS_FACTOR}
    assert preference.SCORING_PASS_FACTOR > 1
