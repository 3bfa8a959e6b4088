"""GRPO LoRA seconds per update: retrograd vs TRL's GRPOTrainer, interleaved and checked.

A by-hand benchmark, not a test. Same model, prompts and settings on both sides:

  model       SmolLM2-135M-Instruct, retrograd's built-in GGUF (Q4_1, de-quantized to fp32)
  LoRA        r=8, alpha=16, dropout 0, q_proj, k_proj, v_proj, o_proj
  update      4 prompts x 4 completions, at most 32 new tokens, temperature 1.0, top-p 1, top-k off,
              one optimizer step, lr 1e-4 constant. The objective is set explicitly on both sides:
              TRL loss_type "dapo", scale_rewards "none", beta 0, epsilon 0.2, epsilon_high 0.28,
              num_iterations 1, token-level ratios; retrograd loss_normalisation "token", advantage
              grpo (r - group mean), clip 0.2 / 0.28, kl_coefficient 0, grpo_epochs 1
  prompts     "What is a + b? Reply with only the number." (32 of them, seed 0); reward 1 when the
              last integer of the completion is a + b, minus 0.001 per character beyond the first (a
              tie-breaker, so every group has a learning signal and both sides train on all 16
              completions; retrograd leaves groups with equal rewards out of the step, TRL does not)
  precision   fp32 on both sides, then model weights in bf16 on both sides (retrograd [model] dtype =
              "bfloat16", whose sampler then runs bf16 matmuls too; TRL model.to(torch.bfloat16)); the
              LoRA weights and Adam state stay float32 on both sides
  other       no gradient checkpointing, 2 threads, seed 0; TRL generates with transformers' generate
              (no vLLM), retrograd with its own sampler

Fairness: the two sides run in separate processes, interleaved (rg, TRL, rg, TRL, ...; --repeats
each, default 3) with the load average recorded before each; reported is the median over the
repeats of each run's mean seconds per update (updates 2+), with the spread (min-max). The script
checks, update by update, that each side's logged loss is the objective above recomputed from its
own completions (rewards and token counts): -sum_i A_i n_i / sum_i n_i at ratio 1, within 1e-4 --
and that both sides trained all 16 completions of every update; it stops if either check fails.
Also reported: the split (sampling / reward / training), sampling tokens/s, peak RSS, and this
machine's matmul throughput (fp32 and bf16, measured in the script).

    pip install -e '.[bench]'
    python benchmarks/bench_grpo.py [--steps 6] [--repeats 3] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft  # noqa: E402
import common  # noqa: E402
from bench_sft import (LORA_ALPHA, LORA_R, LORA_TARGETS, THREADS, cpu_model,  # noqa: E402
                       load_trl_model, self_peak_rss_mb, worker_prepare, write_json)

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


def run_toml(model, prompts, updates: int, run_dir, adapter) -> str:
    """retrograd's side of the comparison as a run.toml (also ab_compile_graphs.py's GRPO run)."""
    return f"""
[run]
algorithm = "grpo"
name = "bench_grpo"
directory = {json.dumps(str(run_dir))}
[model]
path = {json.dumps(str(model))}
device = "cpu"
[output]
path = {json.dumps(str(adapter))}
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
prompts = {json.dumps(str(prompts))}
updates = {updates}
prompts_per_update = {PROMPTS}
group_size = {GENS}
loss_normalisation = "token"
advantage_mode = "grpo"
policy_loss = "clip"
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
grpo_epochs = 1
prompt_order = "sequential"
log_completions_every = 1
rewards = [{{ type = "match", extract = "last_number" }}, {{ type = "length", target = 1, penalty = 0.001 }}]
[grpo.sampling]
max_new_tokens = {MAX_NEW}
temperature = 1.0
seed = {SEED}
dtype = "auto"
"""


def worker_retrograd(args) -> dict:
    common.start_like_the_cli()
    from retrograd.config import load_config
    from retrograd.train.grpo import train_grpo
    work = Path(args.work)
    (work / "run.toml").write_text(run_toml(args.gguf, args.data, args.steps, work / "run", work / "adapter"))
    if args.worker == "retrograd_bf16":  # the whole run in bf16: model weights, sampling and training
        toml = (work / "run.toml").read_text()
        (work / "run.toml").write_text(toml.replace('device = "cpu"\n', 'device = "cpu"\ndtype = "bfloat16"\n'))
    events = []
    cfg = load_config(work / "run.toml")
    train_grpo(cfg, log=lambda m: (events.append(str(m)), print(m, flush=True)))
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    # the objective recomputed from the logged completions: -sum A_i n_i / sum n_i (ratio 1, token mean)
    logged = [json.loads(x) for x in (work / "run" / "completions.jsonl").read_text().splitlines()]
    expected, trained = [], []
    for r in rows:
        step = [c for c in logged if c["step"] == r["step"]]
        expected.append(-sum(c["advantage"] * c["tokens"] for c in step) / sum(c["tokens"] for c in step))
        trained.append(round(len(step) * (1 - r["batch/zero_std_group_fraction"])))
    from retrograd.models.load import load_model
    n = matmul_params(load_model(args.gguf, log=lambda *_: None).model)
    return {"step_s": [r["system/step_seconds"] for r in rows], "sampling_s": [r["time/sampling_s"] for r in rows],
            "reward_s": [r["time/reward_s"] for r in rows], "training_s": [r["time/training_s"] for r in rows],
            "sampled_tokens": [r["completions/mean_length"] * PROMPTS * GENS for r in rows],
            "trained_tokens": [r["train/tokens"] for r in rows], "reward": [r["reward/match/mean"] for r in rows],
            "loss": [r["train/loss"] for r in rows], "expected_loss": expected, "trained_completions": trained,
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

    calls = []  # per update: (total reward, completion tokens) of each completion, in order

    def reward(completions, answer, completion_ids=None, **kw):
        out = []
        for c, a in zip(completions, answer):
            text = c[-1]["content"] if isinstance(c, list) else c
            nums = re.findall(r"-?\d+", text.replace(",", ""))
            out.append(1.0 if nums and int(nums[-1]) == int(a) else 0.0)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        calls.append([(r - 0.001 * max(0, len(t) - 1), len(ids)) for r, t, ids in zip(out, texts, completion_ids)])
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
    # every option that sets the objective, explicitly (TRL's defaults differ: scale_rewards="group",
    # epsilon_high = epsilon)
    cfg = GRPOConfig(output_dir=str(Path(args.work) / "trl_out"), max_steps=args.steps,
                     per_device_train_batch_size=PROMPTS * GENS, num_generations=GENS, gradient_accumulation_steps=1,
                     max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR,
                     loss_type="dapo", scale_rewards="none", beta=0.0, epsilon=0.2, epsilon_high=0.28,
                     num_iterations=1, importance_sampling_level="token", mask_truncated_completions=False,
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
    expected = []
    for call in calls:
        total = [t for t, _ in call]
        adv = [t - sum(total[g:g + GENS]) / GENS for g in range(0, len(total), GENS) for t in total[g:g + GENS]]
        expected.append(-sum(a * n for a, (_, n) in zip(adv, call)) / sum(n for _, n in call))
    return {"step_s": timer.step_s, "sampling_s": gen, "reward_s": rew,
            "training_s": [t - g - r for t, g, r in zip(timer.step_s, gen, rew)],
            "sampled_tokens": [x.get("completions/mean_length", 0) * PROMPTS * GENS for x in logs],
            "reward": [x.get("rewards/reward/mean", x.get("reward")) for x in logs],
            "loss": [x["loss"] for x in logs], "expected_loss": expected,
            "trained_completions": [len(c) for c in calls], "spans": {k: v for k, v in spans.items()}}


PAIRS = (("retrograd", "trl"), ("retrograd_bf16", "trl_bf16"))
WORKERS = {"prepare": worker_prepare, "retrograd": worker_retrograd, "retrograd_bf16": worker_retrograd,
           "trl": worker_trl, "trl_bf16": worker_trl, "trl_amp": worker_trl}
LOSS_TOLERANCE = 1e-4


def spawn(kind: str, tmp: Path, steps: int, data: Path, gguf: str = "") -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    out = bench_sft.spawn(kind, tmp, steps, data, gguf, script=__file__)
    out["load_average_before"] = load
    return out


def check_same_work(kind: str, r: dict, steps: int) -> None:
    """Fail loudly unless every update trained all completions on the stated objective."""
    if len(r["loss"]) != steps or len(r["expected_loss"]) != steps:
        raise SystemExit(f"bench_grpo: {kind} logged {len(r['loss'])} losses for {steps} updates")
    for step, (got, want) in enumerate(zip(r["loss"], r["expected_loss"]), 1):
        if abs(got - want) > LOSS_TOLERANCE * max(1.0, abs(want)):
            raise SystemExit(f"bench_grpo: {kind} update {step}: logged loss {got:.6f}, but its own completions give "
                             f"{want:.6f}: the two sides do not optimise the same objective")
    if any(n != PROMPTS * GENS for n in r["trained_completions"]):
        raise SystemExit(f"bench_grpo: {kind} did not train all {PROMPTS * GENS} completions of every update: "
                         f"{r['trained_completions']}")


def bf16_matmul_gflops() -> float:
    import torch
    torch.set_num_threads(THREADS)
    a, b = torch.randn(1024, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    n, t = 50, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 1024 * 576 * 1536 * n / (time.perf_counter() - t) / 1e9


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 6)))
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per precision, interleaved (>= 3)")
    p.add_argument("--out", help="results folder (default benchmarks/results)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for internal in ("--work", "--data", "--gguf", "--result"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        out = WORKERS[args.worker](args)
        out["worker_peak_rss_mb"] = self_peak_rss_mb()
        write_json(Path(args.result), out)
        return
    common.warn_if_busy()
    load = {"start": common.load_average()}
    peak_both = common.matmul_peak()
    peak, peak_bf16 = peak_both["fp32"], peak_both["bf16"]
    print(f"matmul peak ({THREADS} threads): fp32 {peak:.0f}, bf16 {peak_bf16:.0f} GFLOP/s", flush=True)
    # bf16 is timed only where the CPU computes it natively: elsewhere both sides would run ~100x slower
    # than fp32 (an avx2-only AMD EPYC: ~1 GFLOP/s bf16 matmul), which measures nothing of interest
    pairs = [pair for pair in PAIRS if "bf16" not in pair[0] or common.bf16_native()]
    skipped = [list(pair) for pair in PAIRS if pair not in pairs]
    if skipped:
        print(f"skipping {skipped}: this CPU has no native bf16 (avx512_bf16 / amx_bf16)", flush=True)
    runs: dict[str, list[dict]] = {k: [] for pair in pairs for k in pair}
    order = []
    with tempfile.TemporaryDirectory(prefix="bench_grpo-") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "prompts.jsonl"
        write_prompts(data)
        prep = spawn("prepare", tmp / "prepare", args.steps, data)

        def one(kind, i):
            r = spawn(kind, tmp / f"{kind}-{i}", args.steps, data, prep["gguf"])
            check_same_work(kind, r, args.steps)
            return r
        for pair in pairs:  # A B A B ...: drift of the machine hits both sides alike
            pair_runs, pair_order = common.run_interleaved(list(pair), args.repeats, one)
            runs.update(pair_runs)
            order += pair_order
    n_matmul = runs["retrograd"][0]["matmul_params"]
    summary = {}
    for kind, rs in runs.items():
        per_run = []
        for r in rs:
            k = slice(1, None)  # update 1 is warm-up

            def mean(key):
                return sum(r[key][k]) / len(r[key][k])
            tps = sum(r["sampled_tokens"][k]) / sum(r["sampling_s"][k])
            per_run.append({"s_per_update": mean("step_s"), "sampling_s": mean("sampling_s"), "reward_s": mean("reward_s"),
                            "training_s": mean("training_s"), "sampling_tokens_per_s": tps,
                            "sampling_share_of_matmul_peak": tps * 2 * n_matmul / 1e9 / (peak_bf16 if "bf16" in kind else peak),
                            "peak_rss_mb": max(r["process_peak_rss_mb"], r["worker_peak_rss_mb"])})
        summary[kind] = {key: common.stats([x[key] for x in per_run]) for key in per_run[0]}
        summary[kind]["mean_match_reward"] = statistics.mean(x for r in rs for x in r["reward"])
    print(f"\nGRPO LoRA r={LORA_R} q,k,v,o | SmolLM2-135M | {PROMPTS} prompts x {GENS} completions x <= {MAX_NEW} "
          f"tokens | {args.steps} updates (mean of 2+), median of {args.repeats} interleaved runs (min-max) | "
          f"{THREADS} threads | {cpu_model()} | matmul fp32 {peak:.0f}, bf16 {peak_bf16:.0f} GFLOP/s")
    ratios = {}
    for rg, trl in pairs:
        print(f"\n{rg} vs {trl}")
        for key in summary[rg]:
            if key == "mean_match_reward":
                continue
            a, b = summary[rg][key], summary[trl][key]
            lower_is_better = key in ("s_per_update", "sampling_s", "reward_s", "training_s", "peak_rss_mb")
            ratio = (b["median"] / a["median"] if lower_is_better else a["median"] / b["median"]) \
                if a["median"] and b["median"] else float("nan")
            ratios[f"{rg}/{key}"] = ratio
            print(f"  {key:<32} {a['median']:9.3f} ({a['min']:.3f}-{a['max']:.3f})   {b['median']:9.3f} "
                  f"({b['min']:.3f}-{b['max']:.3f})   {ratio:5.2f}x")
    print("\n(ratios: how many times faster / smaller retrograd is; the losses of every update matched their "
          f"objective within {LOSS_TOLERANCE} and both sides trained all {PROMPTS * GENS} completions)")
    checks = {"loss": f"every update's logged loss equals -sum_i A_i n_i / sum_i n_i from the side's own completions "
                      f"within {LOSS_TOLERANCE} x max(1, |loss|)",
              "trained_completions": {k: sorted({n for r in rs for n in r["trained_completions"]}) for k, rs in runs.items()}}
    name = common.write_result("grpo", {
        "machine": common.machine(peak_both), "load_average": {**load, "before_runs": order},
        "settings": {"prompts": PROMPTS, "completions_per_prompt": GENS, "max_new_tokens": MAX_NEW, "lr": LR,
                     "seed": SEED, "steps": args.steps, "repeats": args.repeats, "threads": THREADS,
                     "skipped_pairs": skipped,
                     "lora": dict(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, targets=LORA_TARGETS), "steady": "updates 2+"},
        "summary": summary, "ratios": ratios, "checks": checks, "raw": runs,
        "matmul_gflops": peak, "matmul_gflops_bf16": peak_bf16, "steps": args.steps, "repeats": args.repeats},
        Path(args.out) if args.out else None)
    print(f"wrote {name}")


if __name__ == "__main__":
    main()
