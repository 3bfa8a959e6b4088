"""float32 training products through oneDNN against MKL (torch's default), on this CPU (models/cpu_gemm.py).

Two measurements, each interleaved A B A B ... (the order flipped every pair, after a warm-up pair):

  product  each GEMM shape of a SmolLM2 LoRA pass alone, as the pass calls it: x W^T (forward) and g W (input
           gradient) at 16, 50, 128 and 512 rows for the layers' 576 -> 1536, 1536 -> 576, 576 -> 576 and
           576 -> 192 projections, and the head's [255, 576] x [576, 49k] logits and [255, 49k] x [49k, 576]
           input gradient. "onednn" is cpu_gemm.linear with oneDNN, "mkl" torch's product; the two outputs must
           agree to 1e-5 of their largest entry. Reports GFLOP/s.
  passes   SmolLM2 + LoRA r=8 on q/k/v/o (common.retrograd_lora_model: its nn.Linear layers routed as `retrograd
           train` routes them), forward + backward of bench_sft.py's [2, 256] SFT pass, bench_dpo.py's step and
           bench_grpo.py's update (ab_attention.benchmark_passes, float32): the library answered by
           cpu_gemm.fp32_gemm_library switched between pairs. Sums and gradients are checked against each other
           within ab_scoring_layout's tolerances (the libraries round differently).

The pass A/B needs a CPU where oneDNN is the chosen library (or RETROGRAD_FP32_GEMM=onednn), so that the
model's layers are routed at load.

    python benchmarks/ab_cpu_gemm.py [--repeats 12] [--only product,sft,dpo,grpo] [--out DIR]
    python benchmarks/ab_cpu_gemm.py --smoke

Writes OUT/ab_cpu_gemm_<timestamp>.json with the machine, each measurement's seconds and medians.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_attention  # noqa: E402
import ab_scoring_layout as layout  # noqa: E402
import common  # noqa: E402

LAYER_ROWS = (16, 50, 128, 512)
LAYER_SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))  # (in, out) of SmolLM2's projections


def product_cases(vocab: int, hidden: int, smoke: bool) -> list[tuple[str, int, int, int, bool]]:
    """(label, rows, in, out, input_gradient) of every product measured."""
    rows, shapes = ((16, 128), ((64, 128),)) if smoke else (LAYER_ROWS, LAYER_SHAPES)
    cases = [(f"{m} rows {k}->{n} {'g W' if grad else 'x W^T'}", m, k, n, grad)
             for m in rows for k, n in shapes for grad in (False, True)]
    head_rows = 130 if smoke else 255
    return cases + [(f"head logits {head_rows} rows", head_rows, hidden, vocab, False),
                    (f"head input gradient {head_rows} rows", head_rows, vocab, hidden, False)]


def product_ab(vocab: int, hidden: int, repeats: int, smoke: bool) -> dict:
    import torch
    import retrograd.models.cpu_gemm as cpu_gemm
    results = {}
    for label, m, k, n, grad in product_cases(vocab, hidden, smoke):
        gen = torch.Generator().manual_seed(m * 7 + k)
        x = torch.randn(m, k, generator=gen)
        # x W^T: a layer's weight [n, k]; g W: the weight of a layer from n to k features, [k, n], as the
        # transposed view the input gradient passes (cpu_gemm.linear(g, W.t()))
        weight = torch.randn(k, n, generator=gen).t() if grad else torch.randn(n, k, generator=gen)
        sides = {"onednn": lambda: cpu_gemm._onednn_linear(x, weight), "mkl": lambda: x @ weight.t()}
        worst = [0.0]

        def check(outputs, label=label):
            diff = float((outputs["onednn"] - outputs["mkl"]).abs().max() / outputs["mkl"].abs().max())
            worst[0] = max(worst[0], diff)
            if diff > 1e-5:
                raise SystemExit(f"{label}: oneDNN's product differs from MKL's by {diff:.2e} of its largest entry")
        result = common.interleaved_products(sides, repeats, 2 * m * k * n, check)
        routed = cpu_gemm.uses_onednn(x, weight) if cpu_gemm.fp32_gemm_library() == "onednn" else None
        where = "" if routed is None else "; routed to oneDNN" if routed else "; stays MKL"
        gflops = result["gflops"]
        print(f"product, {label}: oneDNN {gflops['onednn']:.0f} GFLOP/s, MKL {gflops['mkl']:.0f}; oneDNN faster in "
              f"{result['onednn_faster_pairs']} of {repeats} pairs{where}", flush=True)
        results[label] = {**result, "routed": routed, "largest_difference": worst[0]}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=12, help="timed pairs per measurement (default 12)")
    p.add_argument("--only", default="product,sft,dpo,grpo", help="measurements (default all four)")
    common.add_output_arguments(p)
    args = p.parse_args()
    model, peak = common.in_process_lora_model(args.smoke, layout.SEED, layout.BUILTIN)
    import retrograd.models.cpu_gemm as cpu_gemm
    from retrograd.models.logprobs import Scorer
    scorer, cfg = Scorer(model), model.config
    chosen = cpu_gemm.fp32_gemm_library()
    wanted = args.only.split(",")
    results = {}
    if "product" in wanted:
        results["product"] = product_ab(cfg.vocab_size, cfg.hidden_size, args.repeats, args.smoke)
    passes = ab_attention.benchmark_passes(cfg.vocab_size, args.smoke)
    pass_kinds = [k for k in wanted if k in passes]
    if pass_kinds and chosen != "onednn":
        raise SystemExit(f"this CPU keeps MKL ({cpu_gemm.ENV} unset or mkl): the model's layers were not routed, "
                         "so a pass A/B would compare MKL with itself; run with "
                         f"{cpu_gemm.ENV}=onednn to measure oneDNN here")

    def side(name: str):
        def setup():
            cpu_gemm.fp32_gemm_library = lambda: name
        return setup

    try:
        for kind in pass_kinds:
            data, _ = passes[kind]
            results[kind] = layout.ab(model, scorer, data, {"onednn": side("onednn"), "mkl": side("mkl")},
                                      args.repeats, f"{kind} pass")
    finally:
        cpu_gemm.fp32_gemm_library = lambda: chosen
    path = common.write_result("ab_cpu_gemm", {
        "machine": common.machine(peak), "setup": {"dtype": "float32", "smoke": args.smoke, "repeats": args.repeats,
                                                   "chosen_library": chosen},
        "results": results}, Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
