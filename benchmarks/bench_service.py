"""Overhead of the service path: the same SFT work through `retrograd train` and through the
unmodified tinker SDK against `retrograd serve`, side by side, in passes of the same size.

A by-hand benchmark, not a test. Same model, data, rows, LoRA and optimizer as bench_sft.py
(SmolLM2-135M built-in, LoRA r=8 alpha=16 on q/k/v/o, 4 rows x 256 tokens per step, loss on every
token, AdamW lr 2e-4, clip 1.0, 2 torch threads, rows in file order). Both sides start from the
same LoRA initialisation (seed 0; the server runs with --lora-alpha 16).

  retrograd  bench_sft.py's retrograd worker; step time from metrics.jsonl (system/step_seconds)
  service    `retrograd serve --threads 2` in its own process; a client process renders the same
             rows and times each step from submitting forward_backward + optim_step to having both
             results (wire encoding, HTTP, the long-poll and the server's queue are inside the time)

Same pass size on both paths, so the difference is the service's overhead and nothing else: by
default `retrograd train` on CPU runs a step in passes of training.micro_batch = 512 tokens, while
the server computes a request's datums in passes of up to retrograd.service.engine.PASS_TOKENS =
4096. Here both are set to --pass-tokens (default 1024: the 4 x 256 rows in one pass): micro_batch
in the run's TOML, and `retrograd serve --pass-tokens` in the server process. The client checks that both paths cut every step into the same passes (rows per pass).

Fairness (benchmarks/common.py): the two sides interleaved (--repeats each, default 3) with the
load average before each run, median and min-max of each run's steady tokens/s (steps 2+). Every
step's loss of every run must equal `retrograd train`'s first run within LOSS_TOL (the same code
computes both), or the script stops.

    pip install -e '.[service,bench]'
    python benchmarks/bench_service.py [--steps 12] [--repeats 3] [--pass-tokens 1024] [--out benchmarks/results]
    python benchmarks/bench_service.py --smoke      # tiny random Llama, ~1 minute, $TMPDIR/bench_out

Writes OUT/service_<timestamp>.json (service_smoke_... with --smoke) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft  # noqa: E402
import common  # noqa: E402
from bench_sft import BATCH, LORA_ALPHA, LORA_R, LR, SEED, SEQ, add_common_args, run_worker, worker_entry  # noqa: E402
from common import CHILD_ENV, THREADS, write_json  # noqa: E402

PASS_TOKENS = 1024
SMOKE = {"seq": 64, "steps": 4, "repeats": 2, "lr": 1e-2}
# The same code computes both sides' losses (the server's Scorer and datum loss vs train's SFT
# step); they agreed to 5e-7 even with different pass sizes, and in equal passes they should agree
# to float rounding. 1e-5 relative would still catch a different row, mask, weight or lr.
LOSS_TOL = 1e-5
REPEAT_TOL = 1e-6
SIDES = ("retrograd", "service")
def start_server(s: dict, work: Path):
    cmd = [sys.executable, "-m", "retrograd", "serve", "--pass-tokens", str(s["micro_batch"]), "--port", "0",
           "--state-dir", str(work / "state"), "--models", s["model"], "--threads", str(THREADS),
           "--lora-alpha", str(LORA_ALPHA)]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **CHILD_ENV})
    url, pass_line = None, None
    for line in server.stderr:
        print(line, end="", flush=True)
        pass_line = pass_line or re.search(r"passes of at most (\d+) tokens", line)
        m = re.search(r"retrograd serve: (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None or pass_line is None or int(pass_line.group(1)) != s["micro_batch"]:
        server.kill()
        raise RuntimeError("retrograd serve did not start with the benchmark's pass size")
    # keep reading its log, or a full pipe would block the server mid-benchmark
    threading.Thread(target=lambda: [print(line, end="", flush=True) for line in server.stderr], daemon=True).start()
    return server, url


def worker_service(s: dict, work: Path) -> dict:
    """Client side: start the server, train through the SDK, report per-step times, losses and passes."""
    import tinker
    from tinker import types

    from retrograd.data.sft import IGNORE, Renderer, load_examples, split_by_tokens
    from retrograd.service.engine import _chunks
    server, url = start_server(s, work)
    try:
        # the server made a key for the user who started it (STATE_DIR/api-key), as a user's client reads it
        sc = tinker.ServiceClient(base_url=url, api_key=(work / "state" / "api-key").read_text().strip())
        tc = sc.create_lora_training_client(base_model=s["model"], rank=LORA_R, seed=SEED,
                                            train_mlp=False, train_unembed=False).result()
        examples = load_examples(s["data"], "auto", Renderer(tc.get_tokenizer(), s["seq"], assistant_only=False))
        step_s, losses, tokens, passes = [], [], [], []
        for step in range(s["steps"]):
            batch = examples[step * BATCH:(step + 1) * BATCH]
            # rows per pass: `retrograd train` (micro_batch over whole rows) vs the server (datum inputs)
            passes.append({"train": [len(p) for p in split_by_tokens(batch, s["micro_batch"])],
                           "server": [len(c) for c in _chunks([(e.input_ids[:-1], None) for e in batch],
                                                              s["micro_batch"])]})
            n = sum(e.n_targets for e in batch)
            data = [types.Datum(model_input=types.ModelInput.from_ints(e.input_ids[:-1]),
                                loss_fn_inputs={"target_tokens": e.input_ids[1:],
                                                "weights": [(1.0 / n if lab != IGNORE else 0.0) for lab in e.labels[1:]]})
                    for e in batch]
            t = time.perf_counter()
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=s["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                                                 grad_clip_norm=1.0))
            loss = fb.result().metrics["loss:sum"]
            opt.result()
            step_s.append(time.perf_counter() - t)
            losses.append(loss)
            tokens.append(sum(len(e.input_ids) for e in batch))
            print(f"service step {step + 1}: {step_s[-1]:.2f} s  loss {loss:.4f}", flush=True)
        status = Path(f"/proc/{server.pid}/status").read_text()
        hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
    finally:
        server.terminate()
        server.wait(60)
    return {"step_s": step_s, "step_tokens": tokens, "loss": losses, "server_peak_rss_mb": hwm, "passes": passes}


WORKERS = {"prepare": bench_sft.prepare, "retrograd": bench_sft.worker_retrograd, "service": worker_service}


def check_runs(runs: dict) -> dict:
    for r in runs["service"]:
        for k, p in enumerate(r["passes"]):
            if p["train"] != p["server"]:
                raise common.CheckFailed(f"bench_service: step {k + 1} runs in passes of {p['train']} rows in "
                                         f"`retrograd train` but {p['server']} in the server")
    return common.check_losses("bench_service", {k: [r["loss"] for r in v] for k, v in runs.items() if v},
                               "retrograd", LOSS_TOL, REPEAT_TOL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pass-tokens", type=int, default=PASS_TOKENS,
                    help=f"tokens per forward/backward pass on both paths (default {PASS_TOKENS})")
    add_common_args(ap, 12, WORKERS)
    args = ap.parse_args()
    if args.worker:
        worker_entry(args, WORKERS)
        return
    steps = args.steps or (SMOKE["steps"] if args.smoke else 12)
    repeats = args.repeats or (SMOKE["repeats"] if args.smoke else 3)
    if steps < 2:
        ap.error("--steps must be at least 2 (step 1 is warm-up)")
    common.warn_if_busy()
    load = {"start": common.load_average()}
    peak = common.matmul_peak()
    with tempfile.TemporaryDirectory(prefix="bench_service-") as tmp_name:
        tmp = Path(tmp_name)
        s = {"mode": "lora", "smoke": args.smoke, "steps": steps, "batch": BATCH,
             "seq": SMOKE["seq"] if args.smoke else SEQ, "micro_batch": args.pass_tokens,
             "lr": SMOKE["lr"] if args.smoke else LR, "data": str(tmp / "data.jsonl")}
        bench_sft.write_data(Path(s["data"]), steps * BATCH)
        settings = tmp / "settings.json"
        write_json(settings, s)
        prep = run_worker(__file__, "prepare", tmp / "prepare", settings, "prepare")
        s["model"] = prep["model"]
        write_json(settings, s)
        checks = {}

        def one(kind, i):
            r = run_worker(__file__, kind, tmp / f"{kind}-{i + 1}", settings, f"{kind} run {i + 1}")
            if len(r["step_s"]) != steps or any(n != BATCH * s["seq"] for n in r["step_tokens"]):
                raise common.CheckFailed(f"bench_service: {kind} did not train {steps} steps of {BATCH}x{s['seq']} "
                                         f"tokens: {r['step_tokens']}")
            return r
        runs, order = common.run_interleaved(list(SIDES), repeats, one, lambda rs: checks.update(check_runs(rs)))
    steady = common.steady
    metrics = {"tokens_per_s": lambda r: sum(steady(r["step_tokens"])) / sum(steady(r["step_s"])),
               "step_s": lambda r: sum(steady(r["step_s"])) / len(steady(r["step_s"])),
               "peak_rss_mb": lambda r: r.get("server_peak_rss_mb") or r["process_peak_rss_mb"]}
    summary = {k: common.summarize(v, metrics) for k, v in runs.items()}
    first = runs["retrograd"][0]["loss"]
    result = {
        "machine": common.machine(peak), "load_average": {**load, "before_runs": order},
        "settings": {"steps": steps, "repeats": repeats, "batch": BATCH, "seq": s["seq"], "lr": s["lr"],
                     "pass_tokens": args.pass_tokens, "passes_per_step": runs["service"][0]["passes"][0]["train"],
                     "model_path": s["model"], "shape": prep["shape"], "threads": THREADS, "seed": SEED,
                     "lora": dict(r=LORA_R, alpha=LORA_ALPHA, targets=bench_sft.LORA_TARGETS), "steady": "steps 2+",
                     "model": "tiny random Llama (smoke)" if args.smoke else f"builtin {bench_sft.BUILTIN}"},
        "sides": {"retrograd": "retrograd train", "service": "tinker SDK -> retrograd serve"},
        "summary": summary, "ratios": {"service/retrograd": common.ratios(summary, "service", "retrograd")},
        # time per token through the service, relative to `retrograd train`
        "overhead_percent": 100 * (summary["retrograd"]["tokens_per_s"]["median"]
                                   / summary["service"]["tokens_per_s"]["median"] - 1),
        "checks": {"loss": checks}, "loss": {"first": first[0], "last": first[-1]}, "prepare": prep, "runs": runs,
    }
    path = common.write_result("service", result, args.out, args.smoke)
    import report
    print("\n" + report.render(json.loads(path.read_text())))
    print(f"\nlargest loss differences vs retrograd train: {checks['max_abs_diff_vs_reference']}; across repeats: "
          f"{checks['max_abs_diff_across_repeats']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
