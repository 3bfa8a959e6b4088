"""The packed forward's matmul attention against the attention it replaced, interleaved in one process.

models/packed.py attends with `matmul_attention` (two batched products and a softmax, each key/value head
serving its query heads uncopied) for bf16 on a CPU up to 512 keys and whenever the model is set to eager
attention; before, such passes ran SDPA's flash kernel (the packed forward under SDPA; transformers' own
forward for unpadded rows) or transformers' eager forward (device.attention_for_length sets eager for short
bf16 RL passes, and the packed forward then stood aside). This script times both on the benchmarks' shapes:

  model    SmolLM2-135M-Instruct loaded in bf16 as [model] dtype = "bfloat16" loads it (--dtype float32 for the
           same question in fp32), LoRA r=8 / alpha 16 on q/k/v/o (fp32) with lora_B random, the lean MLP,
           train mode (common.retrograd_lora_model; --smoke: a tiny random Llama)
  passes   "sft": [2, 256] unpadded rows, loss on every token (bench_sft.py's pass), under SDPA;
           "grpo": bench_grpo.py's update (4 prompts x 4 completions) through Scorer.shared_prompt_sums
           under eager, as device.attention_for_length sets it for such short bf16 passes;
           "dpo": bench_dpo.py's step (2 pairs) under SDPA. Forward and backward each time
  sides    "matmul": the code as it is; "before": PackedForward.matmul_attention_for answering False and
           supported() refusing eager, which is the code before matmul attention
  order    A B A B ... flipped every pair, after a warm-up pair; median, min-max, pairs won
  check    the two sides' sums and LoRA gradients agree in every pair within the dtype's rounding, or the
           script stops. Sums: relative; gradients: the norm of the difference over the norm, all LoRA
           tensors together. In bf16 the gradients are rough either way: on the SFT pass both sides' LoRA
           gradients differed from the same model's fp32 ones by 4.2 % (matmul) and 4.6 % (before) of
           their norm, and by 3.6 % from each other; hence 1e-2 / 0.1 in bf16, 1e-4 / 1e-4 in fp32

    python benchmarks/ab_attention.py [--repeats 6] [--dtype bfloat16] [--only sft,grpo,dpo] [--out DIR]
    python benchmarks/ab_attention.py --smoke

Writes OUT/ab_attention_<timestamp>.json with the machine and each pass's seconds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_scoring_layout as layout  # noqa: E402
import common  # noqa: E402

TOLERANCES = {"bfloat16": (1e-2, 0.1), "float32": (1e-4, 1e-4)}  # (sums, gradients), relative


def benchmark_passes(vocab: int, smoke: bool) -> dict:
    """kind -> (the pass's data for layout.one_pass, the attention setting it runs under): bench_sft.py's SFT
    pass, bench_grpo.py's update under eager (as device.attention_for_length sets short bf16 RL passes),
    bench_dpo.py's step."""
    import torch
    torch.manual_seed(layout.SEED)
    ids = torch.randint(100, vocab, (2, 16 if smoke else 256))
    return {"sft": ({"input_ids": ids, "attention_mask": None, "labels": ids.clone()}, "sdpa"),
            "grpo": (layout.batch("grpo", 27, vocab), "eager"),
            "dpo": (layout.batch("dpo", 40, vocab), "sdpa")}


def relative_check(sum_tol: float, grad_tol: float):
    """A pair check for layout.ab: the sums' largest relative difference, and the gradients' difference as a
    share of their norm (all LoRA tensors together); stops the script above the tolerances."""
    def check(where: str, a: tuple, b: tuple) -> tuple[float, float]:
        sums = float(((a[1] - b[1]).abs() / b[1].abs().clamp(min=1.0)).max())
        grads = float(sum((g - b[2][n]).norm() ** 2 for n, g in a[2].items()) ** 0.5
                      / max(1e-30, float(sum(g.norm() ** 2 for g in b[2].values()) ** 0.5)))
        if sums > sum_tol or grads > grad_tol:
            raise SystemExit(f"{where}: the sides differ: sums by {sums:.2e} (tolerance {sum_tol}), "
                             f"gradients by {grads:.2e} of their norm (tolerance {grad_tol})")
        return sums, grads
    return check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=6, help="timed pairs per pass kind (default 6)")
    p.add_argument("--dtype", choices=sorted(TOLERANCES), default="bfloat16")
    p.add_argument("--only", default="sft,grpo,dpo", help="pass kinds (default all three)")
    common.add_output_arguments(p)
    args = p.parse_args()
    import torch
    from retrograd.models.logprobs import Scorer
    from retrograd.models.packed import PackedForward
    torch.set_num_threads(common.THREADS)
    common.warn_if_busy()
    peak = common.matmul_peak()
    model = common.retrograd_lora_model(args.smoke, layout.SEED, layout.BUILTIN, args.dtype)
    scorer, cfg = Scorer(model), model.config
    vocab = cfg.vocab_size
    matmul_for, supported = PackedForward.matmul_attention_for, PackedForward.supported

    def side(name: str, attention: str):
        def setup():
            cfg._attn_implementation = attention
            if name == "matmul":
                PackedForward.matmul_attention_for, PackedForward.supported = matmul_for, supported
            else:
                PackedForward.matmul_attention_for = lambda self, keys: False
                PackedForward.supported = lambda self: supported(self) and cfg._attn_implementation == "sdpa"
        return setup

    passes = benchmark_passes(vocab, args.smoke)
    check = relative_check(*TOLERANCES[args.dtype])

    results = {}
    for kind in args.only.split(","):
        data, attention = passes[kind]
        sides = {"matmul": side("matmul", attention), "before": side("before", attention)}
        results[kind] = {"attention_config": attention,
                         **layout.ab(model, scorer, data, sides, args.repeats, f"{kind} ({attention})", check)}
    PackedForward.matmul_attention_for, PackedForward.supported = matmul_for, supported
    path = common.write_result("ab_attention", {
        "machine": common.machine(peak), "setup": {"dtype": args.dtype, "smoke": args.smoke, "repeats": args.repeats},
        "passes": results}, Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
