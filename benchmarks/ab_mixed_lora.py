"""LoRA on bf16 weights computed in bf16 (models/mixed_lora.py) against PEFT's float32 LoRA path, interleaved
in one process.

With [model] dtype = "bfloat16" the LoRA weights stay float32. PEFT's forward casts each adapted layer's input
to float32 for the rank-r products and the sum back to bf16; retrograd's mixed-dtype fast path runs the layer
as one autograd node in bf16 (A and B cast down, the rank-r product added into the base output in place).
This script times both on the benchmarks' shapes. With --dtype float32 the node runs on float32 weights (where
it saves PEFT's [tokens, out] temporaries, not casts) against PEFT's forward on the same model:

  model    SmolLM2-135M-Instruct loaded in bf16 (--dtype) as [model] dtype loads it, LoRA r=8 / alpha 16 on
           q/k/v/o (float32) with lora_B random, the lean MLP, train mode (common.retrograd_lora_model;
           --smoke: a tiny random Llama)
  passes   "sft": [2, 256] unpadded rows, loss on every token (bench_sft.py's pass), under SDPA;
           "grpo": bench_grpo.py's update (4 prompts x 4 completions) through Scorer.shared_prompt_sums under
           eager, as device.attention_for_length sets it for such short bf16 passes;
           "dpo": bench_dpo.py's step (2 pairs) under SDPA. Forward and backward each time
  sides    "mixed": the code as it is; "peft": mixed_lora's fast path refused on every call, so every adapted
           layer runs PEFT's own forward, which is the code before it
  order    A B A B ... flipped every pair, after a warm-up pair; median, min-max, pairs won
  check    the two sides' sums and LoRA gradients agree in every pair, or the script stops: in bf16 sums within
           1e-2 relative, gradients within 0.1 of their norm (the norm of the difference over the norm, all LoRA
           tensors together). bf16 passes are that rough either way: the LoRA gradients of one bf16 SFT pass
           differ from the float32 model's by ~4 % of their norm (ab_attention.py). float32: 1e-4 both

    python benchmarks/ab_mixed_lora.py [--dtype float32] [--repeats 6] [--only sft,grpo,dpo] [--out DIR]
    python benchmarks/ab_mixed_lora.py --smoke

Writes OUT/ab_mixed_lora_<timestamp>.json with the machine, each pass's seconds and the largest differences.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_attention  # noqa: E402
import ab_scoring_layout as layout  # noqa: E402
import common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=sorted(ab_attention.TOLERANCES), default="bfloat16",
                   help="[model] dtype of both sides (default bfloat16)")
    p.add_argument("--repeats", type=int, default=6, help="timed pairs per pass kind (default 6)")
    p.add_argument("--only", default="sft,grpo,dpo", help="pass kinds (default all three)")
    common.add_output_arguments(p)
    args = p.parse_args()
    import torch
    from retrograd.models import mixed_lora
    from retrograd.models.logprobs import Scorer
    torch.set_num_threads(common.THREADS)
    common.warn_if_busy()
    peak = common.matmul_peak()
    sum_tol, grad_tol = ab_attention.TOLERANCES[args.dtype]
    model = common.retrograd_lora_model(args.smoke, layout.SEED, layout.BUILTIN, args.dtype)
    scorer, cfg = Scorer(model), model.config
    vocab = cfg.vocab_size
    fast_path_args = mixed_lora._fast_path_args
    taken = {"calls": 0}

    def counting(*a):
        found = fast_path_args(*a)
        taken["calls"] += found is not None
        return found

    def side(name: str, attention: str):
        def setup():
            cfg._attn_implementation = attention
            mixed_lora._fast_path_args = counting if name == "mixed" else (lambda *a: None)
        return setup

    passes = ab_attention.benchmark_passes(vocab, args.smoke)
    results = {}
    for kind in args.only.split(","):
        data, attention = passes[kind]
        taken["calls"] = 0
        sides = {"mixed": side("mixed", attention), "peft": side("peft", attention)}
        results[kind] = {"attention_config": attention,
                         **layout.ab(model, scorer, data, sides, args.repeats, f"{kind} ({attention})",
                                     ab_attention.relative_check(sum_tol, grad_tol))}
        if taken["calls"] == 0:  # the "mixed" side must really have run the fast path
            raise SystemExit(f"{kind}: the node's fast path was never taken")
        results[kind]["fast_path_calls"] = taken["calls"]
    mixed_lora._fast_path_args = fast_path_args
    path = common.write_result("ab_mixed_lora", {
        "machine": common.machine(peak), "setup": {"dtype": args.dtype, "smoke": args.smoke, "repeats": args.repeats},
        "passes": results}, Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
