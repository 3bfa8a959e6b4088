"""GRPO LoRA seconds per update and its split: retrograd vs TRL's GRPOTrainer, side by side.

A by-hand benchmark, not a test. Same model, prompts and settings on both sides:

  model       SmolLM2-135M-Instruct, retrograd's built-in GGUF (Q4_1, de-quantized to fp32)
  LoRA        r=8, alpha=16, dropout 0, q_proj, k_proj, v_proj, o_proj
  update      4 prompts x 4 completions, at most 32 new tokens, temperature 1.0, one optimizer step;
              loss normalised over tokens (TRL's default loss_type "dapo"; retrograd
              loss_normalisation = "token"), no KL (beta 0: no reference pass), lr 1e-4 constant
  prompts     "What is a + b? Reply with only the number." (32 of them, seed 0); reward 1 when the
              last integer of the completion is a + b, minus 0.001 per character beyond the first (a
              tie-breaker, so every group has a learning signal and both sides train on all 16
              completions; retrograd leaves groups with equal rewards out of the step, TRL does not)
  precision   all fp32 on both sides; then model weights in bf16 on both sides (retrograd [model]
              dtype = "bfloat16", whose sampler then runs bf16 matmuls too; TRL
              model.to(torch.bfloat16)); then TRL at its own default, GRPOConfig(bf16=True): fp32
              weights under bf16 autocast. The published TRL baseline is the fp32 run. In every bf16
              run the LoRA weights and Adam state are float32 on both sides.
  other       no gradient checkpointing, 2 threads, seed 0; TRL generates with transformers'
              generate (no vLLM), retrograd with its own sampler

Reported: seconds per update (mean of updates 2+), its split (sampling / reward / training), peak
RSS, sampling tokens per second, and the share of this machine's fp32 matmul throughput (measured in
the same script with a plain torch matmul) that sampling and training reach.

    pip install -e '.[bench]'
    python benchmarks/bench_grpo.py [--steps 6] [--out bench_out]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft  # noqa: E402
from bench_sft import (LORA_ALPHA, LORA_R, LORA_TARGETS, THREADS, cpu_model,  # noqa: E402
                       load_trl_model, self_peak_rss_mb, versions, worker_prepare, write_json)

PROMPTS, GENS, MAX_NEW, LR, SEED = 4, 4, 32, 1e-4, 0


def write_prompts(path: Path) -> None:
    rng = random.Random(SEED)
    rows = []
    for _ in range(32):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                     "answer": a + b})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def matmul_gflops() -> float:
    """This machine's plain fp32 matmul throughput (2 threads), a [1024, 576] x [576, 1536] product."""
    import torch
    torch.set_num_threads(THREADS)
    a, b = torch.randn(1024, 576), torch.randn(576, 1536)
    for _ in range(5):
        a @ b
    n, t = 50, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 1024 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9


def matmul_params(model) -> int:
    import torch
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def worker_retrograd(args) -> dict:
    from retrograd.config import load_config
    from retrograd.train.grpo import train_grpo
    work = Path(args.work)
    (work / "run.toml").write_text(f"""
[run]
algorithm = "grpo"
name = "bench_grpo"
directory = {json.dumps(str(work / "run"))}
[model]
path = {json.dumps(args.gguf)}
device = "cpu"
[output]
path = {json.dumps(str(work / "adapter"))}
[lora]
rank = {LORA_R}
alpha = {LORA_ALPHA}
targets = {json.dumps(LORA_TARGETS)}
[training]
lr = {LR}
ctx = 256
seed = {SEED}
threads = {THREADS}
[grpo]
prompts = {json.dumps(args.data)}
updates = {args.steps}
prompts_per_update = {PROMPTS}
group_size = {GENS}
loss_normalisation = "token"
prompt_order = "sequential"
log_completions_every = 0
rewards = [{{ type = "match", extract = "last_number" }}, {{ type = "length", target = 1, penalty = 0.001 }}]
[grpo.sampling]
max_new_tokens = {MAX_NEW}
temperature = 1.0
seed = {SEED}
dtype = "auto"
""")
    if args.worker == "retrograd_bf16":  # the whole run in bf16: model weights, sampling and training
        toml = (work / "run.toml").read_text()
        (work / "run.toml").write_text(toml.replace('device = "cpu"\n', 'device = "cpu"\ndtype = "bfloat16"\n'))
    events = []
    cfg = load_config(work / "run.toml")
    train_grpo(cfg, log=lambda m: (events.append(str(m)), print(m, flush=True)))
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    from retrograd.models.load import load_model
    n = matmul_params(load_model(args.gguf, log=lambda *_: None).model)
    return {"step_s": [r["system/step_seconds"] for r in rows], "sampling_s": [r["time/sampling_s"] for r in rows],
            "reward_s": [r["time/reward_s"] for r in rows], "training_s": [r["time/training_s"] for r in rows],
            "sampled_tokens": [r["completions/mean_length"] * PROMPTS * GENS for r in rows],
            "trained_tokens": [r["train/tokens"] for r in rows], "reward": [r["reward/match/mean"] for r in rows],
            "groups_skipped": [r["batch/zero_std_group_fraction"] for r in rows],
            "matmul_params": n}


def worker_trl(args) -> dict:
    import torch
    import trl.extras.profiling as prof
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer
    torch.set_num_threads(THREADS)
    set_seed(SEED)
    spans = defaultdict(list)
    original = prof.ProfilingContext._log_metrics

    def capture(self, duration):  # TRL's own profiling spans (generation, reward, ...)
        spans[self.name].append(duration)
        return original(self, duration)
    prof.ProfilingContext._log_metrics = capture

    def reward(completions, answer, **kw):
        out = []
        for c, a in zip(completions, answer):
            text = c[-1]["content"] if isinstance(c, list) else c
            nums = re.findall(r"-?\d+", text.replace(",", ""))
            out.append(1.0 if nums and int(nums[-1]) == int(a) else 0.0)
        return out

    def length(completions, **kw):  # retrograd's `length` reward with target 1, penalty 0.001
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [-0.001 * max(0, len(t) - 1) for t in texts]

    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    model, tok = load_trl_model(args.gguf)
    if args.worker == "trl_bf16":  # the whole run in bf16, like retrograd's [model] dtype = "bfloat16"
        model = model.to(torch.bfloat16)
    tok.padding_side = "left"

    class StepTimer(TrainerCallback):
        step_s: list = []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_s.append(time.perf_counter() - self._t)

    timer = StepTimer()
    cfg = GRPOConfig(output_dir=str(Path(args.work) / "trl_out"), max_steps=args.steps,
                     per_device_train_batch_size=PROMPTS * GENS, num_generations=GENS, gradient_accumulation_steps=1,
                     max_completion_length=MAX_NEW, temperature=1.0, learning_rate=LR,
                     bf16=args.worker == "trl_amp", fp16=False,
                     gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
                     use_cpu=True, dataloader_num_workers=0, seed=SEED, lr_scheduler_type="constant",
                     disable_tqdm=True)
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[reward, length], args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, peft_config=lora, callbacks=[timer])
    trainer.train()
    logs = [x for x in trainer.state.log_history if "reward" in x]
    gen = spans.get("GRPOTrainer.transformers.generate", [])
    rew = spans.get("GRPOTrainer._calculate_rewards") or [0.0] * len(gen)
    return {"step_s": timer.step_s, "sampling_s": gen, "reward_s": rew,
            "training_s": [t - g - r for t, g, r in zip(timer.step_s, gen, rew)],
            "sampled_tokens": [x.get("completions/mean_length", 0) * PROMPTS * GENS for x in logs],
            "reward": [x.get("rewards/reward/mean", x.get("reward")) for x in logs], "spans": {k: v for k, v in spans.items()}}

KINDS = ("retrograd", "trl", "retrograd_bf16", "trl_bf16", "trl_amp")
WORKERS = {"prepare": worker_prepare, "retrograd": worker_retrograd, "retrograd_bf16": worker_retrograd,
           "trl": worker_trl, "trl_bf16": worker_trl, "trl_amp": worker_trl}


def spawn(kind: str, tmp: Path, steps: int, data: Path, gguf: str = "") -> dict:
    return bench_sft.spawn(kind, tmp, steps, data, gguf, script=__file__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 6)))
    p.add_argument("--out", default="bench_out")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for internal in ("--work", "--data", "--gguf", "--result"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        out = WORKERS[args.worker](args)
        out["worker_peak_rss_mb"] = self_peak_rss_mb()
        write_json(Path(args.result), out)
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    peak = matmul_gflops()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_grpo-") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "prompts.jsonl"
        write_prompts(data)
        prep = spawn("prepare", tmp, args.steps, data)
        for kind in KINDS:
            results[kind] = spawn(kind, tmp, args.steps, data, prep["gguf"])
    n_matmul = results["retrograd"]["matmul_params"]
    summary = {}
    for kind, r in results.items():
        k = slice(1, None)  # update 1 is warm-up

        def mean(key):
            v = r[key][k]
            return sum(v) / len(v)
        sampling_tps = sum(r["sampled_tokens"][k]) / sum(r["sampling_s"][k])
        summary[kind] = {"s_per_update": mean("step_s"), "sampling_s": mean("sampling_s"), "reward_s": mean("reward_s"),
                         "training_s": mean("training_s"), "sampling_tokens_per_s": sampling_tps,
                         "sampling_share_of_matmul_peak": sampling_tps * 2 * n_matmul / 1e9 / peak,
                         "peak_rss_mb": max(r["process_peak_rss_mb"], r["worker_peak_rss_mb"]),
                         "mean_match_reward": sum(r["reward"]) / len(r["reward"])}
    print(f"\nGRPO LoRA r={LORA_R} q,k,v,o | SmolLM2-135M | {PROMPTS} prompts x {GENS} completions x <= {MAX_NEW} "
          f"tokens | {args.steps} updates (mean of 2+) | {THREADS} threads | fp32 matmul peak {peak:.0f} GFLOP/s")
    print("fp32: everything in float32 on both sides; bf16: model weights in bfloat16 on both sides "
          "(retrograd [model] dtype = \"bfloat16\", TRL model.to(bfloat16)); TRL amp: TRL's default "
          "GRPOConfig(bf16=True), fp32 weights under bf16 autocast")
    fmt = "{:<30}" + " {:>9}" * 10
    print(fmt.format("", "rg fp32", "TRL fp32", "ratio", "rg bf16", "TRL bf16", "ratio", "TRL amp", "rg16/amp",
                     "rg16/fp32", ""))
    rg, trl, rb, tb, ta = (summary[k] for k in KINDS)
    for key in rg:
        def ratio(a, b):
            return f"{a[key] / b[key]:.2f}x" if b[key] else ""
        print(fmt.format(key, f"{rg[key]:.3f}", f"{trl[key]:.3f}", ratio(rg, trl), f"{rb[key]:.3f}", f"{tb[key]:.3f}",
                         ratio(rb, tb), f"{ta[key]:.3f}", ratio(rb, ta), ratio(rb, trl), ""))
    write_json(out_dir / "result_grpo.json", {"summary": summary, "raw": results, "matmul_gflops": peak,
                                              "versions": versions(), "cpu": cpu_model()})
    print(f"wrote {out_dir / 'result_grpo.json'}")


if __name__ == "__main__":
    main()
