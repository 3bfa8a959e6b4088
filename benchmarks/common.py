"""What the side-by-side benchmarks share (bench_sft.py, bench_dpo.py, bench_service.py).

This module owns how a comparison is made fair and recorded, so every benchmark does it the same way:

  machine      CPU model and flags (is bf16 native?), core count, and the measured plain-matmul peak
               (fp32: the best GFLOP/s of a 2048^3 product and of the training step's own shapes;
               bf16: 2048^3, at the benchmark's thread count, best of a few repetitions): the "limit"
               that "% of machine limit" figures divide by
  processes    each side runs in its own worker process (`spawn`), which reports its own peak RSS;
               the parent also reads the child's rusage from os.wait4
  order        sides run interleaved, A B A B ... (`interleave`, `run_interleaved`), with the load
               average recorded before each run, so a drifting machine hits every side alike
  statistics   median with min-max and spread over the repeats (`stats`, `summarize`)
  checks       step-by-step loss equality across sides and repeats (`check_losses`): a benchmark whose
               sides do not do the same work fails instead of printing a number
  FLOPs        matmul FLOPs of one training step from the model's shapes (`step_matmul_flops`)
  results      `write_result` writes benchmarks/results/<name>_<YYYYMMDD_HHMMSS>.json (or --out DIR)
               with machine, versions, date, command line and load averages; benchmarks/report.py
               turns the newest of each into the README's tables
  smoke        `tiny_llama` builds a tiny random Llama folder (the SmolLM2 tokenizer) that both sides
               load, so every script's --smoke mode checks its plumbing in a minute or two

Not a package: the scripts import it after putting benchmarks/ on sys.path.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
SMOKE_OUT = Path(tempfile.gettempdir()) / "bench_out"  # smoke results never go into benchmarks/results
THREADS = 2
PACKAGES = ("retrograd", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "gguf", "tinker")
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


# ---- machine and environment ------------------------------------------------------------------------

def versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == name), None)
    except OSError:
        return None


def cpu_model() -> str | None:
    return _cpuinfo_field("model name")


def cpu_flags() -> dict:
    """Which of the flags that decide matmul speed the CPU has (bf16 is only fast with avx512_bf16 / amx)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return {f: f in flags for f in CPU_FLAGS}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def self_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def bf16_native(flags: dict | None = None) -> bool:
    """The CPU computes bf16 natively (avx512_bf16 / amx_bf16): only then is a bf16 side worth timing."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


# fp32 products timed for the peak: the classic square one, and the training step's own shapes at a
# 512-token pass (SmolLM2's MLP, both ways). On an AVX2-only EPYC the square product reached 74-121
# GFLOP/s while these reached 130-150: the peak is the best of them, the ceiling a step is held to.
PEAK_SHAPES = ((2048, 2048, 2048), (512, 576, 1536), (512, 1536, 576))


def matmul_peak(n: int = 2048, threads: int = THREADS, reps: int = 5) -> dict:
    """GFLOP/s of plain matmuls, best of `reps` after a warm-up: "fp32" the best over PEAK_SHAPES and both
    float32 GEMM libraries torch ships (its default `a @ b`, MKL, and oneDNN's linear, which retrograd uses
    where it is faster: models/cpu_gemm.py; each shape's best in "fp32_shapes", each library's best in
    "fp32_libraries"), "bf16" a square [n, n] product. The best, not the mean: it is what the hardware can
    do, the ceiling a training step is held to. Without native bf16 the bf16 product is measured at
    512 x 512 (twice): at 2048 it runs at ~1 GFLOP/s on such a CPU (an avx2-only AMD EPYC) and would take
    minutes."""
    import torch
    torch.set_num_threads(threads)

    def onednn(a, b):
        return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")

    def best(m: int, k: int, cols: int, dtype, tries: int, product=torch.matmul) -> float:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, cols, dtype=dtype)
        try:
            product(a, b)  # the first call picks and prepares the kernel
        except (RuntimeError, AttributeError):  # a torch build without oneDNN's op
            return 0.0
        fastest = float("inf")
        for _ in range(tries):
            t = time.perf_counter()
            product(a, b)
            fastest = min(fastest, time.perf_counter() - t)
        return 2 * m * k * cols / fastest / 1e9
    libraries = {"mkl": torch.matmul, "onednn": onednn}
    shapes, by_library = {}, {name: 0.0 for name in libraries}
    for i, shape in enumerate(PEAK_SHAPES):
        dims = (n, n, n) if i == 0 else shape
        for name, product in libraries.items():
            rate = best(*dims, torch.float32, reps, product)
            shapes["x".join(map(str, dims))] = max(shapes.get("x".join(map(str, dims)), 0.0), rate)
            by_library[name] = max(by_library[name], rate)
    size, tries = (n, reps) if bf16_native() else (512, 2)
    return {"fp32": max(shapes.values()), "bf16": best(size, size, size, torch.bfloat16, tries),
            "fp32_shapes": shapes, "fp32_libraries": by_library}


def machine(peak: dict | None = None) -> dict:
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": THREADS, "flags": cpu_flags(),
            "platform": platform.platform(),
            "matmul_gflops": peak,
            "matmul": f"fp32: the best of MKL's and oneDNN's products {', '.join('x'.join(map(str, s)) for s in PEAK_SHAPES)} "
                      f"(m x k x n), bf16: 2048^3 (512^3 without native bf16); {THREADS} threads, best of 5"}


def start_like_the_cli() -> None:
    """What `retrograd`'s entry point does first (retrograd/malloc.py: under glibc < 2.38 the process restarts
    with the tunables that let a freed tensor's block serve its successor; glibc keeps freed memory for the
    next pass). A worker that calls the library instead of the CLI calls this before anything else (before
    torch is imported), so it runs as a user's `retrograd train` does. TRL's workers keep glibc's defaults,
    as a user's `python train.py` would."""
    from retrograd.malloc import keep_freed_memory, restart_with_reusable_blocks
    restart_with_reusable_blocks()
    keep_freed_memory()


def in_process_lora_model(smoke: bool, seed: int, builtin: str, dtype: str = "float32"):
    """An in-process A/B's start: the CLI's allocator settings (before torch is imported), THREADS torch
    threads, a warning when the machine is busy, the matmul peak, then SmolLM2 + LoRA (retrograd_lora_model)
    under SDPA. -> (model, peak)."""
    start_like_the_cli()
    import torch
    torch.set_num_threads(THREADS)
    warn_if_busy()
    peak = matmul_peak()
    model = retrograd_lora_model(smoke, seed, builtin, dtype)
    model.config._attn_implementation = "sdpa"
    return model, peak


def warn_if_busy(what: str = "") -> None:
    load = os.getloadavg()[0]
    if load > 2:
        print(f"WARNING: load average {load:.2f} > 2{what}; other processes will distort the timings", flush=True)


# ---- worker processes ----------------------------------------------------------------------------------

def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def worker_cmd(script: str, kind: str, work: Path, result: Path, **opts) -> list[str]:
    """`python script --worker kind --work W --result R --key value ...`; True adds a bare --key flag."""
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", kind, "--work", str(work), "--result", str(result)]
    for key, value in opts.items():
        if value is True:
            cmd.append(f"--{key}")
        elif value not in (None, False):
            cmd += [f"--{key}", str(value)]
    return cmd


def spawn(cmd: list[str], result: Path, label: str, cwd: Path | None = None) -> dict:
    """Run one worker to completion; its result JSON plus what the parent saw of it: wall time, CPU
    time and peak RSS from os.wait4 (this child's own rusage, with the descendants it waited for;
    RUSAGE_CHILDREN would be the max over every child so far) and the load average before it."""
    load = load_average()
    print(f"\n=== {label}  (load average {' '.join(f'{x:.2f}' for x in load)})", flush=True)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **CHILD_ENV}, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{Path(cmd[1]).name}: the {label} worker failed (exit {code}); see its output above")
    out = json.loads(Path(result).read_text())
    out.update(process_wall_s=time.perf_counter() - t, process_peak_rss_mb=usage.ru_maxrss / 1024,
               process_cpu_s=usage.ru_utime + usage.ru_stime, load_average_before=load)
    return out


def interleave(sides: list[str], repeats: int) -> list[tuple[str, int]]:
    """The run order: A B A B ... (every side once per round), `repeats` rounds."""
    return [(side, i) for i in range(repeats) for side in sides]


def run_interleaved(sides: list[str], repeats: int, run_one, after_each=None) -> tuple[dict, list]:
    """run_one(side, i) -> result dict, in interleave() order; after_each(runs) (e.g. the loss check)
    after every run so a broken comparison stops at once. Returns ({side: [results]}, the load
    average before each run)."""
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    loads = []
    for side, i in interleave(sides, repeats):
        warn_if_busy(f" before {side} run {i + 1}")
        load = load_average()
        r = run_one(side, i)
        r.setdefault("load_average_before", load)
        loads.append({"side": side, "repeat": i + 1, "load_average": r["load_average_before"]})
        runs[side].append(r)
        if after_each is not None:
            after_each(runs)
    return runs, loads


# ---- statistics ------------------------------------------------------------------------------------------

def stats(values: list[float]) -> dict:
    """median, min, max and spread ((max - min) / median) of the per-run values."""
    values = [float(v) for v in values]
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / abs(med) if med else 0.0, "n": len(values)}


def interleaved_products(sides: dict, repeats: int, flops: float, check) -> dict:
    """Two products timed A B A B ... in one process (the order flipped every pair, pair 0 a warm-up), each
    pair's outputs handed to check({name: output}), which stops the script where they disagree. -> the
    seconds per side, their summary and GFLOP/s over the timed pairs, and "<first side>_faster_pairs"."""
    names = list(sides)
    times = {name: [] for name in names}
    for i in range(repeats + 1):
        outputs = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            outputs[name] = sides[name]()
            times[name].append(time.perf_counter() - start)
        check(outputs)
    summary = {name: stats(v[1:]) for name, v in times.items()}
    first, second = names
    return {"seconds": times, "summary": summary,
            "gflops": {name: flops / s["median"] / 1e9 for name, s in summary.items()},
            f"{first}_faster_pairs": sum(a < b for a, b in zip(times[first][1:], times[second][1:]))}


def add_output_arguments(p) -> None:
    """--out and --smoke, as every benchmark script takes them."""
    p.add_argument("--out", help="results folder (default benchmarks/results; $TMPDIR/bench_out with --smoke)")
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama: checks the plumbing")


def summarize(runs: list[dict], metrics: dict) -> dict:
    """{name: stats([fn(run) for run in runs])} for metrics {name: fn}."""
    return {name: stats([fn(r) for r in runs]) for name, fn in metrics.items()}


def ratios(summary: dict, a: str, b: str) -> dict:
    """median of side a / median of side b, for every metric both have."""
    out = {}
    for key, sa in summary[a].items():
        sb = summary[b].get(key)
        if isinstance(sa, dict) and isinstance(sb, dict) and sb.get("median"):
            out[key] = sa["median"] / sb["median"]
    return out


def steady(values: list[float]) -> list[float]:
    """Steps 2 onwards: step 1 is warm-up (first-call kernel choice, allocator growth)."""
    return list(values[1:])


# ---- checks ----------------------------------------------------------------------------------------------

class CheckFailed(SystemExit):
    """A benchmark's sides did not do the same work: the script stops (exit status 1) with this message."""


def loss_mismatch(got: list[float], want: list[float], tol: float) -> tuple | None:
    """The first step (0-based) where |got - want| > tol * max(1, |want|), as (step, got, want), or
    None; a length difference is a mismatch at the first missing step."""
    for k, (a, b) in enumerate(zip(got, want)):
        if not abs(a - b) <= tol * max(1.0, abs(b)):  # also catches NaN
            return k, a, b
    if len(got) != len(want):
        k = min(len(got), len(want))
        return k, got[k] if k < len(got) else None, want[k] if k < len(want) else None
    return None


def check_losses(bench: str, losses: dict, reference: str, tol: float, repeat_tol: float | None = None) -> dict:
    """Every run's per-step losses against the first run of `reference` (within `tol`) and against the
    first run of its own side (within `repeat_tol`, default `tol`). losses: {side: [[loss per step]
    per run]}. Raises CheckFailed naming the side, run, step and both values; returns the largest
    differences seen."""
    repeat_tol = tol if repeat_tol is None else repeat_tol
    ref_runs = losses.get(reference) or []
    out = {"tolerance": f"|a - b| <= {tol:g} * max(1, |b|) against {reference}'s run 1",
           "repeat_tolerance": f"|a - b| <= {repeat_tol:g} * max(1, |b|) against the same side's run 1",
           "max_abs_diff_vs_reference": {}, "max_abs_diff_across_repeats": {}}
    for side, runs in losses.items():
        for i, run in enumerate(runs):
            pairs = ([(ref_runs[0], tol, f"{reference} run 1", "max_abs_diff_vs_reference")] if ref_runs else []) + \
                    [(runs[0], repeat_tol, f"{side} run 1", "max_abs_diff_across_repeats")]
            for want, t, name, key in pairs:
                bad = loss_mismatch(run, want, t)
                if bad is not None:
                    k, a, b = bad
                    raise CheckFailed(f"{bench}: loss check failed at step {k + 1}: {side} run {i + 1} has {a}, "
                                      f"{name} has {b} (allowed |a - b| <= {t:g} * max(1, |b|)); the sides do not "
                                      "do the same work, so no throughput is reported")
                diff = max((abs(a - b) for a, b in zip(run, want)), default=0.0)
                out[key][side] = max(out[key].get(side, 0.0), diff)
    return out


# ---- FLOPs -----------------------------------------------------------------------------------------------

def model_shape(config) -> dict:
    """The shapes that set a Llama-family step's matmul FLOPs, from an HF config (object or dict)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    return {"hidden": hidden, "intermediate": int(get("intermediate_size")), "layers": int(get("num_hidden_layers")),
            "heads": heads, "kv_heads": int(get("num_key_value_heads") or heads),
            "head_dim": int(get("head_dim") or hidden // heads), "vocab": int(get("vocab_size")),
            "tied": bool(get("tie_word_embeddings", False))}


PROJ_ALIASES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def step_matmul_flops(shape: dict, batch: int, seq: int, mode: str = "lora", lora_rank: int = 8,
                      lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")) -> dict:
    """Matmul FLOPs (2 m n k per product) of one forward + backward over batch x seq tokens.

    A product's backward costs one more forward-sized product for the input's gradient when the
    input needs one (something trainable lies upstream), and one more for the weight's gradient when
    the weight is trained: frozen weights count 1-2x their forward, trained ones 3x. So in LoRA mode
    the first layer's q/k/v need no input gradient (the embeddings are frozen); in full mode every
    weight, the (tied) head and the embedding's path train. LoRA's A and B are two trained products
    each. Attention counts QK^T and AV densely (seq x seq, no causal halving, no recomputation in
    backward), forward and both input gradients. The head runs over every position. Norms, RoPE,
    activations, softmax and the optimizer are not matmuls and are left out."""
    if mode not in ("lora", "full"):
        raise ValueError(f"mode {mode!r}: lora or full")
    h, inter, d = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q_out, kv_out = shape["heads"] * d, shape["kv_heads"] * d
    n = batch * seq
    full = mode == "full"
    targets = {PROJ_ALIASES.get(t, t) for t in lora_targets} if not full else set()
    parts = {"projections": 0, "lora": 0, "attention": 0, "lm_head": 0}

    def linear(name: str, fan_in: int, fan_out: int, grad_in: bool) -> bool:
        """Adds one projection (and its LoRA); returns whether its output needs a gradient."""
        parts["projections"] += 2 * n * fan_in * fan_out * (1 + grad_in + full)
        if name in targets:  # A: [fan_in -> r], its input as the base's; B: [r -> fan_out], input needs grad
            parts["lora"] += 2 * n * fan_in * lora_rank * (2 + grad_in) + 2 * n * lora_rank * fan_out * 3
        return grad_in or full or name in targets

    stream = full  # does the residual stream need a gradient here? (the embeddings train only in full)
    for _ in range(shape["layers"]):
        q, k, v = (linear(p, h, w, stream) for p, w in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)))
        attn_grad = q or k or v
        per_product = 2 * batch * shape["heads"] * seq * seq * d  # QK^T, and AV the same
        parts["attention"] += 2 * per_product * (1 + 2 * attn_grad)
        stream = linear("o_proj", q_out, h, attn_grad) or stream
        gate = linear("gate_proj", h, inter, stream)
        up = linear("up_proj", h, inter, stream)
        stream = linear("down_proj", inter, h, gate or up) or stream
    parts["lm_head"] = 2 * n * h * shape["vocab"] * (1 + stream + full)
    return {**parts, "total": sum(parts.values()), "tokens": n, "mode": mode,
            "counting": "2mnk per matmul; backward: +1 for the input gradient where needed, +1 for a trained "
                        "weight; dense attention; head over every position"}


# ---- models -------------------------------------------------------------------------------------------------

def tokenizer_folder(gguf: Path) -> str:
    """An HF folder holding the GGUF's tokenizer: retrograd's conversion cache (made once)."""
    import torch
    from retrograd.models.load import _converted_gguf
    folder, _ = _converted_gguf(Path(gguf).resolve(), torch.float32, print)
    return folder


def tiny_llama(path: Path, tokenizer_dir: str, seed: int = 0) -> dict:
    """A random Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, tied head) with the tokenizer from
    `tokenizer_dir`, saved as an HF folder at `path` that both sides load. Returns its model_shape."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model_shape(cfg)


def retrograd_lora_model(smoke: bool, seed: int = 0, builtin: str = "smollm2-135m-instruct", dtype: str = "float32"):
    """The model an in-process A/B of retrograd trains: SmolLM2 (--smoke: a tiny random Llama) loaded as
    `retrograd train` loads it, the lean MLP, LoRA r=8 / alpha 16 on q/k/v/o, train mode. lora_B starts
    random, not zero (PEFT's start), so that every lora_A gradient is non-zero too and a check that two
    sides' gradients agree can fail on every tensor."""
    import torch
    from retrograd.models.builtin import builtin_gguf
    from retrograd.models.lean_mlp import lean_mlp
    from retrograd.models.load import load_model
    from retrograd.models.lora import attach_lora
    path = builtin
    if smoke:
        folder = Path(tempfile.mkdtemp()) / "tiny"
        tiny_llama(folder, tokenizer_folder(builtin_gguf(builtin)), seed)
        path = str(folder)
    model = load_model(path, dtype, log=lambda *a: None).model  # dtype: [model] dtype's values
    lean_mlp(model)
    model, _ = attach_lora(model, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 0.0, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.train()
    return model


def load_trl_model(path: str):
    """(model, tokenizer) for a TRL side: a .gguf de-quantized to fp32 by transformers, or an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = Path(path)
    if p.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        tok = AutoTokenizer.from_pretrained(str(p))
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
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


# ---- results ---------------------------------------------------------------------------------------------------

def out_dir(args) -> Path:
    """--out, else benchmarks/results (a smoke run: $TMPDIR/bench_out, never benchmarks/results)."""
    if args.out:
        return Path(args.out)
    return SMOKE_OUT if getattr(args, "smoke", False) else RESULTS


def result_name(name: str, smoke: bool = False, stamp: str | None = None) -> str:
    return f"{name}{'_smoke' if smoke else ''}_{stamp or time.strftime('%Y%m%d_%H%M%S')}.json"


def write_result(name: str, obj: dict, out: Path | None = None, smoke: bool = False) -> Path:
    """Write OUT/<name>_<YYYYMMDD_HHMMSS>.json (name_smoke_... for a smoke run): obj plus the
    benchmark's name, date (UTC ISO), command line, machine, package versions and load averages."""
    folder = Path(out) if out else (SMOKE_OUT if smoke else RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    full = {"benchmark": name, "smoke": smoke, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [Path(sys.executable).name, *sys.argv], **obj}
    full.setdefault("machine", machine())
    full.setdefault("versions", versions())
    full["load_average"] = {**(obj.get("load_average") or {}), "end": load_average()}
    path = folder / result_name(name, smoke)
    write_json(path, full)
    return path
