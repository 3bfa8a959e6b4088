"""How many graphs a `[training] compile` run of varied lengths compiles, and what that costs it: the code
before 2026-12-08 (a static graph for the first shape, then dynamo's own choice of which sizes turn
symbolic, and the grid's fullness a guard) against now (the first shape static, then one graph with the
rows, width and real-token count symbolic that serves every later shape; models/packed.py:
compile_training_passes).

  run       `retrograd train` (a subprocess, the CLI as a user runs it) with `[training] compile = true`,
            --steps steps, no evaluation or checkpoints. --algorithm sft: examples/quickstart.toml's model,
            data and settings; grpo: bench_grpo.py's run (SmolLM2, 4 prompts x 4 completions of at most
            32 tokens an update), whose passes vary in rows, width and real tokens from update to update
            (--smoke: a tiny random Llama with SmolLM2's tokenizer)
  sides     "before": the source tree of git revision --before (a worktree; the run imports retrograd
            from it through PYTHONPATH); "after": this checkout
  cold      every run gets a new, empty inductor cache folder, as a first compiled run on a machine does;
            then one warm run per side on the cache its cold runs filled (--warm 0: none)
  order     before, after, before, after, ... (--repeats each), summarised as median and min-max
  graphs    counted from dynamo's recompile log (TORCH_LOGS=recompiles): 1 + the recompiles of _layers
  check     sft: every run's logged losses equal the first run's within 1e-5 relative (full rows take
            the padding path in the symbolic graph now: the same values, summed in another order);
            grpo: the first update's loss (later updates sample from weights that differ in rounding,
            so their completions may differ); else the script stops

    python benchmarks/ab_compile_graphs.py [--algorithm sft|grpo] [--before REV] [--repeats 2] [--warm 1]
                                           [--steps 6] [--out benchmarks/results]
    python benchmarks/ab_compile_graphs.py --smoke        # tiny random Llama, $TMPDIR/bench_out

Writes OUT/ab_compile_graphs_<timestamp>.json: each run's wall seconds, graphs, step seconds and losses,
the summaries, and the ratio before / after of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import bench_grpo  # noqa: E402
from ab_compile_cache import STEPS as CACHE_STEPS, run_toml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOSS_TOL = 1e-5
SIDES = ("before", "after")
RECOMPILE = re.compile(r"Recompiling function _layers\b")
STEADY_FROM = 2  # "later steps": the median of steps 3+, after the compiles of both sides (--steps >= 3)


def train_once(work: Path, src: Path, cache: Path, side: str, steps: int) -> dict:
    """One `retrograd train` in a fresh folder with `src` first on the import path: wall seconds, graphs
    compiled, each step's seconds and loss."""
    folder = work / f"{side}_{time.time_ns()}"
    folder.mkdir()
    (folder / "run.toml").write_text(work.joinpath("run.toml").read_text())
    env = {**os.environ, **common.CHILD_ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCH_LOGS": "recompiles",
           "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    load = common.load_average()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", "run.toml"], cwd=folder, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"ab_compile_graphs: the {side} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (folder / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/loss" in r]
    if len(logged) != steps:
        raise common.CheckFailed(f"ab_compile_graphs: the {side} run logged {len(logged)} steps, not {steps}")
    graphs = 1 + len(RECOMPILE.findall(proc.stderr))
    # why each graph after the first was compiled: dynamo's guard failures, one line each
    reasons = [line.split("[__recompiles]", 1)[1].strip() for line in proc.stderr.splitlines()
               if "[__recompiles]" in line and line.split("[__recompiles]", 1)[1].strip().startswith("- ")]
    step_s = [r["system/step_seconds"] for r in logged]
    print(f"{side} ({cache.name}): {wall:.1f} s, {graphs} graphs, steps {' '.join(f'{s:.1f}' for s in step_s)}, "
          f"load {load[0]:.2f}", flush=True)
    # GRPO's steps split into sampling (eager, the same code on both sides) and training (the compiled passes)
    split = {key.split("/")[1]: [r[key] for r in logged] for key in ("time/sampling_s", "time/training_s")
             if all(key in r for r in logged)}
    return {"wall_s": wall, "graphs": graphs, "recompile_reasons": reasons, "step_s": step_s, **split, "losses": [r["train/loss"] for r in logged],
            "load_average_before": load}


def worktree(rev: str, into: Path) -> Path:
    """The source folder of git revision `rev`, checked out under `into`."""
    path = into / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path / "src"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="8164c70", help="git revision of the 'before' side (default: the last "
                   "commit before this change)")
    p.add_argument("--repeats", type=int, default=2, help="cold runs per side")
    p.add_argument("--warm", type=int, default=1, help="warm runs per side, after the cold ones")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (grpo: updates) a run")
    p.add_argument("--algorithm", choices=("sft", "grpo"), default="sft")
    common.add_output_arguments(p)
    args = p.parse_args()
    common.warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="ab_compile_graphs_") as tmp:
        work = Path(tmp)
        sources = {"before": worktree(args.before, work), "after": ROOT / "src"}
        try:
            model = "smollm2-135m-instruct"
            if args.smoke:
                from retrograd.models.builtin import builtin_gguf
                model = str(work / "tiny")
                common.tiny_llama(Path(model), common.tokenizer_folder(builtin_gguf("smollm2-135m-instruct")))
            if args.algorithm == "grpo":
                bench_grpo.write_prompts(work / "prompts.jsonl")
                text = bench_grpo.run_toml(model, work / "prompts.jsonl", args.steps, "runs/run", "out/adapter")
                text = text.replace("[training]\n", "[training]\ncompile = true\n")
            else:
                text = run_toml(model).replace(f"max_steps = {CACHE_STEPS}", f"max_steps = {args.steps}")
            work.joinpath("run.toml").write_text(text)
            checked = args.steps if args.algorithm == "sft" else 1
            reference: list[float] = []
            caches = {side: [] for side in SIDES}

            def cold(side, i):
                cache = work / f"inductor_{side}_{i}"
                caches[side].append(cache)
                return train_once(work, sources[side], cache, side, args.steps)

            def same_work(runs):
                for side, results in runs.items():
                    for r in results:
                        if not reference:
                            reference.extend(r["losses"])
                        bad = common.loss_mismatch(r["losses"][:checked], reference[:checked], LOSS_TOL)
                        if bad:
                            raise common.CheckFailed(f"ab_compile_graphs: {side} step {bad[0] + 1} loss {bad[1]} "
                                                     f"against {bad[2]}: the sides did not do the same work")
            runs, loads = common.run_interleaved(list(SIDES), args.repeats, cold, same_work)
            warm, warm_loads = common.run_interleaved(
                list(SIDES), args.warm, lambda side, i: train_once(work, sources[side], caches[side][-1], side,
                                                                   args.steps), same_work)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "before")],
                           capture_output=True)
    metrics = {"wall_s": lambda r: r["wall_s"], "graphs": lambda r: r["graphs"],
               "first_step_s": lambda r: r["step_s"][0], "last_step_s": lambda r: r["step_s"][-1],
               "later_steps_s": lambda r: statistics.median(r["step_s"][STEADY_FROM:])}
    if all("training_s" in r for rs in runs.values() for r in rs):
        metrics["later_training_s"] = lambda r: statistics.median(r["training_s"][STEADY_FROM:])
    summary = {side: common.summarize(rs, metrics) for side, rs in runs.items()}
    result = {"algorithm": args.algorithm, "before": args.before, "steps": args.steps, "losses_checked": checked, "repeats": args.repeats, "loss_tolerance": LOSS_TOL,
              "runs": runs, "warm_runs": warm, "summary": summary,
              "warm_summary": {side: common.summarize(rs, metrics) for side, rs in warm.items() if rs},
              "before_over_after": common.ratios(summary, "before", "after"),
              "load_average": {"runs": loads, "warm_runs": warm_loads}}
    if args.warm:
        result["warm_before_over_after"] = common.ratios(result["warm_summary"], "before", "after")
    path = common.write_result("ab_compile_graphs", result, common.out_dir(args), args.smoke)
    for label, summ in (("cold", summary), ("warm", result["warm_summary"])):
        for side, s in summ.items():
            print(f"{label} {side}: wall {s['wall_s']['median']:.1f} s ({s['wall_s']['min']:.1f}-"
                  f"{s['wall_s']['max']:.1f}), graphs {s['graphs']['median']:g}, first step "
                  f"{s['first_step_s']['median']:.1f} s, steps 3+ {s['later_steps_s']['median']:.2f} s"
                  + (f" (training {s['later_training_s']['median']:.2f} s)" if "later_training_s" in s else ""))
    print(f"before / after (cold): {result['before_over_after']}\nwrote {path}")


if __name__ == "__main__":
    main()
