"""DPO LoRA training throughput and peak memory: retrograd vs TRL's DPOTrainer, side by side.

A by-hand benchmark, not a test. Same model, data and settings on both sides:

  model       SmolLM2-135M-Instruct, retrograd's built-in GGUF (Q4_1, de-quantized to fp32)
  LoRA        r=8, alpha=16, dropout 0, targets q_proj, k_proj, v_proj, o_proj
  loss        DPO (TRL loss_type "sigmoid"), beta 0.1; the reference is the model with the adapter
              disabled (TRL's PEFT path, no precompute; retrograd's `reference = "initial"`, which
              for a fresh adapter is the same model)
  batch       2 pairs per optimizer step, no accumulation; synthetic arithmetic pairs (a worked
              answer vs the same with a wrong sum), ~115 tokens per sequence, max length 256
  optimizer   AdamW, lr 5e-5 constant, grad-norm clip 1.0; fp32, no gradient checkpointing,
              2 threads, seed 0, pairs in file order

Two throughput figures, pairs per second:
  steady      steps 2+ only (TRL runs the reference forward inside every step; retrograd has
              scored it once before step 1)
  end to end  every step plus, for retrograd, the one-off reference scoring of all the run's pairs
              (the fair total: TRL's reference work is inside its steps)

Each framework runs in its own subprocess (peak RSS is its own). Run on an idle machine:

    pip install -e '.[bench]'
    python benchmarks/bench_dpo.py [--steps 10] [--out bench_out]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft  # noqa: E402
from bench_sft import (LORA_ALPHA, LORA_R, LORA_TARGETS, THREADS, cpu_model,  # noqa: E402
                       load_trl_model, self_peak_rss_mb, versions, worker_prepare, write_json)

PAIRS_PER_STEP, MAX_LEN, LR, BETA, SEED = 2, 256, 5e-5, 0.1, 0


def make_pair(rng: random.Random) -> dict:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    bad = a + b + rng.choice([-100, -10, -1, 1, 10, 100])
    work = (f"Line the numbers up by place value and add column by column from the right, carrying "
            f"a ten into the next column whenever a column sum passes nine. As a check, {a + b} minus {b} "
            f"should give back {a}.")
    return {"prompt": [{"role": "user", "content": f"Add {a} and {b}. Show the method briefly, then state the sum."}],
            "chosen": [{"role": "assistant", "content": f"{work} The sum of {a} and {b} is {a + b}."}],
            "rejected": [{"role": "assistant", "content": f"{work} The sum of {a} and {b} is {bad}."}]}


def write_data(path: Path, n: int) -> None:
    rng = random.Random(SEED)
    path.write_text("".join(json.dumps(make_pair(rng)) + "\n" for _ in range(n)), encoding="utf-8")


def worker_retrograd(args) -> dict:
    from retrograd.config import load_config
    from retrograd.train.preference import train_preference
    work = Path(args.work)
    (work / "run.toml").write_text(f"""
[run]
algorithm = "preference"
name = "bench_dpo"
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
seed = {SEED}
[training]
lr = {LR}
max_grad_norm = 1.0
max_steps = {args.steps}
ctx = {MAX_LEN}
seed = {SEED}
threads = {THREADS}
[preference]
data = {json.dumps(args.data)}
loss = "dpo"
beta = {BETA}
pairs_per_step = {PAIRS_PER_STEP}
shuffle = false
""")
    events, t0 = [], time.perf_counter()

    def log(msg):
        events.append({"t": time.perf_counter() - t0, "msg": str(msg)[:100], "rss": self_peak_rss_mb()})
        print(msg, flush=True)

    train_preference(load_config(work / "run.toml"), log=log)
    t_score = next(e["t"] for e in events if e["msg"].startswith("scoring the reference"))
    t_train = next(e["t"] for e in events if e["msg"].startswith("training "))
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "preference/loss" in r]
    return {"step_s": [r["system/step_seconds"] for r in rows], "loss": [r["preference/loss"] for r in rows],
            "reward_accuracy": [r["preference/accuracy"] for r in rows], "reference_scoring_s": t_train - t_score,
            "peak_rss_after_load_mb": next(e["rss"] for e in events if e["msg"].startswith("model "))}


def worker_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback, set_seed
    from trl import DPOConfig, DPOTrainer
    torch.set_num_threads(THREADS)
    set_seed(SEED)
    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    model, tok = load_trl_model(args.gguf)
    after_load = self_peak_rss_mb()

    class StepTimer(TrainerCallback):
        step_s: list = []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_s.append(time.perf_counter() - self._t)

    timer = StepTimer()
    cfg = DPOConfig(output_dir=str(Path(args.work) / "trl_out"), max_steps=args.steps,
                    per_device_train_batch_size=PAIRS_PER_STEP, gradient_accumulation_steps=1, max_length=MAX_LEN,
                    learning_rate=LR, beta=BETA, loss_type=["sigmoid"], bf16=False, fp16=False,
                    gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
                    use_cpu=True, dataloader_num_workers=0, seed=SEED, lr_scheduler_type="constant",
                    max_grad_norm=1.0, disable_tqdm=True, train_sampling_strategy="sequential")
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         peft_config=lora, callbacks=[timer])
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    return {"step_s": timer.step_s, "loss": [x["loss"] for x in logs],
            "reward_accuracy": [x.get("rewards/accuracies") for x in logs], "reference_scoring_s": 0.0,
            "peak_rss_after_load_mb": after_load}


WORKERS = {"prepare": worker_prepare, "retrograd": worker_retrograd, "trl": worker_trl}


def spawn(kind: str, tmp: Path, steps: int, data: Path, gguf: str = "") -> dict:
    return bench_sft.spawn(kind, tmp, steps, data, gguf, script=__file__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 10)))
    p.add_argument("--out", default="bench_out")
    p.add_argument("--epochs", type=int, default=1,
                   help="passes over the pairs within --steps (the data is steps x 2 / epochs pairs); with 2+ the "
                        "one-off reference scoring is shared by every epoch")
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
    pairs = args.steps * PAIRS_PER_STEP
    if args.worker is None and pairs % args.epochs:
        p.error("--steps x 2 must be divisible by --epochs")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_dpo-") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "pairs.jsonl"
        write_data(data, pairs // args.epochs)
        prep = spawn("prepare", tmp, args.steps, data)
        for kind in ("retrograd", "trl"):
            results[kind] = spawn(kind, tmp, args.steps, data, prep["gguf"])
    summary = {}
    for kind, r in results.items():
        s = r["step_s"]
        summary[kind] = {
            "pairs_per_s_steps2plus": PAIRS_PER_STEP * (len(s) - 1) / sum(s[1:]),
            "pairs_per_s_end_to_end": pairs / (sum(s) + r["reference_scoring_s"]),  # pairs trained, all epochs
            "reference_scoring_s": r["reference_scoring_s"], "mean_step_s": sum(s[1:]) / (len(s) - 1),
            "peak_rss_mb": max(r["process_peak_rss_mb"], r["worker_peak_rss_mb"]),
            "peak_rss_after_load_mb": r["peak_rss_after_load_mb"],
            "first_loss": r["loss"][0], "last_loss": r["loss"][-1]}
    rg, trl = summary["retrograd"], summary["trl"]
    print(f"\nDPO LoRA r={LORA_R} q,k,v,o | SmolLM2-135M fp32 | {PAIRS_PER_STEP} pairs/step | {args.steps} steps | "
          f"{args.epochs} epoch(s) | {THREADS} threads")
    fmt = "{:<26} {:>10} {:>10} {:>10}"
    print(fmt.format("", "retrograd", "TRL", "ratio"))
    for key in ("pairs_per_s_steps2plus", "pairs_per_s_end_to_end", "mean_step_s", "reference_scoring_s",
                "peak_rss_mb", "peak_rss_after_load_mb", "first_loss", "last_loss"):
        ratio = f"{rg[key] / trl[key]:.2f}x" if trl[key] and "loss" not in key else ""
        print(fmt.format(key, f"{rg[key]:.3f}", f"{trl[key]:.3f}", ratio))
    write_json(out_dir / "result_dpo.json", {"summary": summary, "raw": results, "versions": versions(),
                                             "cpu": cpu_model(), "loadavg_end": os.getloadavg()})
    print(f"wrote {out_dir / 'result_dpo.json'}")


if __name__ == "__main__":
    main()
