"""The fused head's float32 logits in vocabulary blocks (fused_head.logits_into) against one product, on a CPU.

Two measurements, each interleaved A B A B ... (the order flipped every pair, after a warm-up pair):

  product  the head's [C, 576] x [576, 49k] logits product alone, for chunks of 128, 255 (an SFT pass's
           rows: two chunks of 255), 384 and 510 rows: "blocks" (logits_into as it is) against "single"
           (one product over the whole vocabulary into the same buffer, with the same GEMM library:
           models/cpu_gemm.py). The two outputs must be equal bit for bit, or the script stops.
           Reports GFLOP/s.
  passes   SmolLM2 + LoRA r=8 on q/k/v/o (common.retrograd_lora_model), forward + backward of bench_sft.py's
           [2, 256] SFT pass, bench_dpo.py's step and bench_grpo.py's update (ab_attention.benchmark_passes,
           under SDPA: float32): "blocks" against "single" (fused_head.logits_block_columns answering the
           whole vocabulary). Sums and gradients must be equal bit for bit in every pair, or the script stops.

    python benchmarks/ab_head_blocks.py [--repeats 12] [--only product,sft,dpo,grpo] [--out DIR]
    python benchmarks/ab_head_blocks.py --smoke

Writes OUT/ab_head_blocks_<timestamp>.json with the machine, each measurement's seconds and medians.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_attention  # noqa: E402
import ab_scoring_layout as layout  # noqa: E402
import common  # noqa: E402

PRODUCT_ROWS = (128, 255, 384, 510)


def bit_equal(where: str, a: tuple, b: tuple) -> tuple[float, float]:
    """layout.ab's pair check: the two sides' sums and gradients equal bit for bit."""
    import torch
    if not torch.equal(a[1], b[1]) or a[2].keys() != b[2].keys() \
            or not all(torch.equal(g, b[2][n]) for n, g in a[2].items()):
        raise SystemExit(f"{where}: the blocked logits changed the pass's sums or gradients")
    return 0.0, 0.0


def product_ab(weight, repeats: int) -> dict:
    import torch
    from retrograd.models.cpu_gemm import mm_into
    from retrograd.models.fused_head import logits_into
    vocab, hidden = weight.shape
    results = {}
    for rows in PRODUCT_ROWS:
        h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        out, single = torch.empty(rows, vocab), torch.empty(rows, vocab)
        sides = {"blocks": lambda: logits_into(h, weight, out), "single": lambda: mm_into(h, weight.t(), single)}

        def check(outputs, rows=rows):
            if not torch.equal(outputs["blocks"], outputs["single"]):
                raise SystemExit(f"{rows} rows: the blocked logits differ from the single product")
        result = results[str(rows)] = common.interleaved_products(sides, repeats, 2 * rows * hidden * vocab, check)
        gflops = result["gflops"]
        print(f"product, {rows} rows: blocks {gflops['blocks']:.0f} GFLOP/s, single {gflops['single']:.0f}; "
              f"blocks faster in {result['blocks_faster_pairs']} of {repeats} pairs", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=12, help="timed pairs per measurement (default 12)")
    p.add_argument("--only", default="product,sft,dpo,grpo", help="measurements (default all four)")
    common.add_output_arguments(p)
    args = p.parse_args()
    model, peak = common.in_process_lora_model(args.smoke, layout.SEED, layout.BUILTIN)
    from retrograd.models import fused_head
    from retrograd.models.logprobs import Scorer
    scorer, cfg = Scorer(model), model.config
    blocked = fused_head.logits_block_columns

    def side(name: str):
        def setup():
            fused_head.logits_block_columns = blocked if name == "blocks" else (lambda rows, vocab: vocab)
        return setup

    results = {}
    wanted = args.only.split(",")
    if "product" in wanted:
        results["product"] = product_ab(scorer.head.weight.detach(), args.repeats)
    passes = ab_attention.benchmark_passes(cfg.vocab_size, args.smoke)
    for kind in (k for k in wanted if k in passes):
        data, _ = passes[kind]
        results[kind] = layout.ab(model, scorer, data, {"blocks": side("blocks"), "single": side("single")},
                                  args.repeats, f"{kind} pass", bit_equal)
    fused_head.logits_block_columns = blocked
    path = common.write_result("ab_head_blocks", {
        "machine": common.machine(peak), "setup": {"dtype": "float32", "smoke": args.smoke, "repeats": args.repeats},
        "results": results}, Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
