"""SFT LoRA training throughput and peak memory: retrograd vs TRL's SFTTrainer, side by side.

A by-hand benchmark, not a test. It measures, for each framework, training tokens per second
(steady state: optimizer steps 2 onwards, step 1 is warm-up) and the peak resident memory of the
process, on the same model, data and settings:

  model       SmolLM2-135M-Instruct, retrograd's built-in GGUF (Q4_1, de-quantized to fp32 by
              transformers in both frameworks; TRL loads it with from_pretrained(gguf_file=...))
  LoRA        r=8, alpha=16, dropout 0, targets q_proj, k_proj, v_proj, o_proj
  dtype       fp32; gradient checkpointing off
  batch       4 sequences x 256 tokens per optimizer step, no gradient accumulation. Every synthetic
              conversation is longer than 256 tokens, so every row is truncated to exactly 256 and
              nothing is padded. Loss on every token (TRL's SFTTrainer default; retrograd
              sft.assistant_only_loss = false). Rows in file order in both (no shuffling), so the
              step-1 losses, taken before any update, should agree.
  optimizer   AdamW, lr 2e-4 constant, no warm-up, weight decay 0, grad-norm clip 1.0
  other       2 torch threads, seed 0, STEPS optimizer steps (default 20)

Each framework runs in its own subprocess (`--worker retrograd|trl`), so its peak RSS is its own:
the parent reads the child's ru_maxrss from os.wait4 and the worker also reports its own peak.
Before them a `--worker prepare` subprocess fetches the GGUF (once, into $RETROGRAD_HOME) and warms
retrograd's GGUF -> HF folder conversion cache, so the measured retrograd run loads the model as
every run after the first does. TRL de-quantizes the GGUF in every run (as in the published
baseline); "peak RSS after load" in the table shows what loading costs each side.

Step timing: TRL from a TrainerCallback (on_step_begin -> on_step_end, which leaves out the
DataLoader fetch); retrograd from its own metrics.jsonl ("system/step_seconds", which includes
picking and collating the step's rows, well under a millisecond here).

Run, from the repository root, on an IDLE machine (load average < 2, one benchmark at a time;
contention from other processes made the same runs 6-9x slower):

    pip install -e '.[bench]'          # trl==1.16.0, datasets (do not let pip change torch)
    python benchmarks/bench_sft.py [--steps 20] [--out bench_out]

STEPS can also come from the environment (STEPS=20). It takes about 5-6 minutes on 2 cores
(model load ~20 s per framework, ~6 s per step each). The parent prints a table and writes
OUT/result_sft.json: tokens/s and its retrograd/TRL ratio, peak RSS and its ratio, per-step
seconds and losses, first/last loss, versions and load averages.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

BUILTIN = "smollm2-135m-instruct"
BATCH, SEQ, THREADS, SEED, LR = 4, 256, 2, 0, 2e-4
LORA_R, LORA_ALPHA, LORA_TARGETS = 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]
PACKAGES = ("retrograd", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "gguf")
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}


# ---- synthetic data: deterministic chat rows of ~750 tokens, all longer than SEQ -------------------

PLACES = ("Lisbon Oslo Cairo Lima Quito Perth Osaka Dakar Riga Tunis Hanoi Bern Accra Sofia Porto Kyiv "
          "Nairobi Havana Dublin Tallinn").split()
GOODS = ("copper timber rice wool coffee salt glass paper cotton tea steel cocoa rubber olives grain "
         "marble tin silk amber").split()


def make_row(rng: random.Random) -> dict:
    depot = rng.choice(PLACES)
    lines = [f"Week {w}: {rng.randint(3, 97)} crates of {rng.choice(GOODS)} left {depot} for "
             f"{rng.choice(PLACES)}; {rng.randint(0, 40)} arrived late and {rng.randint(0, 9)} were damaged."
             for w in range(1, 25)]
    return {"messages": [
        {"role": "user", "content": f"Write the shipping log of the {depot} depot for the last "
                                    f"{len(lines)} weeks, one line per week."},
        {"role": "assistant", "content": "\n".join(lines)},
    ]}


def write_data(path: Path, n_rows: int) -> None:
    rng = random.Random(SEED)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_rows):
            f.write(json.dumps(make_row(rng)) + "\n")


# ---- helpers shared by parent and workers ----------------------------------------------------------

def self_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def load_trl_model(gguf_path: str):
    """(model, tokenizer) for the TRL side: the GGUF de-quantized to fp32 by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # The weights are de-quantized to plain fp32, but transformers keeps a GGUF quantizer marker and
    # Trainer then refuses to train ("... quantized with GGUF ... do not support training"). Drop it.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    for m in model.modules():
        if getattr(getattr(m, "config", None), "_is_quantized", False):
            m.config._is_quantized = False
    return model, tok


# ---- workers (each in its own process) ---------------------------------------------------------------

def worker_prepare(args) -> dict:
    """Fetch the built-in GGUF and warm retrograd's conversion cache (not measured)."""
    from retrograd.models.builtin import builtin_gguf
    from retrograd.models.load import load_model
    gguf = builtin_gguf(BUILTIN)
    t = time.perf_counter()
    load_model(str(gguf), "float32", log=print)
    return {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "retrograd_load_s": time.perf_counter() - t}


def worker_retrograd(args) -> dict:
    import torch
    from retrograd.config import load_config
    from retrograd.train.sft import train_sft

    work = Path(args.work)
    toml = f"""\
[run]
algorithm = "sft"
name = "bench_sft"
directory = {json.dumps(str(work / "run"))}

[model]
path = {json.dumps(args.gguf)}
device = "cpu"
dtype = "float32"

[output]
path = {json.dumps(str(work / "adapter"))}

[lora]
rank = {LORA_R}
alpha = {LORA_ALPHA}
targets = {json.dumps(LORA_TARGETS)}
dropout = 0.0
seed = {SEED}

[training]
trainable = "lora"
lr = {LR}
lr_scheduler = "constant"
warmup_steps = 0
weight_decay = 0.0
max_grad_norm = 1.0
batch_size = {BATCH}
gradient_accumulation = 1
ctx = {SEQ}
max_steps = {args.steps}
seed = {SEED}
threads = {THREADS}
gradient_checkpointing = false

[sft]
data = {json.dumps(args.data)}
shuffle = false
assistant_only_loss = false

[metrics]
log_every = 1
"""
    (work / "run.toml").write_text(toml, encoding="utf-8")
    events = []  # (seconds since start, peak RSS so far, message): where the load ends

    t0 = time.perf_counter()

    def log(msg):
        events.append({"t": round(time.perf_counter() - t0, 2), "peak_rss_mb": round(self_peak_rss_mb(), 1),
                       "msg": str(msg)[:120]})
        print(msg, flush=True)

    cfg = load_config(work / "run.toml")
    result = train_sft(cfg, log=log)
    wall = time.perf_counter() - t0
    if result.stopped_by != "done" or result.step != args.steps:
        raise RuntimeError(f"retrograd stopped early: {result}")
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/loss" in r]
    # the "model ...: N parameters" line comes right after load + LoRA attach
    after_load = next((e for e in events if e["msg"].startswith("model ")), None)
    return {
        "step_s": [r["system/step_seconds"] for r in rows],
        "step_tokens": [r["train/tokens"] for r in rows],
        "loss": [r["train/loss"] for r in rows],
        "step_peak_rss_mb": [r["system/peak_rss_mb"] for r in rows],
        "peak_rss_after_load_mb": after_load["peak_rss_mb"] if after_load else None,
        "load_s": after_load["t"] if after_load else None,
        "wall_s": wall,  # load + data + train + writing the adapter
        "torch_threads": torch.get_num_threads(),
        "events": events,
    }


def worker_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback, set_seed
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(THREADS)
    set_seed(SEED)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)

    t0 = time.perf_counter()
    model, tok = load_trl_model(args.gguf)
    load_s = time.perf_counter() - t0
    peak_after_load = self_peak_rss_mb()

    # every row must be longer than SEQ, so truncation leaves exactly SEQ tokens and no padding
    lengths = [len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
               for r in rows]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s = []

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self._t)

    timer = StepTimer()
    config = SFTConfig(
        output_dir=str(Path(args.work) / "trl_out"), max_steps=args.steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, max_length=SEQ, packing=False, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=False, fp16=False, gradient_checkpointing=False, seed=SEED, use_cpu=True,
        train_sampling_strategy="sequential",  # same row order as retrograd's shuffle = false
        dataloader_num_workers=0, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                         peft_config=lora, callbacks=[timer])
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    # num_tokens is cumulative (non-padding input tokens); difference it into tokens per step
    cumulative = [entry.get("num_tokens") for entry in logs]
    if len(logs) == len(timer.step_s) and all(c is not None for c in cumulative):
        step_tokens = [int(b - a) for a, b in zip([0] + cumulative[:-1], cumulative)]
    else:
        step_tokens = [BATCH * SEQ] * len(timer.step_s)
    return {
        "step_s": timer.step_s,
        "step_tokens": step_tokens,
        "loss": [entry["loss"] for entry in logs],
        "peak_rss_after_load_mb": peak_after_load,
        "load_s": load_s,
        "train_wall_s": train_s,
        "untruncated_tokens_min_max": [min(lengths), max(lengths)],
        "torch_threads": torch.get_num_threads(),
    }


WORKERS = {"prepare": worker_prepare, "retrograd": worker_retrograd, "trl": worker_trl}


def run_worker(args) -> None:
    out = WORKERS[args.worker](args)
    out["worker_peak_rss_mb"] = self_peak_rss_mb()
    write_json(Path(args.result), out)


# ---- parent ------------------------------------------------------------------------------------------

def spawn(kind: str, tmp: Path, steps: int, data: Path, gguf: str = "", script: str = __file__) -> dict:
    """Run `script --worker kind` in its own process; its result JSON plus the process's own peak RSS."""
    work = tmp / kind
    work.mkdir()
    result = work / "result.json"
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", kind, "--steps", str(steps),
           "--work", str(work), "--data", str(data), "--gguf", gguf, "--result", str(result)]
    print(f"\n=== {kind}  (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **CHILD_ENV})
    # os.wait4 gives this child's own rusage; RUSAGE_CHILDREN would be the max over all children so far
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{Path(script).name}: the {kind} worker failed (exit {proc.returncode}); see its output above")
    out = json.loads(result.read_text())
    out["process_wall_s"] = time.perf_counter() - t
    out["process_peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
    out["process_cpu_s"] = usage.ru_utime + usage.ru_stime
    return out


def summarize(r: dict, steps: int) -> dict:
    step_s, step_tokens = r["step_s"], r["step_tokens"]
    if len(step_s) != steps or len(step_tokens) != steps:
        raise SystemExit(f"bench_sft: expected {steps} timed steps, got {len(step_s)} times "
                         f"and {len(step_tokens)} token counts")
    if any(n != BATCH * SEQ for n in step_tokens):
        raise SystemExit(f"bench_sft: a step did not train {BATCH}x{SEQ} tokens: {step_tokens}")
    return dict(
        tokens_per_s_steps2plus=sum(step_tokens[1:]) / sum(step_s[1:]),
        tokens_per_s_all_steps=sum(step_tokens) / sum(step_s),
        tokens_per_s_best_step=max(n / s for n, s in zip(step_tokens, step_s)),
        step1_s=step_s[0], mean_step_s_steps2plus=sum(step_s[1:]) / (steps - 1),
        peak_rss_mb=max(r["process_peak_rss_mb"], r["worker_peak_rss_mb"]),
        first_loss=r["loss"][0], last_loss=r["loss"][-1],
    )


def print_table(s: dict, settings: str) -> None:
    rg, trl = s["retrograd"], s["trl"]

    def ratio(key):
        a, b = rg.get(key), trl.get(key)
        return f"{a / b:.2f}x" if a is not None and b else ""

    rows = [("tokens/s, steps 2+", "tokens_per_s_steps2plus", "{:.1f}"),
            ("tokens/s, all steps", "tokens_per_s_all_steps", "{:.1f}"),
            ("step 1 s (warm-up)", "step1_s", "{:.2f}"),
            ("mean step s, steps 2+", "mean_step_s_steps2plus", "{:.2f}"),
            ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
            ("peak RSS after load MB", "peak_rss_after_load_mb", "{:.0f}"),
            ("model load s", "load_s", "{:.1f}"),
            ("process wall s", "process_wall_s", "{:.1f}"),
            ("first loss", "first_loss", "{:.4f}"),
            ("last loss", "last_loss", "{:.4f}")]
    fmt = "{:<24} {:>12} {:>12} {:>14}"
    print("\n" + settings)
    print(fmt.format("", "retrograd", "TRL", "retrograd/TRL"))
    for label, key, f in rows:
        cells = [f.format(d[key]) if d.get(key) is not None else "-" for d in (rg, trl)]
        print(fmt.format(label, *cells, ratio(key) if "loss" not in key else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 20)),
                   help="optimizer steps per framework (default: $STEPS or 20; at least 2)")
    p.add_argument("--out", default="bench_out", help="folder for result_sft.json (default: bench_out)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for internal in ("--work", "--data", "--gguf", "--result"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.steps < 2:
        p.error("--steps must be at least 2 (step 1 is warm-up and is left out of the steady figure)")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    loadavg = {"start": os.getloadavg()}
    if loadavg["start"][0] > 2:
        print(f"WARNING: load average {loadavg['start'][0]:.2f} > 2; other processes will distort the timings",
              flush=True)
    settings = (f"SFT LoRA r={LORA_R} alpha={LORA_ALPHA} on q,k,v,o | SmolLM2-135M-Instruct fp32 | "
                f"{BATCH}x{SEQ} tokens/step | {args.steps} steps | lr {LR} constant | {THREADS} threads | "
                f"no grad ckpt | seed {SEED}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_sft-") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "train.jsonl"
        write_data(data, args.steps * BATCH)
        prep = spawn("prepare", tmp, args.steps, data)
        for kind in ("retrograd", "trl"):
            loadavg[f"before_{kind}"] = os.getloadavg()
            results[kind] = spawn(kind, tmp, args.steps, data, prep["gguf"])
    loadavg["end"] = os.getloadavg()

    lo, hi = results["trl"]["untruncated_tokens_min_max"]
    if lo <= SEQ:
        raise SystemExit(f"bench_sft: a synthetic row has only {lo} tokens; every row must exceed {SEQ}")
    summary = {k: {**summarize(r, args.steps), "peak_rss_after_load_mb": r["peak_rss_after_load_mb"],
                   "load_s": r["load_s"], "process_wall_s": r["process_wall_s"]} for k, r in results.items()}
    rg, trl = summary["retrograd"], summary["trl"]
    report = {
        "benchmark": "sft_lora",
        "settings": dict(model=f"builtin {BUILTIN} (GGUF Q4_1 -> fp32)", gguf=prep["gguf"], dtype="float32",
                         lora=dict(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, targets=LORA_TARGETS),
                         batch=BATCH, seq=SEQ, steps=args.steps, lr=LR, lr_scheduler="constant",
                         max_grad_norm=1.0, threads=THREADS, gradient_checkpointing=False, seed=SEED,
                         loss_on="all tokens", row_order="file order (no shuffle)",
                         rows=args.steps * BATCH, untruncated_row_tokens_min_max=[lo, hi]),
        "tokens_per_s_steps2plus": {
            "retrograd": rg["tokens_per_s_steps2plus"], "trl": trl["tokens_per_s_steps2plus"],
            "ratio_retrograd_over_trl": rg["tokens_per_s_steps2plus"] / trl["tokens_per_s_steps2plus"]},
        "peak_rss_mb": {"retrograd": rg["peak_rss_mb"], "trl": trl["peak_rss_mb"],
                        "ratio_retrograd_over_trl": rg["peak_rss_mb"] / trl["peak_rss_mb"]},
        "loss": {k: {"first": summary[k]["first_loss"], "last": summary[k]["last_loss"]} for k in summary},
        "summary": summary,
        "raw": results,
        "versions": versions(),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "loadavg": loadavg,
        "retrograd_conversion_cache_warm_s": prep["retrograd_load_s"],
    }
    path = out_dir / "result_sft.json"
    write_json(path, report)
    print_table(summary, settings)
    print(f"\nload average: start {loadavg['start'][0]:.2f}, end {loadavg['end'][0]:.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
