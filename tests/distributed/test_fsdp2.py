"""FSDP2 (weights and optimizer state sharded across 2 gloo ranks) for full fine-tunes: the same losses
and weights as one process, a torch.distributed.checkpoint inside the .state folder that resumes
bit-exactly on 2 ranks after kill -9, re-cuts to 1 process, and exports like a one-process checkpoint;
GRPO samples from the weights gathered whole and gives one process's completions and losses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_util import (CKPT, LONG_CKPT, adapter, assert_same_metrics, completions, kill_a_rank_then_resume, run,
                       run_cli, train_losses)
from tiny import make_teacher_dir, write_distill_run, write_grpo_run, write_ppo_run, write_pref_run, write_run


def no_lora(cfg: Path) -> Path:
    text = cfg.read_text()
    cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
    return cfg


def full_config(tmp_path: Path, tiny_model: Path, extra: str, steps: int, rows: int = 22) -> Path:
    cfg = write_run(tmp_path, tiny_model, '[training]\ntrainable = "full"\nlr = 0.001\n' + extra, steps=steps,
                    train_rows=rows, name="full.toml")
    text = cfg.read_text()
    cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
    return cfg


def sets(tag: str) -> list[str]:
    return ["--set", f'run.directory="runs/{tag}"', "--set", f'checkpoint.directory="ckpt-{tag}"',
            "--set", f'output.path="out-{tag}"']


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_sft_full_sharded_takes_one_process_updates_and_exports_alike(tmp_path, tiny_model):
    cfg = full_config(tmp_path, tiny_model, CKPT, steps=5)  # 22 rows of 4: uneven shares at the epoch's end
    code1, out1 = run(tmp_path, cfg, *sets("one"), nproc=1)
    code2, out2 = run(tmp_path, cfg, *sets("two"))
    assert code1 == 0 and code2 == 0, out1 + out2
    assert "distributed: 2 processes (fsdp2)" in out2 and f"wrote {tmp_path / 'out-two'}" in out2
    one, two = train_losses(tmp_path / "runs/one"), train_losses(tmp_path / "runs/two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
    a, b = weights(tmp_path / "out-one"), weights(tmp_path / "out-two")
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-4)
    # the checkpoint: each rank's shard + DCP metadata, under the manifest like every other file
    step4 = tmp_path / "ckpt-two" / "step-000000000004.state"
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng.pt", "rng-rank-1.pt"} <= set(manifest["files"])
    assert manifest["world_size"] == 2 and "weights.safetensors" not in manifest["files"]
    for tag in ("one", "two"):  # one process exports the sharded checkpoint as it does its own
        code, out = run_cli(tmp_path, "export", tmp_path / f"ckpt-{tag}" / "step-000000000004.state", "--format", "hf",
                            "--out", tmp_path / f"exported-{tag}")
        assert code == 0, out
    e1, e2 = weights(tmp_path / "exported-one"), weights(tmp_path / "exported-two")
    assert sorted(e1) == sorted(e2)
    for k in e1:
        torch.testing.assert_close(e2[k], e1[k], atol=1e-4, rtol=1e-4)
    # bf16 compute, float32 weights / optimizer / reduction: the fp32 curve within bf16's rounding
    code, out = run(tmp_path, cfg, *sets("bf16"), "--set", 'distributed.mixed_precision="bf16"')
    assert code == 0 and "wrote " in out, out
    mixed = train_losses(tmp_path / "runs/bf16")
    assert all(mixed[s] == pytest.approx(one[s], abs=0.05) for s in one) and mixed != two
    assert all(t.dtype == torch.float32 for t in weights(tmp_path / "out-bf16").values())


def test_killed_rank_resumes_bit_exact_and_another_world_size_re_cuts(tmp_path, tiny_model):
    cfg = full_config(tmp_path, tiny_model, LONG_CKPT, steps=60, rows=40)
    code, out = run(tmp_path, cfg, *sets("straight"))
    assert code == 0 and "wrote " in out, out
    straight = weights(tmp_path / "out-straight")

    kill_a_rank_then_resume(tmp_path, cfg, sets("killed"), tmp_path / "ckpt-killed/step-000000000010.state")
    resumed = weights(tmp_path / "out-killed")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # one process continues from the 2-rank shards (re-cut), to the same weights within float noise
    code, out = run(tmp_path, cfg, *sets("one"), "--resume", tmp_path / "ckpt-straight" / "step-000000000030.state",
                    nproc=1)
    assert code == 0 and "saved by 2 process(es), this run has 1" in out, out
    alone = weights(tmp_path / "out-one")
    for k in straight:
        torch.testing.assert_close(alone[k], straight[k], atol=1e-4, rtol=1e-4)
    # a whole-model checkpoint (one process) cannot feed a sharded run's optimizer: refused, named
    step = tmp_path / "ckpt-one" / "step-000000000040.state"
    code, out = run(tmp_path, cfg, *sets("mixed"), "--resume", step)
    assert code != 0 and "an fsdp2 run resumes only its own sharded checkpoints" in out, out


def test_dpo_full_sharded_matches_one_process(tmp_path, tiny_model):
    cfg = write_pref_run(tmp_path, tiny_model, '[training]\ntrainable = "full"\nlr = 0.001\n', steps=3)
    text = cfg.read_text()
    cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
    code1, out1 = run(tmp_path, cfg, "--set", 'run.directory="runs/one"', "--set", 'output.path="out-one"', nproc=1)
    code2, out2 = run(tmp_path, cfg, "--set", 'run.directory="runs/two"', "--set", 'output.path="out-two"')
    assert code1 == 0 and code2 == 0 and "(fsdp2)" in out2, out1 + out2
    one, two = train_losses(tmp_path / "runs/one"), train_losses(tmp_path / "runs/two")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step


def test_lora_over_a_sharded_base_matches_one_process_resumes_and_exports(tmp_path, tiny_model):
    # fsdp2 with a LoRA: the frozen base sharded too (a base too big for one device); the checkpoint
    # holds the adapter and its optimizer state only
    cfg = write_run(tmp_path, tiny_model, '[lora]\ndropout = 0.0\n[distributed]\nstrategy = "fsdp2"\n' + CKPT, steps=4,
                    train_rows=22)
    code1, out1 = run(tmp_path, cfg, *sets("one"), nproc=1)
    code2, out2 = run(tmp_path, cfg, *sets("two"))
    assert code1 == 0 and code2 == 0 and "(fsdp2)" in out2 and "wrote " in out2, out1 + out2
    one, two = train_losses(tmp_path / "runs/one"), train_losses(tmp_path / "runs/two")
    assert all(two[s] == pytest.approx(one[s], abs=1e-5) for s in one) and sorted(one) == sorted(two)
    a, b = adapter(tmp_path / "out-one"), adapter(tmp_path / "out-two")
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=2e-4) for k in a)
    step2 = tmp_path / "ckpt-two" / "step-000000000002.state"
    names = set(json.loads((step2 / "manifest.json").read_text())["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names and not any(n.endswith(".gguf") for n in names)
    code, out = run(tmp_path, cfg, *sets("resumed"), "--resume", step2)
    assert code == 0 and "wrote " in out, out
    resumed = adapter(tmp_path / "out-resumed")
    assert all(torch.equal(resumed[k], b[k]) for k in b)
    for tag in ("one", "two"):
        code, out = run_cli(tmp_path, "export", tmp_path / f"ckpt-{tag}" / "step-000000000004.state", "--format", "peft",
                            "--out", tmp_path / f"exported-{tag}")
        assert code == 0, out
    e1, e2 = adapter(tmp_path / "exported-one"), adapter(tmp_path / "exported-two")
    assert set(e1) == set(e2) and all(torch.allclose(e1[k], e2[k], atol=2e-4) for k in e1)


def test_grpo_full_sharded_matches_one_process_resumes_after_kill_and_exports(tmp_path, tiny_model):
    # strategy auto: a full fine-tune of GRPO is sharded; it samples and evaluates from the weights
    # gathered whole, and trains through the model's own forward (the LoRA case: tests/distributed/test_ddp.py)
    ckpt = '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 5\n'
    cfg = write_grpo_run(tmp_path, tiny_model, "[training]\ntrainable = \"full\"\nlr = 0.001\n"
                         "[grpo]\nprompts_per_update = 3\n[evaluation]\ndata = \"prompts.jsonl\"\nmax_examples = 3\n"
                         "every_steps = 10\n" + ckpt, updates=20)
    text = cfg.read_text()
    cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
    code1, out1 = run(tmp_path, cfg, *sets("one"), nproc=1)
    code2, out2 = run(tmp_path, cfg, *sets("two"))
    assert code1 == 0 and code2 == 0 and "distributed: 2 processes (fsdp2)" in out2 and "wrote " in out2, out1 + out2
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/two")
    assert_same_metrics(tmp_path, ("train/loss", "reward/mean", "eval/mean_reward", "train/tokens"))
    alone, straight = weights(tmp_path / "out-one"), weights(tmp_path / "out-two")
    assert sorted(alone) == sorted(straight)
    for k in straight:
        torch.testing.assert_close(straight[k], alone[k], atol=1e-4, rtol=1e-4)
    last = tmp_path / "ckpt-two" / "step-000000000020.state"
    names = set(json.loads((last / "manifest.json").read_text())["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-rank-1.pt"} <= names

    # kill -9 of a rank after update 5's checkpoint; --resume gives the straight run's weights bit for bit
    kill_a_rank_then_resume(tmp_path, cfg, sets("killed"), tmp_path / "ckpt-killed/step-000000000005.state")
    resumed = weights(tmp_path / "out-killed")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # one process exports the sharded checkpoint: the 2-rank run's weights, so one process's within float noise
    code, out = run_cli(tmp_path, "export", last, "--format", "hf", "--out", tmp_path / "exported")
    assert code == 0, out
    exported = weights(tmp_path / "exported")
    assert sorted(exported) == sorted(alone)
    for k in exported:
        torch.testing.assert_close(exported[k], straight[k], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(exported[k], alone[k], atol=1e-4, rtol=1e-4)


def test_ppo_full_sharded_matches_one_process_and_resumes_with_its_critic(tmp_path, tiny_model):
    # auto shards PPO's full fine-tune: the old-policy pass reads the value head's states from the weights
    # gathered whole, each rank trains its share of the passes, and the checkpoint carries the critic
    ckpt = '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 2\n'
    cfg = no_lora(write_ppo_run(tmp_path, tiny_model, '[training]\ntrainable = "full"\nlr = 0.001\n[evaluation]\n'
                                'data = "prompts.jsonl"\nmax_examples = 3\nevery_steps = 2\n' + ckpt, updates=3))
    code1, out1 = run(tmp_path, cfg, *sets("one"), nproc=1)
    code2, out2 = run(tmp_path, cfg, *sets("two"))
    assert code1 == 0 and code2 == 0 and "distributed: 2 processes (fsdp2)" in out2 and "wrote " in out2, out1 + out2
    assert completions(tmp_path / "runs/one") == completions(tmp_path / "runs/two")
    assert_same_metrics(tmp_path, ("train/loss", "policy/value_loss", "critic/value_mean", "policy/clip_fraction",
                                   "eval/mean_reward", "train/tokens"))
    alone, straight = weights(tmp_path / "out-one"), weights(tmp_path / "out-two")
    for k in straight:
        torch.testing.assert_close(straight[k], alone[k], atol=1e-4, rtol=1e-4)
    step2 = tmp_path / "ckpt-two" / "step-000000000002.state"
    names = set(json.loads((step2 / "manifest.json").read_text())["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "critic.safetensors"} <= names, names
    code, out = run(tmp_path, cfg, *sets("resumed"), "--resume", step2)
    assert code == 0 and "resumed from" in out and "wrote " in out, out
    resumed = weights(tmp_path / "out-resumed")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_offline_topk_distillation_full_sharded_matches_one_process(tmp_path, tiny_model):
    # its loss reads the student's logits from the sharded model's own forward (the fused head needs the
    # head whole); 2 ranks give one process's KL, evaluation and weights
    teacher = make_teacher_dir(tmp_path / "teacher", tiny_model)
    cfg = no_lora(write_distill_run(tmp_path, tiny_model, teacher, '[training]\ntrainable = "full"\nlr = 0.003\n'
                                    '[evaluation]\ndata = "eval.jsonl"\nevery_steps = 3\n', mode="topk_offline"))
    code, out = run_cli(tmp_path, "distill-teacher", cfg, "--k", "8")
    assert code == 0, out
    tags = {tag: ["--set", f'run.directory="runs/{tag}"', "--set", f'output.path="out-{tag}"',
                  "--set", "training.max_steps=6"] for tag in ("one", "two")}
    code1, out1 = run(tmp_path, cfg, *tags["one"], nproc=1)
    code2, out2 = run(tmp_path, cfg, *tags["two"])
    assert code1 == 0 and code2 == 0 and "distributed: 2 processes (fsdp2)" in out2 and "wrote " in out2, out1 + out2
    assert_same_metrics(tmp_path, ("train/loss", "distill/topk_kl", "eval/teacher_kl", "eval/top1_agreement",
                                   "train/tokens"))
    alone, two = weights(tmp_path / "out-one"), weights(tmp_path / "out-two")
    for k in alone:
        torch.testing.assert_close(two[k], alone[k], atol=1e-4, rtol=1e-4)


def test_ranks_after_the_first_build_on_meta_and_receive_weights_and_buffers(tmp_path, tiny_model):
    # only rank 0 reads the weights; the others' shards and every buffer (RoPE's inv_freq is non-persistent,
    # so garbage after to_empty unless handed over) come from it, and the forward is the model read from disk
    worker = Path(__file__).with_name("meta_load_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(worker),
                        str(tiny_model)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "META-LOAD-OK 0" in out and "META-LOAD-OK 1" in out, out
