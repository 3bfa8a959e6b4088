"""Overhead of the service path: the same SFT work through `retrograd train` and through the
unmodified tinker SDK against `retrograd serve`, side by side in one script.

A by-hand benchmark, not a test. Same model, data, rows, LoRA and optimizer as bench_sft.py
(SmolLM2-135M built-in, LoRA r=8 alpha=16 on q/k/v/o, 4 rows x 256 tokens per step, loss on every
token, AdamW lr 2e-4, clip 1.0, 2 torch threads, rows in file order). Both sides start from the
same LoRA initialisation (seed 0; the server runs with --lora-alpha 16), so their per-step losses
must agree -- the script checks it, which shows the two paths do the same work.

  retrograd  bench_sft.py's retrograd worker; step time from metrics.jsonl (system/step_seconds)
  service    `retrograd serve --threads 2` in its own process; a client process renders the same
             rows, and times each step from submitting forward_backward + optim_step to both results
             (wire encoding, HTTP, the long-poll and the server's queue are all inside the time)

Tokens per step are counted the same way on both sides (4 x 256 sequence tokens). Peak RSS of the
service is the server process's (VmHWM); the client holds no model.

    pip install -e '.[service,bench]'
    python benchmarks/bench_service.py [--steps 12] [--out bench_out]

Writes OUT/result_service.json and prints the table.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft  # noqa: E402
from bench_sft import BATCH, LR, SEQ, SEED, THREADS, spawn, write_data, write_json  # noqa: E402


def worker_service(args) -> dict:
    """Client side: start the server, train through the SDK, report per-step times and losses."""
    import tinker
    from tinker import types

    from retrograd.data.sft import IGNORE, Renderer, load_examples
    work = Path(args.work)
    cmd = [sys.executable, "-m", "retrograd", "serve", "--port", "0", "--state-dir", str(work / "state"),
           "--models", args.gguf, "--threads", str(THREADS), "--lora-alpha", str(bench_sft.LORA_ALPHA)]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **bench_sft.CHILD_ENV})
    url = None
    for line in server.stderr:
        print(line, end="", flush=True)
        m = re.search(r"retrograd serve: (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        raise RuntimeError("retrograd serve did not start")
    try:
        sc = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = sc.create_lora_training_client(base_model=args.gguf, rank=bench_sft.LORA_R, seed=SEED,
                                            train_mlp=False, train_unembed=False).result()
        examples = load_examples(args.data, "auto", Renderer(tc.get_tokenizer(), SEQ, assistant_only=False))
        step_s, losses, tokens = [], [], []
        for step in range(args.steps):
            batch = examples[step * BATCH:(step + 1) * BATCH]
            n = sum(e.n_targets for e in batch)
            data = [types.Datum(model_input=types.ModelInput.from_ints(e.input_ids[:-1]),
                                loss_fn_inputs={"target_tokens": e.input_ids[1:],
                                                "weights": [(1.0 / n if lab != IGNORE else 0.0) for lab in e.labels[1:]]})
                    for e in batch]
            t = time.perf_counter()
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.999, eps=1e-8,
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
    return {"step_s": step_s, "step_tokens": tokens, "loss": losses, "server_peak_rss_mb": hwm}


WORKERS = {"retrograd": bench_sft.worker_retrograd, "prepare": bench_sft.worker_prepare, "service": worker_service}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 12)))
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--worker", choices=sorted(WORKERS))
    ap.add_argument("--work"), ap.add_argument("--data"), ap.add_argument("--gguf", default="")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        out = WORKERS[args.worker](args)
        out["worker_peak_rss_mb"] = bench_sft.self_peak_rss_mb()
        write_json(Path(args.result), out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data.jsonl"
        write_data(data, args.steps * BATCH)
        gguf = spawn("prepare", tmp, args.steps, data, script=__file__)["gguf"]
        runs = {kind: spawn(kind, tmp, args.steps, data, gguf, script=__file__) for kind in ("retrograd", "service")}
    res = {}
    for kind, r in runs.items():
        s, n = r["step_s"], r["step_tokens"]
        res[kind] = {"tokens_per_s_steps2plus": sum(n[1:]) / sum(s[1:]), "mean_step_s_steps2plus": sum(s[1:]) / (len(s) - 1),
                     "first_loss": r["loss"][0], "last_loss": r["loss"][-1], "losses": r["loss"], "step_s": s,
                     "peak_rss_mb": r.get("server_peak_rss_mb") or r["process_peak_rss_mb"]}
    a, b = res["retrograd"], res["service"]
    res["overhead_percent"] = 100 * (a["tokens_per_s_steps2plus"] / b["tokens_per_s_steps2plus"] - 1)
    res["max_loss_difference"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    res["load_average"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "result_service.json", res)
    print(f"\n{'':<26}{'retrograd train':>16}{'SDK -> serve':>14}")
    for label, key, f in (("tokens/s, steps 2+", "tokens_per_s_steps2plus", "{:.1f}"),
                          ("mean step s, steps 2+", "mean_step_s_steps2plus", "{:.3f}"),
                          ("first / last loss", None, None), ("peak RSS MB", "peak_rss_mb", "{:.0f}")):
        if key is None:
            print(f"{label:<26}{a['first_loss']:>8.4f}/{a['last_loss']:.4f}{b['first_loss']:>7.4f}/{b['last_loss']:.4f}")
        else:
            print(f"{label:<26}{f.format(a[key]):>16}{f.format(b[key]):>14}")
    print(f"service overhead: {res['overhead_percent']:+.1f}% time per token; largest per-step loss difference "
          f"{res['max_loss_difference']:.2e}")


if __name__ == "__main__":
    main()
