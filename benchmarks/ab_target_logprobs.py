"""The service's per-datum log-probabilities (Scorer.target_logprobs) with every one-target datum in one
fused-head call, against one head call per datum (as it was until 2026-12-07), on a CPU.

A forward_backward request of `retrograd serve` scores its datums in one right-padded pass; the head then
ran once per datum. Each such call reads the whole [V, H] head weight for its few rows (a 49k x 576 float32
head is 113 MB: 64 datums read it 64 times) and runs the [C, H] x [H, V] product far below the matmul peak,
and each datum's slice of the [B, T, H] grid costs its backward a [B, T, H] zero fill. Now the datums' real
positions (the packed forward's own states) go through the head's chunks together.

Sides, interleaved A B A B ... (the order flipped every pair, after a warm-up pair), SmolLM2 + LoRA r=8 on
q/k/v/o (common.retrograd_lora_model), fp32, SDPA, forward + backward of a weighted sum of the log-probs:

  shared     Scorer.target_logprobs as it is
  per_datum  the earlier code: Scorer.hidden's grid, linear_token_logprobs on each datum's slice

Cases (datums x tokens): 4 x 255 (bench_service.py's step), 8 x 100-300, 32 x 20-60, 64 x 8-24 (RL-like
requests). The two sides' log-probs must agree within LOGPROB_TOL and the LoRA gradients within
GRAD_TOL of their largest entry in every pair (another head call size may round the last bits
differently), or the script stops.

    python benchmarks/ab_target_logprobs.py [--repeats 8] [--out DIR]
    python benchmarks/ab_target_logprobs.py --smoke

Writes OUT/ab_target_logprobs_<timestamp>.json with the machine, each side's seconds and the medians.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_scoring_layout as layout  # noqa: E402
import common  # noqa: E402

CASES = {"4x255": (4, 255, 255), "8x100-300": (8, 100, 300), "32x20-60": (32, 20, 60), "64x8-24": (64, 8, 24)}
SMOKE_CASES = {"4x15": (4, 15, 15), "16x2-9": (16, 2, 9)}
LOGPROB_TOL, GRAD_TOL = 1e-4, 1e-3


def per_datum(scorer, rows):
    """Scorer.target_logprobs before 2026-12-07 (one-target datums): one head call per datum."""
    from retrograd.models.fused_head import linear_token_logprobs
    from retrograd.models.logprobs import datum_grid
    ids, mask = datum_grid(rows)
    hidden = scorer.hidden({"input_ids": ids, "attention_mask": mask})
    return [linear_token_logprobs(hidden[r, :len(tokens)], scorer.head.weight, targets)
            for r, (tokens, targets) in enumerate(rows)]


def datums(count: int, shortest: int, longest: int, vocab: int, seed: int):
    import torch
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in torch.randint(shortest, longest + 1, (count,), generator=gen).tolist():
        ids = torch.randint(100, vocab, (n + 1,), generator=gen)
        rows.append((ids[:-1].tolist(), ids[1:].clone()))  # a Tinker datum: the row less its last token
    return rows


def one_pass(model, side, rows):
    from retrograd.models.logprobs import Scorer
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    lps = side(Scorer(model), rows)
    sum(-(lp * 1e-3).sum() for lp in lps).backward()
    seconds = time.perf_counter() - start
    return seconds, [lp.detach() for lp in lps], {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.requires_grad and p.grad is not None}


def check(case: str, a: tuple, b: tuple) -> tuple[float, float]:
    lp = max(float((x - y).abs().max()) for x, y in zip(a[1], b[1]))
    grad = max(float((g - b[2][n]).abs().max() / max(1e-12, float(b[2][n].abs().max()))) for n, g in a[2].items())
    if not a[2] or lp > LOGPROB_TOL or grad > GRAD_TOL:
        raise SystemExit(f"{case}: the sides differ: log-probs by {lp:.2e} (tolerance {LOGPROB_TOL}), gradients by "
                         f"{grad:.2e} of their largest entry (tolerance {GRAD_TOL}), or nothing was trained")
    return lp, grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=8, help="timed pairs per case (default 8)")
    common.add_output_arguments(p)
    args = p.parse_args()
    model, peak = common.in_process_lora_model(args.smoke, layout.SEED, layout.BUILTIN)
    from retrograd.models.logprobs import Scorer
    sides = {"shared": Scorer.target_logprobs, "per_datum": per_datum}
    results = {}
    for i, (case, shape) in enumerate((SMOKE_CASES if args.smoke else CASES).items()):
        rows = datums(*shape, model.config.vocab_size, seed=i)
        times, worst = {name: [] for name in sides}, [0.0, 0.0]
        for pair in range(args.repeats + 1):  # pair 0 is warm-up
            done = {}
            for name in (list(sides) if pair % 2 == 0 else list(sides)[::-1]):
                done[name] = one_pass(model, sides[name], rows)
                times[name].append(done[name][0])
            worst = [max(w, d) for w, d in zip(worst, check(f"{case}, pair {pair}", done["shared"], done["per_datum"]))]
        summary = {name: common.stats(v[1:]) for name, v in times.items()}
        ratio = summary["shared"]["median"] / summary["per_datum"]["median"]
        faster = sum(a < b for a, b in zip(times["shared"][1:], times["per_datum"][1:]))
        print(f"{case}: shared {summary['shared']['median']:.3f} s, per_datum {summary['per_datum']['median']:.3f} s; "
              f"shared / per_datum {ratio:.3f}; shared faster in {faster} of {args.repeats} pairs", flush=True)
        results[case] = {"datums": sum(1 for _ in rows), "tokens": sum(len(t) for t, _ in rows), "seconds": times,
                         "summary": summary, "shared_over_per_datum": ratio, "shared_faster_pairs": faster,
                         "largest_difference": {"logprobs": worst[0], "gradients": worst[1]}}
    path = common.write_result("ab_target_logprobs", {
        "machine": common.machine(peak), "setup": {"dtype": "float32", "smoke": args.smoke, "repeats": args.repeats,
                                                   "lora": "r=8 on q/k/v/o", "attention": "sdpa"},
        "results": results}, Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
