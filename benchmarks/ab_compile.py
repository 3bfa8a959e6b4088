"""torch.compile on CPU for an SFT LoRA pass: eager vs inductor, interleaved in one process.

Issue 18 asks to try torch.compile on CPU and keep it only if it wins an interleaved A/B. This is that
A/B, kept so the answer can be measured again on the next CPU:

  model     SmolLM2-135M-Instruct (the built-in; --dtype float32 or bfloat16 weights), LoRA r=8 / alpha 16
            on q/k/v/o, the lean MLP, lora_B random so every gradient is checked
            (common.retrograd_lora_model; --smoke: a tiny random Llama)
  pass      one SFT micro-batch: [2, 256] random tokens, loss on every token through retrograd's fused
            head (Scorer.loss_sum), then backward; gradients are zeroed before each pass
  sides     "eager": the model as retrograd runs it; "compile": the same model with `[training] compile`'s
            path switched on (models/packed.py: compile_training_passes, the packed forward's layers
            through torch.compile, inductor's default mode), the same parameters. The head stays eager
            on both sides (it is retrograd's own chunked autograd function). Before 2026-12-04 this
            script wrapped the decoder module instead, which SFT passes no longer call once they run
            packed: results/ab_compile_20261202_*.json measured that older wrapping
  order     the compiled side's first call (the compile) is timed on its own; then eager, compile,
            eager, compile, ... (--repeats each); the first pair is warm-up, the rest is summarised
            (median, min-max)
  check     both sides' losses and LoRA gradients must agree in every pass (float32: loss 1e-5 relative,
            every LoRA tensor within 2e-3 of its largest entry; bfloat16: loss 1e-3, the gradients within
            0.1 of their norm, as the two round differently: inductor keeps what it fuses in float32), or
            the script stops: a faster side that computes something else is no result

Run from the repository root on an IDLE machine:

    python benchmarks/ab_compile.py [--dtype bfloat16] [--repeats 6] [--out benchmarks/results]
    python benchmarks/ab_compile.py --smoke        # tiny random Llama, $TMPDIR/bench_out

Writes OUT/ab_compile_<timestamp>.json with the machine, each pass's seconds and the compile time.
Inductor caches what it compiled on disk ($TMPDIR/torchinductor_$USER), so a second process compiles
faster; the JSON says whether that cache held any compiled kernel before the run ("cache_warm": of any
model, so True means "possibly warm for this one").
"""
from __future__ import annotations

import argparse
import getpass
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BUILTIN = "smollm2-135m-instruct"
ROWS, SEQ, SEED = 2, 256, 0
# Relative tolerances. The same fp32 math, but inductor's fused kernels (RMSNorm, SiLU-gate, the
# residual adds) sum in another order: the loss agreed to 1e-7, the LoRA gradients to ~5e-4 of each
# tensor's largest entry on SmolLM2. Any change in the work (data, masking, a skipped term) moves
# both by far more.
LOSS_TOL, GRAD_TOL = 1e-5, 2e-3
# bf16 weights: the eager side rounds after every op, the compiled one once per fused kernel; on SmolLM2 the
# LoRA gradients of each were 5.7 % and 2.6 % of the norm away from the float32 model's (2026-12-04)
LOSS_TOL_BF16, GRAD_NORM_TOL_BF16 = 1e-3, 0.1


def build(smoke: bool, dtype: str = "float32"):
    """(model, the [ROWS, SEQ] batch of random tokens every pass trains on)."""
    import torch
    model = common.retrograd_lora_model(smoke, SEED, BUILTIN, dtype)
    torch.manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (ROWS, SEQ))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return model, batch


def one_pass(model, scorer, batch) -> tuple[float, float, dict]:
    import torch
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    loss = scorer.loss_sum(batch)
    loss.backward()
    seconds = time.perf_counter() - t
    # one float64 copy each (it outlives the next pass's zero_grad), kept for check_same
    grads = {n: p.grad.detach().to(torch.float64) for n, p in model.named_parameters()
             if p.requires_grad and p.grad is not None}
    if not grads:
        raise SystemExit("no gradients reached the adapter: nothing was trained")
    return seconds, loss.item(), grads


def check_same(where: str, a: tuple, b: tuple, bf16: bool = False) -> tuple[float, float]:
    """(loss, gradient) relative differences between two passes; stops above the tolerances."""
    loss = abs(a[1] - b[1]) / max(1.0, abs(a[1]))
    if bf16:
        grad = float(sum(float((ga - b[2][n]).norm()) ** 2 for n, ga in a[2].items()) ** 0.5
                     / max(1e-30, sum(float(ga.norm()) ** 2 for ga in a[2].values()) ** 0.5))
        tolerances, unit = (LOSS_TOL_BF16, GRAD_NORM_TOL_BF16), "their norm"
    else:
        grad = max(float((ga - b[2][name]).abs().max() / max(1e-12, float(ga.abs().max())))
                   for name, ga in a[2].items())
        tolerances, unit = (LOSS_TOL, GRAD_TOL), "their largest entry"
    if loss > tolerances[0] or grad > tolerances[1]:
        raise SystemExit(f"{where}: eager and compiled passes differ: loss by {loss:.2e} (tolerance {tolerances[0]}), "
                         f"gradients by {grad:.2e} of {unit} (tolerance {tolerances[1]})")
    return loss, grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=6, help="passes of each side after the compile (default 6)")
    common.add_output_arguments(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's weights")
    args = p.parse_args()
    import torch
    from retrograd.models import packed
    from retrograd.models.logprobs import Scorer
    torch.set_num_threads(common.THREADS)
    common.warn_if_busy()
    peak = common.matmul_peak()
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    cache_warm = cache.is_dir() and any(cache.rglob("*.so"))
    load_before = common.load_average()
    model, batch = build(args.smoke, args.dtype)
    scorer = Scorer(model)
    if not scorer.packs:
        raise SystemExit("the packed forward does not run for this model: [training] compile would not apply")
    packed.compile_training_passes(scorer.decoder)
    compiled_layers = packed._COMPILED.pop(scorer.decoder)
    calls = []

    class Side:
        """One side's passes: the compiled layers registered for the decoder (and counted) or not."""

        def __init__(self, compiled: bool):
            self.compiled = compiled

        def loss_sum(self, batch):
            if self.compiled:
                packed._COMPILED[scorer.decoder] = lambda *a: calls.append(1) or compiled_layers(*a)
            else:
                packed._COMPILED.pop(scorer.decoder, None)
            return scorer.loss_sum(batch)

    eager, compiled = Side(False), Side(True)
    bf16 = args.dtype == "bfloat16"
    t = time.perf_counter()
    first = one_pass(model, compiled, batch)
    compile_s = time.perf_counter() - t
    print(f"first compiled call (compile + pass): {compile_s:.1f} s", flush=True)
    times = {"eager": [], "compile": []}
    worst = [0.0, 0.0]  # loss, gradients
    for i in range(args.repeats):
        e = one_pass(model, eager, batch)
        c = one_pass(model, compiled, batch)
        for diff in (check_same(f"pass {i}", e, c, bf16), check_same(f"pass {i} vs the first compiled", e, first, bf16)):
            worst = [max(w, d) for w, d in zip(worst, diff)]
        times["eager"].append(e[0])
        times["compile"].append(c[0])
        print(f"pass {i}: eager {e[0]:.3f} s, compile {c[0]:.3f} s, loss {e[1]:.6f}", flush=True)
    if len(calls) != args.repeats + 1:
        raise SystemExit(f"the compiled layers ran {len(calls)} times, not once per compiled pass ({args.repeats + 1})")
    summary = {side: common.stats(v[1:]) for side, v in times.items()}
    gain = summary["eager"]["median"] / summary["compile"]["median"]
    for side, s in summary.items():
        print(f"{side}: median {s['median']:.3f} s (min {s['min']:.3f}, max {s['max']:.3f}) over passes 2+")
    print(f"eager / compile: {gain:.3f}; compile paid back after {compile_s / max(1e-9, summary['eager']['median'] - summary['compile']['median']):.0f} passes"
          if gain > 1 else f"eager / compile: {gain:.3f} (compile is not faster)")
    print(f"check passed: losses within {worst[0]:.1e} relative, LoRA gradients within {worst[1]:.1e} of "
          f"{'their norm' if bf16 else 'their largest entry'}")
    path = common.write_result("ab_compile", {
        "machine": common.machine(peak), "setup": {"rows": ROWS, "seq": SEQ, "smoke": args.smoke, "dtype": args.dtype,
                                                    "torch_compile": "[training] compile: the packed forward's "
                                                                     "layers, dynamic=None, default mode"},
        "compile_seconds": compile_s, "cache_warm": cache_warm, "seconds": times, "summary": summary,
        "eager_over_compile": gain, "largest_difference": {"loss": worst[0], "gradients": worst[1]},
        "load_average": {"before": load_before}, "env_omp": os.environ.get("OMP_NUM_THREADS")},
        Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
