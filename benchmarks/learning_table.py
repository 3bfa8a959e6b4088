"""Held-out accuracy of GRPO-family credit assignment after the same budget: a small campaign of
examples/grpo.toml (SmolLM2-135M-Instruct, LoRA r=16, builtin:arithmetic, 40 updates of 4 prompts x
8 completions) under several advantage modes and token transforms, each with 2 seeds.

A by-hand experiment, not a test. Every run is the real CLI (`retrograd train examples/grpo.toml
--set ...`), so what it measures is what a user gets. The metric is the exact-answer rate of greedy
completions on all 64 held-out prompts (builtin:arithmetic-eval) at update 40, read from the run's
own evaluation (`eval/reward/match`); update 0 (the base model) is the same for every run.

    python benchmarks/learning_table.py [--seeds 42,43] [--conditions grpo,maxrl,...] [--out benchmarks/results]
                                        [--merge earlier.json]

The JSON is rewritten after every run (a crash keeps what finished); a run that fails is recorded
with its error and left out of the table; --merge adds the runs of an earlier partial file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "grpo.toml"
# SEPA's defaults ramp over 500 updates after 50; for a 40-update budget the ramp starts at 10 and ends at 30
SEPA_SHORT = ["grpo.sepa.delay_steps=10", "grpo.sepa.steps=20"]
CONDITIONS = {
    "grpo": [],
    "rloo": ["grpo.advantage_mode=rloo"],
    "maxrl": ["grpo.advantage_mode=maxrl"],
    "reinforce_pp": ["grpo.advantage_mode=reinforce_pp", "grpo.batch_advantage_norm=true"],
    "maxrl_gtpo_sepa": ["grpo.algorithm_mode=maxrl_gtpo_sepa", *SEPA_SHORT],
    "delight": ["grpo.transform_mode=delight"],
}


def run_one(condition: str, seed: int, work: Path, threads: int) -> dict:
    folder = work / f"{condition}_s{seed}"
    overrides = CONDITIONS[condition] + [
        f"training.seed={seed}", f"grpo.sampling.seed={seed}", f"training.threads={threads}",
        f"run.directory={json.dumps(str(folder / 'run'))}", f"output.path={json.dumps(str(folder / 'adapter'))}",
        f"checkpoint.directory={json.dumps(str(folder / 'ckpt'))}", "checkpoint.mode=\"steps\"",
        "checkpoint.every_steps=40", "evaluation.every_steps=40", "evaluation.max_examples=64",
        "grpo.log_completions_every=0"]
    cmd = [sys.executable, "-m", "retrograd", "train", str(EXAMPLE)]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{condition} seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean_reward" in r]
    train = [r for r in rows if "reward/mean" in r]
    return {"condition": condition, "seed": seed, "seconds": time.time() - t0,
            "base_accuracy": evals[0]["eval/reward/match"], "accuracy": evals[-1]["eval/reward/match"],
            "eval_step": evals[-1]["step"], "eval_mean_reward": evals[-1]["eval/mean_reward"],
            "train_reward_last10": statistics.mean(r["reward/match/mean"] for r in train[-10:]),
            "updates": len(train), "overrides": CONDITIONS[condition]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,43")
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--merge", action="append", default=[], help="an earlier JSON whose runs to include")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    conditions = args.conditions.split(",")
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        raise SystemExit(f"unknown conditions {unknown}; known: {', '.join(CONDITIONS)}")
    results = [r for f in args.merge for r in json.loads(Path(f).read_text())["runs"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = out / f"learning_table_{time.strftime('%Y%m%d_%H%M%S')}.json"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    with tempfile.TemporaryDirectory(prefix="learning-table-") as tmp:
        for seed in seeds:  # seed-major: a partial table still has every condition once
            for c in conditions:
                try:
                    r = run_one(c, seed, Path(tmp), args.threads)
                    print(f"{c:<18s} seed {seed}: held-out exact {r['base_accuracy']:.3f} -> {r['accuracy']:.3f} "
                          f"({r['seconds'] / 60:.1f} min)", flush=True)
                except Exception as e:  # recorded, not fatal: the other runs still count
                    r = {"condition": c, "seed": seed, "error": str(e)[-2000:]}
                    print(f"{c:<18s} seed {seed}: FAILED {str(e)[-300:]}", flush=True)
                results.append(r)
                write(name, results, seeds, cpu, args.threads)
    table = write(name, results, seeds, cpu, args.threads)
    print("\n| condition | held-out exact answers at update 40 (mean of seeds) | per seed |\n|---|---|---|")
    for row in table:
        print(f"| {row['condition']} | {row['mean']:.3f} | {', '.join(f'{a:.3f}' for a in row['runs'])} |")
    print(f"wrote {name}")


def write(name: Path, results: list, seeds: list, cpu: str, threads: int) -> list:
    table = []
    for c in dict.fromkeys(r["condition"] for r in results):
        acc = [r["accuracy"] for r in results if r["condition"] == c and "accuracy" in r]
        if acc:
            table.append({"condition": c, "mean": statistics.mean(acc), "runs": acc,
                          "spread": (max(acc) - min(acc)) if len(acc) > 1 else 0.0})
    name.write_text(json.dumps({"table": table, "runs": results, "seeds": seeds, "cpu": cpu, "threads": threads,
                                "example": str(EXAMPLE.relative_to(ROOT))}, indent=1))
    return table


if __name__ == "__main__":
    main()
