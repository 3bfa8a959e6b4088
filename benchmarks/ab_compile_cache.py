"""How long a `[training] compile` run takes to start when inductor's on-disk cache is warm: AOTAutograd's
cache bypassed (torch's default for graphs with custom autograd Functions, and retrograd's before
2026-12-07) against used (models/packed.py: _cache_our_autograd_functions).

Every compiled run compiles again in its new process, `--resume` included; inductor keeps the kernels it
generated on disk, but AOTAutograd's cache, which keeps the traced and partitioned forward + backward
graphs, skips any graph holding a custom autograd Function, and retrograd's LoRA node and SiLU product
are two. This A/B measures what using that cache saves, as a user meets it:

  run       `retrograd train` (a subprocess, the CLI as a user runs it) on examples/quickstart.toml's model,
            data and settings, with `[training] compile = true`, 3 steps, no evaluation or checkpoints
            (--smoke: a tiny random Llama with SmolLM2's tokenizer)
  sides     "bypass": TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0 (torch then bypasses the
            cache whatever retrograd asks); "cached": retrograd as shipped
  order     one inductor cache folder for the whole script, new and empty at the start; warm-up: bypass
            (a cold compile: it fills inductor's kernel cache) then cached (it fills AOTAutograd's);
            then bypass, cached, ... (--repeats each), summarised as median and min-max
  check     every run's logged losses equal the first run's within 1e-6 relative (the same compiled
            work; they were bit-equal), or the script stops

    python benchmarks/ab_compile_cache.py [--repeats 3] [--out benchmarks/results]
    python benchmarks/ab_compile_cache.py --smoke        # tiny random Llama, $TMPDIR/bench_out

Writes OUT/ab_compile_cache_<timestamp>.json: each run's wall seconds, its first step's seconds (the step
that compiles) and losses, the summaries, and the ratio bypass / cached of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
LOSS_TOL = 1e-6
SIDES = {"bypass": {"TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD": "0"}, "cached": {}}


def run_toml(model: str) -> str:
    """examples/quickstart.toml with compile on, STEPS steps, and no evaluation, checkpoints or TensorBoard."""
    keep, skip = [], False
    for line in (ROOT / "examples" / "quickstart.toml").read_text().splitlines():
        if line.startswith("["):
            skip = line.strip() in ("[evaluation]", "[checkpoint]", "[metrics]")
        if not skip and not line.startswith("#"):
            keep.append(line)
    text = "\n".join(keep).replace('path = "smollm2-135m-instruct"', f'path = "{model}"')
    text = text.replace("max_steps = 40", f"max_steps = {STEPS}")
    return text.replace("[training]\n", f"[training]\ncompile = true\nthreads = {common.THREADS}\n")


def train_once(work: Path, cache: Path, side: str) -> dict:
    """One `retrograd train` in a fresh folder: wall seconds, first step's seconds, the logged losses."""
    folder = work / f"{side}_{time.time_ns()}"
    folder.mkdir()
    (folder / "run.toml").write_text(work.joinpath("run.toml").read_text())
    env = {**os.environ, **common.CHILD_ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache), **SIDES[side]}
    if side != "bypass":
        env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", None)
    load = common.load_average()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", "run.toml"], cwd=folder, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"ab_compile_cache: the {side} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (folder / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    if len(steps) != STEPS:
        raise common.CheckFailed(f"ab_compile_cache: the {side} run logged {len(steps)} steps, not {STEPS}")
    print(f"{side}: {wall:.1f} s (first step {steps[0]['system/step_seconds']:.1f} s), load {load[0]:.2f}",
          flush=True)
    return {"wall_s": wall, "first_step_s": steps[0]["system/step_seconds"],
            "losses": [r["train/loss"] for r in steps], "load_average_before": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side after the warm-up pair")
    common.add_output_arguments(p)
    args = p.parse_args()
    common.warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="ab_compile_cache_") as tmp:
        work, cache = Path(tmp), Path(tmp) / "inductor"
        model = "smollm2-135m-instruct"
        if args.smoke:
            from retrograd.models.builtin import builtin_gguf
            model = str(work / "tiny")
            common.tiny_llama(Path(model), common.tokenizer_folder(builtin_gguf("smollm2-135m-instruct")))
        work.joinpath("run.toml").write_text(run_toml(model))
        warmup = {side: train_once(work, cache, side) for side in SIDES}
        reference = warmup["bypass"]["losses"]

        def same_work(runs):
            for side, results in runs.items():
                for r in results:
                    bad = common.loss_mismatch(r["losses"], reference, LOSS_TOL)
                    if bad:
                        raise common.CheckFailed(f"ab_compile_cache: {side} step {bad[0] + 1} loss {bad[1]} "
                                                 f"against {bad[2]}: the sides did not do the same work")
        same_work({side: [r] for side, r in warmup.items()})
        runs, loads = common.run_interleaved(list(SIDES), args.repeats,
                                             lambda side, i: train_once(work, cache, side), same_work)
    summary = {side: common.summarize(rs, {"wall_s": lambda r: r["wall_s"],
                                           "first_step_s": lambda r: r["first_step_s"]})
               for side, rs in runs.items()}
    result = {"steps": STEPS, "repeats": args.repeats, "loss_tolerance": LOSS_TOL, "warmup": warmup, "runs": runs,
              "summary": summary, "bypass_over_cached": common.ratios(summary, "bypass", "cached"),
              "load_average": {"runs": loads}}
    path = common.write_result("ab_compile_cache", result, common.out_dir(args), args.smoke)
    for side, s in summary.items():
        print(f"{side}: wall {s['wall_s']['median']:.1f} s ({s['wall_s']['min']:.1f}-{s['wall_s']['max']:.1f}), "
              f"first step {s['first_step_s']['median']:.1f} s")
    print(f"bypass / cached: {result['bypass_over_cached']}\nwrote {path}")


if __name__ == "__main__":
    main()
