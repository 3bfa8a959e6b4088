"""Does distillation move a real student toward a real teacher? A by-hand experiment on SmolLM2-135M:

1. the teacher: examples/quickstart.toml's SFT fine-tune with its LoRA merged in (output.kind = model);
2. on-policy: examples/distill.toml distils it into the base (LoRA), evaluating the exact per-token
   KL(student || teacher) and top-1 agreement on the student's greedy answers to 24 held-out prompts;
3. offline top-k: `retrograd distill-teacher examples/distill-topk.toml --k 16`, then
   examples/distill-topk.toml (forward KL on the teacher's top-16 + tail), evaluated on the held-out
   rows' answers (bucket KL from the .topk file) and, afterwards, with `retrograd eval` (the exact
   full-vocabulary KL on those rows, base vs trained).

Every step is the real CLI, as a user runs it. Writes benchmarks/results/distill_smollm2_*.json.

    python benchmarks/distill_smollm2.py [--threads 2] [--keep DIR]
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

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"


def cli(*args, cwd=None) -> str:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "retrograd", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"retrograd {' '.join(map(str, args))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    print(f"  retrograd {args[0]} {Path(str(args[1])).name}: {time.time() - t0:.0f} s", flush=True)
    return proc.stdout


def sets(**kv) -> list[str]:
    out = []
    for k, v in kv.items():
        out += ["--set", f"{k.replace('__', '.')}={json.dumps(v)}"]
    return out


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "teacher_kl": r["eval/teacher_kl"], "top1_agreement": r["eval/top1_agreement"]}
            for r in rows if "eval/teacher_kl" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="distill-smollm2-"))
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    common = sets(training__threads=args.threads)
    teacher = work / "teacher"
    print("teacher: the quickstart's SFT, LoRA merged in", flush=True)
    if not (teacher / "config.json").exists():
        cli("train", EX / "quickstart.toml", *common,
            *sets(output__kind="model", output__path=str(teacher), run__directory=str(work / "runs" / "teacher"),
                  checkpoint__directory=str(work / "ckpt-teacher"), metrics__tensorboard_dir=str(work / "tb")))
    print("on-policy distillation", flush=True)
    on = work / "runs" / "on_policy"
    cli("train", EX / "distill.toml", *common,
        *sets(distill__teacher_path=str(teacher), run__directory=str(on), output__path=str(work / "on-policy-adapter"),
              checkpoint__directory=str(work / "ckpt-on-policy")))
    print("offline top-k distillation", flush=True)
    topk = work / "teacher.topk"
    cli("distill-teacher", EX / "distill-topk.toml", "--k", 16, "--model", teacher, "--out", topk)
    off = work / "runs" / "topk"
    offline_sets = sets(distill__teacher_path=str(teacher), distill__sidecar=str(topk), run__directory=str(off),
                        output__path=str(work / "topk-adapter"))
    cli("train", EX / "distill-topk.toml", *common, *offline_sets)
    full = json.loads(cli("eval", EX / "distill-topk.toml", *offline_sets, "--json"))
    result = {"on_policy": evals(on), "topk_offline": evals(off),
              "topk_offline_exact_kl": {k: v for k, v in full.items() if "/" in k},
              "minutes": (time.time() - t_all) / 60, "threads": args.threads,
              "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                           if line.startswith("model name")), "unknown")}
    for mode in ("on_policy", "topk_offline"):
        e = result[mode]
        print(f"{mode:13s} KL to teacher {e[0]['teacher_kl']:.3f} -> {e[-1]['teacher_kl']:.3f}, "
              f"top-1 agreement {e[0]['top1_agreement']:.3f} -> {e[-1]['top1_agreement']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = out / f"distill_smollm2_{time.strftime('%Y%m%d_%H%M%S')}.json"
    name.write_text(json.dumps(result, indent=1))
    print(f"wrote {name}")


if __name__ == "__main__":
    main()
