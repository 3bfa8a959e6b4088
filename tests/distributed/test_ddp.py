"""Data-parallel training under torchrun with 2 gloo processes (one thread each) on a tiny model:
the same losses as one process, a killed rank stops every rank, SIGTERM saves, resume is bit-exact
at the same world size and continues at another, and what cannot run distributed is refused. The GRPO
and on-policy distillation tests also launch the same LoRA run with strategy fsdp2 (the base sharded;
full fine-tunes: tests/distributed/test_fsdp2.py) against the same one-process run.

Each launch is `retrograd train run.toml --nproc 2` (torchrun underneath), as a user runs it; the
tests look for rank 0's success line ("wrote ...") and not only at exit codes.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from dist_util import (CKPT, LONG_CKPT, adapter, assert_same_metrics, completions, kill_a_rank_then_resume, launch,
                       overrides, run, run_cli, train_losses, wait_for)
from tiny import make_teacher_dir, write_distill_run, write_grpo_run, write_ppo_run, write_pref_run, write_run

def test_sft_lora_two_ranks_take_one_process_updates(tmp_path, tiny_model):
    cfg = write_run(tmp_path, tiny_model, "[lora]\ndropout = 0.0\n" + CKPT, steps=5, train_rows=22)
    code1, out1 = run(tmp_path, cfg, *overrides("one"), nproc=1)
    code2, out2 = run(tmp_path, cfg, *overrides("two"))
    assert code1 == 0 and code2 == 0, out1 + out2
    assert f"wrote {tmp_path / 'out-two' / 'adapter'}" in out2
    assert "distributed: 2 processes (ddp)" in out2 and out2.count("step 5/5") == 1  # rank 0 alone prints
    one, two = train_losses(tmp_path / "runs/one"), train_losses(tmp_path / "runs/two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    for step in one:  # 22 rows of 4 per step: the last steps of the epoch are uneven across ranks
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
    a, b = adapter(tmp_path / "out-one/adapter"), adapter(tmp_path / "out-two/adapter")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-4, rtol=1e-3)
    # the checkpoint keeps every rank's random state; export reads it like a one-process checkpoint
    step4 = tmp_path / "ckpt-two" / "step-000000000004.state"
    assert (step4 / "rng-rank-1.pt").exists()
    assert json.loads((step4 / "manifest.json").read_text())["world_size"] == 2
    for tag in ("one", "two"):
        code, out = run_cli(tmp_path, "export", tmp_path / f"ckpt-{tag}" / "step-000000000004.state", "--format", "peft",
                            "--out", tmp_path / f"exported-{tag}")
        assert code == 0, out
    e1, e2 = adapter(tmp_path / "exported-one"), adapter(tmp_path / "exported-two")
    assert set(e1) == set(e2) and len(e1) > 0
    for k in e1:
        torch.testing.assert_close(e2[k], e1[k], atol=2e-4, rtol=1e-3)


def test_sft_full_and_dpo_two_ranks_match_one_process(tmp_path, tiny_model):
    full = write_run(tmp_path, tiny_model, '[training]\ntrainable = "full"\nlr = 0.001\n[distributed]\nstrategy = "ddp"\n',
                     steps=3, name="full.toml")
    text = full.read_text()
    full.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
    dpo = write_pref_run(tmp_path, tiny_model, '[preference]\nloss = "dpo"\n' + CKPT, steps=3)
    for cfg, kind in ((full, "full"), (dpo, "dpo")):
        sets = ["--set", f'run.directory="runs/{kind}-one"', "--set", f'output.path="out-{kind}-one"']
        code1, out1 = run(tmp_path, cfg, *sets, *(["--set", 'checkpoint.directory="ckpt-one"'] if kind == "dpo" else []),
                          nproc=1)
        sets = ["--set", f'run.directory="runs/{kind}-two"', "--set", f'output.path="out-{kind}-two"']
        code2, out2 = run(tmp_path, cfg, *sets, *(["--set", 'checkpoint.directory="ckpt-two"'] if kind == "dpo" else []))
        assert code1 == 0 and code2 == 0, out1 + out2
        assert "wrote " in out2
        one, two = train_losses(tmp_path / f"runs/{kind}-one"), train_losses(tmp_path / f"runs/{kind}-two")
        assert sorted(one) == sorted(two) == [1, 2, 3]
        for step in one:
            assert two[step] == pytest.approx(one[step], abs=1e-5), (kind, step)


def test_killed_rank_stops_all_sigterm_saves_and_resume_is_exact(tmp_path, tiny_model):
    # enough steps (~20 ms each) that a signal lands mid-run; dropout makes every rank's RNG matter
    cfg = write_run(tmp_path, tiny_model, "[lora]\ndropout = 0.1\n" + LONG_CKPT, steps=120, train_rows=40)
    code, out = run(tmp_path, cfg, *overrides("straight"))
    assert code == 0 and "wrote " in out, out
    straight = adapter(tmp_path / "out-straight/adapter")

    # kill -9 one rank: torchrun stops the other (no hang), and the last checkpoint resumes exactly
    kill_a_rank_then_resume(tmp_path, cfg, overrides("killed"), tmp_path / "ckpt-killed/step-000000000010.state")
    resumed = adapter(tmp_path / "out-killed/adapter")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # SIGTERM to torchrun: every rank finishes the same step, rank 0 saves it, the run resumes exactly
    p = launch(tmp_path, cfg, *overrides("term"))
    wait_for(tmp_path / "ckpt-term/step-000000000010.state", p)
    os.kill(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=90)
    assert "SIGTERM received" in out, out
    steps = sorted(d.name for d in (tmp_path / "ckpt-term").glob("step-*.state"))
    stopped_at = int(steps[-1][5:17])
    assert 10 <= stopped_at < 120, steps
    assert f"stopped at step {stopped_at}" in out, out
    code, out = run(tmp_path, cfg, *overrides("term"), "--resume")
    assert code == 0 and f"at step {stopped_at}" in out and "wrote " in out, out
    resumed = adapter(tmp_path / "out-term/adapter")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # another world size continues the run (the state is replicated): one process from a 2-rank checkpoint
    code, out = run(tmp_path, cfg, *overrides("one"), "--resume", tmp_path / "ckpt-term" / "step-000000000010.state",
                    nproc=1)
    assert code == 0 and "saved by 2 process(es), this run has 1" in out, out


def test_grpo_lora_two_ranks_sample_and_update_as_one_process(tmp_path, tiny_model):
    # 3 prompts per update: rank 0 samples groups 0 and 2, rank 1 group 1; the KL term runs the reference too
    cfg = write_grpo_run(tmp_path, tiny_model, "[grpo]\nprompts_per_update = 3\nkl_coefficient = 0.05\n"
                         "[evaluation]\ndata = \"prompts.jsonl\"\nmax_examples = 5\n" + CKPT, updates=4)
    code1, out1 = run(tmp_path, cfg, *overrides("one"), nproc=1)
    code2, out2 = run(tmp_path, cfg, *overrides("two"))
    assert code1 == 0 and code2 == 0 and "wrote " in out2, out1 + out2
    # the same completions, rewards (each group from its own random stream), losses and evaluations
    keys = ("train/loss", "policy/kl", "reward/mean", "eval/mean_reward", "train/tokens")
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/two")
    assert_same_metrics(tmp_path, keys)
    # and under fsdp2 (the base sharded too): sampling, the evaluation at step 0 (before any training
    # forward) and the KL term's no-grad reference pass (adapter disabled) read the weights gathered whole
    code3, out3 = run(tmp_path, cfg, *overrides("fsdp2"), "--set", 'distributed.strategy="fsdp2"')
    assert code3 == 0 and "(fsdp2)" in out3 and "wrote " in out3, out3
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/fsdp2")
    assert_same_metrics(tmp_path, keys, ("one", "fsdp2"))
    a, b = adapter(tmp_path / "out-one/adapter"), adapter(tmp_path / "out-fsdp2/adapter")
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=2e-4) for k in a)
    # resumed at update 2 on 2 ranks: the straight 2-rank run's adapter, bit for bit
    code, out = run(tmp_path, cfg, *overrides("two-resumed"),
                    "--resume", tmp_path / "ckpt-two" / "step-000000000002.state")
    assert code == 0 and "wrote " in out, out
    straight, resumed = adapter(tmp_path / "out-two/adapter"), adapter(tmp_path / "out-two-resumed/adapter")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_on_policy_distillation_two_ranks_match_one_process(tmp_path, tiny_model):
    teacher = make_teacher_dir(tmp_path / "teacher", tiny_model)
    # 3 prompts per update and temperature 0.8: the student's log-probs come from a forward on each rank
    cfg = write_distill_run(tmp_path, tiny_model, teacher, "[distill]\nprompts_per_update = 3\n"
                            "[distill.sampling]\ntemperature = 0.8\n"
                            "[evaluation]\ndata = \"prompts.jsonl\"\nmax_examples = 5\n", updates=3)
    code1, out1 = run(tmp_path, cfg, "--set", 'run.directory="runs/one"', "--set", 'output.path="out-one/adapter"',
                      nproc=1)
    code2, out2 = run(tmp_path, cfg, "--set", 'run.directory="runs/two"', "--set", 'output.path="out-two/adapter"')
    assert code1 == 0 and code2 == 0 and "wrote " in out2, out1 + out2
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/two")
    keys = ("train/loss", "distill/teacher_kl_mean", "distill/teacher_kl_p95", "distill/teacher_top1_fraction",
            "eval/teacher_kl", "eval/top1_agreement")
    assert_same_metrics(tmp_path, keys)
    # the same under fsdp2 (the base sharded too): the student samples, is evaluated and scored without
    # gradient from its weights gathered whole, and trains through its own forward
    code3, out3 = run(tmp_path, cfg, "--set", 'run.directory="runs/fsdp2"', "--set", 'output.path="out-fsdp2/adapter"',
                      "--set", 'distributed.strategy="fsdp2"')
    assert code3 == 0 and "(fsdp2)" in out3 and "wrote " in out3, out3
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/fsdp2")
    assert_same_metrics(tmp_path, keys, ("one", "fsdp2"))


def test_ppo_two_ranks_share_the_rollouts_and_match_one_process(tmp_path, tiny_model):
    cfg = write_ppo_run(tmp_path, tiny_model, "[evaluation]\ndata = \"prompts.jsonl\"\nmax_examples = 5\n", updates=3)
    code1, out1 = run(tmp_path, cfg, "--set", 'run.directory="runs/one"', "--set", 'output.path="out-one/adapter"',
                      nproc=1)
    code2, out2 = run(tmp_path, cfg, "--set", 'run.directory="runs/two"', "--set", 'output.path="out-two/adapter"')
    assert code1 == 0 and code2 == 0 and "wrote " in out2, out1 + out2
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/two")
    assert_same_metrics(tmp_path, ("train/loss", "policy/value_loss", "critic/value_mean", "eval/mean_reward"))


def test_what_cannot_run_distributed_is_refused_at_once(tmp_path, tiny_model):
    bp = write_grpo_run(tmp_path, tiny_model, "[backpressure]\nenabled = true\n", name="bp.toml")
    code, out = run(tmp_path, bp, timeout=120)
    assert code != 0 and "[backpressure] runs on one process in this version" in out, out
    grpo = write_grpo_run(tmp_path, tiny_model, "[grpo.dynamic_sampling]\nmax_resample_factor = 2\n")
    code, out = run(tmp_path, grpo, timeout=120)
    assert code != 0 and "[grpo.dynamic_sampling] runs on one process in this version" in out, out
    sft = write_run(tmp_path, tiny_model, steps=2)
    code, out = run(tmp_path, sft, "--set", 'distributed.strategy="none"', timeout=120)
    assert code != 0 and "launched with 2 processes but distributed.strategy = 'none'" in out, out
    code, out = run(tmp_path, sft, "--nproc", "0", nproc=1)
    assert code == 2 and "--nproc 0" in out
    # a config error is told once, before torchrun starts any process
    code, out = run(tmp_path, sft, "--set", "training.lr=-1", timeout=120)
    assert code == 2 and out.count("error:") == 1 and "training.lr" in out and "ChildFailedError" not in out, out
