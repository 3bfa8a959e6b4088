"""Distillation on tiny models, as a user runs it. The student is a sharpened random model, the
teacher a sharper copy of it (tests/tiny.make_teacher_dir): on-policy distillation and offline top-k
(`retrograd distill-teacher` then `retrograd train`) both move the student's KL to the teacher down;
a killed run resumes bit for bit; `retrograd eval` reports KL and top-1 agreement; a teacher with
another tokenizer, a stale .topk file and keys of the other mode are refused by name."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tiny import make_model_dir, make_teacher_dir, make_tokenizer, write_distill_run


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill-models")
    student = make_teacher_dir(root / "student", make_model_dir(root / "random"), sharpen=10.0)
    return student, make_teacher_dir(root / "teacher", student, sharpen=2.0)


def rows(folder, name):
    return [json.loads(x) for x in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def evals(folder, name):
    return [r for r in rows(folder, name) if "eval/teacher_kl" in r]


FULL = ('[training]\ntrainable = "full"\nlr = 0.003\n[distill]\nsamples_per_prompt = 4\n'
        '[evaluation]\ndata = "prompts.jsonl"\nevery_steps = 10\n')


def _no_lora(cfg):
    cfg.write_text(cfg.read_text().replace("[lora]\nrank = 4\nalpha = 8\n", ""))
    return cfg


def test_on_policy_moves_the_student_to_the_teacher(tmp_path, pair, cli):
    cfg = _no_lora(write_distill_run(tmp_path, *pair, FULL, updates=30))
    cli("train", cfg, check=0)
    ev = evals(tmp_path, "distill")
    assert [r["step"] for r in ev] == [0, 10, 20, 30]
    assert ev[-1]["eval/teacher_kl"] < 0.3 * ev[0]["eval/teacher_kl"], ev
    train = [r for r in rows(tmp_path, "distill") if "policy/loss" in r]
    for key in ("distill/teacher_kl_mean", "distill/teacher_kl_p95", "distill/advantage_clipped_fraction",
                "distill/teacher_top1_fraction", "completions/mean_length", "optimizer/grad_norm"):
        assert key in train[-1], key
    assert train[0]["policy/ratio_max"] == pytest.approx(1.0)  # one epoch: the ratio is 1
    # the surrogate's value at ratio 1 is the mean of -A over the sampled tokens: the KL estimate, less
    # what the clamp at weight_clip took off the largest gaps
    for r in train:
        if r["distill/advantage_clipped_fraction"] == 0:
            assert r["policy/loss"] == pytest.approx(r["distill/teacher_kl_mean"], rel=1e-4, abs=1e-6)
        else:
            assert r["policy/loss"] < r["distill/teacher_kl_mean"]
    assert (tmp_path / "out" / "adapter" / "config.json").exists()  # a full fine-tune writes an HF folder


EXTRA = """
[training]
lr = 0.003
threads = 2
[distill]
distill_epochs = 2
kl_coefficient = 0.05
[evaluation]
data = "prompts.jsonl"
every_steps = 3
max_examples = 4
[checkpoint]
directory = "ckpt"
mode = "steps_and_best_eval"
every_steps = 3
"""


def test_on_policy_lora_resumes_bit_exact_and_evaluates(tmp_path, pair, cli):
    cfg = write_distill_run(tmp_path, *pair, EXTRA, updates=6)
    cli("train", cfg, check=0)
    final = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    train = [r for r in rows(tmp_path, "distill") if "policy/loss" in r]
    assert any(r["policy/kl"] > 0 for r in train) and "optimizer/grad_norm/epoch_2" in train[-1]
    assert (tmp_path / "ckpt" / "best.state").exists()
    shutil.rmtree(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "out")
    killed = cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000006.state"})
    assert killed.returncode != 0
    cli("train", cfg, "--resume", check=0)
    resumed = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)

    out = json.loads(cli("eval", cfg, "--json", check=0).stdout)
    assert out["prompts"] == 4 and out["trained_from"].endswith("adapter")
    assert {"base/teacher_kl", "trained/teacher_kl", "base/top1_agreement", "trained/top1_agreement"} <= set(out)
    text = cli("eval", cfg, check=0).stdout
    assert "KL to teacher" in text and "trained" in text


def test_offline_topk_learns_resumes_and_refuses_a_stale_file(tmp_path, pair, cli):
    extra = ('[training]\ntrainable = "full"\nlr = 0.003\n[evaluation]\ndata = "eval.jsonl"\nevery_steps = 6\n'
             '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 6\n')
    cfg = _no_lora(write_distill_run(tmp_path, *pair, extra, mode="topk_offline", name="offline.toml"))
    missing = cli("train", cfg)
    assert missing.returncode == 2 and "retrograd distill-teacher" in missing.stderr
    wrote = cli("distill-teacher", cfg, "--k", "8", check=0)
    assert "top-8" in wrote.stdout and (tmp_path / "teacher.topk").exists()
    cli("train", cfg, check=0)
    ev = evals(tmp_path, "offline")
    assert ev[0]["step"] == 0 and ev[-1]["step"] == 12  # 24 rows, 4 per step, offline_epochs = 2
    assert ev[-1]["eval/teacher_kl"] < 0.5 * ev[0]["eval/teacher_kl"], ev
    assert ev[-1]["eval/top1_agreement"] >= ev[0]["eval/top1_agreement"]
    last = [r for r in rows(tmp_path, "offline") if "distill/topk_kl" in r][-1]
    assert last["distill/topk_entries"] == 8

    final = load_file(tmp_path / "out" / "adapter" / "model.safetensors")
    shutil.rmtree(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "out")
    assert cli("train", cfg, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "step-000000000012.state"}).returncode != 0
    cli("train", cfg, "--resume", check=0)
    resumed = load_file(tmp_path / "out" / "adapter" / "model.safetensors")
    assert all(torch.equal(resumed[k], final[k]) for k in final)

    data = tmp_path / "train.jsonl"
    data.write_text(data.read_text().replace("red", "grey"))
    shutil.rmtree(tmp_path / "ckpt")
    stale = cli("train", cfg)
    assert stale.returncode == 2 and "distill.data changed" in stale.stderr and "distill-teacher" in stale.stderr


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, pair, cli):
    other = make_model_dir(tmp_path / "other-teacher", tokenizer=make_tokenizer(merges=("r e",)))
    cfg = write_distill_run(tmp_path, pair[0], other, updates=1)
    r = cli("train", cfg)
    assert r.returncode == 2 and str(other) in r.stderr and str(pair[0]) in r.stderr and "tokenizer" in r.stderr
    cfg = write_distill_run(tmp_path, pair[0], other, mode="topk_offline", name="offline.toml")
    r = cli("distill-teacher", cfg)
    assert r.returncode == 2 and "different tokenizers" in r.stderr


@pytest.mark.parametrize("extra, mode, message", [
    ("[distill]\nweight_clip = 3.0\n", "topk_offline", "distill.weight_clip is not read by mode = 'topk_offline'"),
    ('[distill]\nsidecar = "x.topk"\n', "on_policy", "distill.sidecar is not read by mode = 'on_policy'"),
    ("[training]\nepochs = 3\n", "topk_offline", "distill.offline_epochs"),
    ('[training]\ntrainable = "full"\n[distill]\nkl_coefficient = 0.1\n', "on_policy", "needs a [reference] model"),
    ('[reference]\nmodel = "x"\n', "on_policy", "distill.kl_coefficient = 0"),
])
def test_configs_that_cannot_work_are_refused(tmp_path, pair, cli, extra, mode, message):
    cfg = write_distill_run(tmp_path, *pair, extra, mode=mode)
    if "trainable" in extra:
        _no_lora(cfg)
    r = cli("train", cfg)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_on_policy_needs_its_prompts(tmp_path, pair, cli):
    cfg = write_distill_run(tmp_path, *pair)
    cfg.write_text(cfg.read_text().replace('prompts = "prompts.jsonl"\n', ""))
    r = cli("train", cfg)
    assert r.returncode == 2 and "needs prompts" in r.stderr
