"""The scoring pass's two layout choices, each side against the other, interleaved in one process.

`Scorer._shared_prompt_hidden` (src/retrograd/models/logprobs.py) decides two things for a batch of
prompts and their completions (a DPO step's pairs, a GRPO update's groups):

  rows     "prompt-led": each prompt leads the packed row of its completions, one pass, when they fit
           one row (`prompts_lead_rows`); against "cached": the prompts in a pass of their own whose
           KV cache the completion rows gather (what every batch did before, and what a prompt whose
           completions span several rows still does)
  prefix   the prompts' common prefix (a chat template's system prompt) in a pass of its own, once,
           against in every row, as a function of the prompt tokens it saves; the scorer runs it
           apart from MIN_SCORED_PREFIX_SAVING saved tokens
  packing  the rows' real tokens only through every layer but attention (models/packed.py), against
           transformers' forward over the padded rows: the DPO and GRPO shapes (a GRPO update's groups
           differ in length) and an SFT pass of 6 right-padded rows of 40-86 tokens (23 % padding)

This script measures both on the shapes the benchmarks train, so the thresholds can be measured again
on the next CPU:

  model    SmolLM2-135M-Instruct (fp32), LoRA r=8 / alpha 16 on q/k/v/o with lora_B random (so every
           gradient is checked), the lean MLP, train mode (common.retrograd_lora_model; --smoke: a tiny
           random Llama)
  pass     Scorer.shared_prompt_sums (forward through the fused head) and backward of their sum;
           random tokens with the lengths of bench_dpo.py's step (2 pairs: prompts ~25 tokens after the
           prefix, sides ~72) and bench_grpo.py's update (4 prompts x 4 completions of 18-32 tokens)
  order    A B A B ... with the order flipped every pair, after a warm-up pair; median, min-max
  check    both sides' sums (1e-4 relative) and every LoRA gradient (1e-3 of its largest entry) agree
           in every pair, or the script stops: the layouts must compute the same thing

Run from the repository root on an IDLE machine:

    python benchmarks/ab_scoring_layout.py [--repeats 5] [--only rows,prefix,packing] [--out benchmarks/results]
    python benchmarks/ab_scoring_layout.py --smoke       # tiny random Llama, $TMPDIR/bench_out

Writes OUT/ab_scoring_layout_<timestamp>.json with the machine and each pass's seconds.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BUILTIN = "smollm2-135m-instruct"
SEED = 0
SUM_TOL, GRAD_TOL = 1e-4, 1e-3  # float32 sums in another order; a changed piece of work moves them far more
# (shape, common prefix tokens): the prefix pass saves prefix x (prompts - 1) prompt tokens
PREFIX_CASES = [("dpo", 26), ("dpo", 40), ("dpo", 56), ("dpo", 80), ("grpo", 10), ("grpo", 16), ("grpo", 27)]


def batch(kind: str, prefix: int, vocab: int, seed: int = SEED) -> tuple[list, list, list]:
    """(prompts, completions, owner) of a DPO step (2 pairs) or a GRPO update (4 groups of 4)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    system = tokens(prefix)
    if kind == "dpo":
        prompts = [system + tokens(25), system + tokens(24)]
        return prompts, [tokens(74), tokens(71), tokens(73), tokens(70)], [0, 0, 1, 1]
    prompts = [system + tokens(rng.randrange(15, 25)) for _ in range(4)]
    return prompts, [tokens(rng.randrange(18, 33)) for _ in range(16)], [i // 4 for i in range(16)]


def sft_rows(vocab: int, seed: int = SEED) -> dict:
    """An SFT pass of rows of different lengths, right-padded as training.micro_batch = 512 packs them: 6
    rows of 40-86 tokens (the range of the quickstart's builtin:chat-sft rows), loss on every token."""
    import torch
    rng = random.Random(seed)
    lengths = [86, 71, 53, 80, 40, 65]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attention = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.tensor([rng.randrange(100, vocab) for _ in range(n)])
        labels[r, :n], attention[r, :n] = ids[r, :n], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attention}


def one_pass(model, scorer, data) -> tuple[float, "torch.Tensor", dict]:
    import torch
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    if isinstance(data, dict):  # an SFT pass: the summed loss of a right-padded batch
        sums = scorer.loss_sum(data)[None]
    else:
        prompts, completions, owner = data
        sums = scorer.shared_prompt_sums(prompts, completions, owner, [[True] * len(c) for c in completions], 0)
    sums.sum().backward()
    seconds = time.perf_counter() - t
    grads = {n: p.grad.detach().to(torch.float64) for n, p in model.named_parameters()
             if p.requires_grad and p.grad is not None}
    if not grads:
        raise SystemExit("no gradients reached the adapter: nothing was trained")
    return seconds, sums.detach().double(), grads


def check_same(where: str, a: tuple, b: tuple) -> tuple[float, float]:
    sums = float(((a[1] - b[1]).abs() / b[1].abs().clamp(min=1.0)).max())
    grad = max(float((g - b[2][n]).abs().max() / max(1e-12, float(g.abs().max()))) for n, g in a[2].items())
    if sums > SUM_TOL or grad > GRAD_TOL:
        raise SystemExit(f"{where}: the two layouts differ: sums by {sums:.2e} (tolerance {SUM_TOL}), "
                         f"gradients by {grad:.2e} of their largest entry (tolerance {GRAD_TOL})")
    return sums, grad


def ab(model, scorer, data, sides: dict, repeats: int, label: str, check=None) -> dict:
    """sides: name -> a function that sets the layout up; check(where, a, b) -> (sums, gradients) differences,
    stopping the script above its tolerances (default check_same). -> per side the seconds of each pass."""
    check = check or check_same
    times = {name: [] for name in sides}
    worst = [0.0, 0.0]
    names = list(sides)
    for i in range(repeats + 1):  # pass 0 of each side is warm-up
        order = names if i % 2 == 0 else names[::-1]
        done = {}
        for name in order:
            sides[name]()
            done[name] = one_pass(model, scorer, data)
            times[name].append(done[name][0])
        worst = [max(w, d) for w, d in zip(worst, check(f"{label}, pair {i}", *done.values()))]
    summary = {name: common.stats(v[1:]) for name, v in times.items()}
    a, b = names
    ratio = summary[b]["median"] / summary[a]["median"]
    faster = sum(x < y for x, y in zip(times[a][1:], times[b][1:]))
    print(f"{label}: {a} {summary[a]['median']:.3f} s, {b} {summary[b]['median']:.3f} s; {b} / {a} {ratio:.3f}; "
          f"{a} faster in {faster} of {repeats} pairs", flush=True)
    return {"seconds": times, "summary": summary, f"{b}_over_{a}": ratio, f"{a}_faster_pairs": faster,
            "largest_difference": {"sums": worst[0], "gradients": worst[1]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed pairs per comparison (default 5)")
    common.add_output_arguments(p)
    p.add_argument("--only", default="rows,prefix,packing", help="comparisons to run (default all three)")
    args = p.parse_args()
    only = set(args.only.split(","))
    if not only <= {"rows", "prefix", "packing"}:
        raise SystemExit(f"--only: rows, prefix or packing, not {args.only}")
    common.start_like_the_cli()
    import torch
    import retrograd.models.logprobs as logprobs
    torch.set_num_threads(common.THREADS)
    common.warn_if_busy()
    peak = common.matmul_peak()
    load_before = common.load_average()
    model = common.retrograd_lora_model(args.smoke, SEED, BUILTIN)
    scorer, vocab = logprobs.Scorer(model), min(40_000, model.config.vocab_size)
    lead_rows, min_saving, packer = logprobs.prompts_lead_rows, logprobs.MIN_SCORED_PREFIX_SAVING, scorer.packer

    def setup(lead: bool, prefix_pass: bool | None = None):
        def apply():
            logprobs.prompts_lead_rows = lead_rows if lead else (lambda rows: False)
            logprobs.MIN_SCORED_PREFIX_SAVING = min_saving if prefix_pass is None else (1 if prefix_pass else 10**9)
        return apply

    def packing(on: bool):
        def apply():
            scorer.packer = packer if on else None
        return apply

    results = {"rows": {}, "prefix": {}, "packing": {}}
    try:
        for kind in ("dpo", "grpo", "sft") if "packing" in only else ():
            data = sft_rows(vocab) if kind == "sft" else batch(kind, 27, vocab)
            results["packing"][kind] = ab(model, scorer, data, {"packed": packing(True), "padded": packing(False)},
                                          args.repeats, f"packing, {kind} shape")
        for kind in ("dpo", "grpo") if "rows" in only else ():
            data = batch(kind, 27, vocab)
            results["rows"][kind] = ab(model, scorer, data, {"prompt_led": setup(True), "cached": setup(False)},
                                       args.repeats, f"rows, {kind} shape")
        for kind, prefix in PREFIX_CASES if "prefix" in only else ():
            data = batch(kind, prefix, vocab)
            saved = prefix * (len(data[0]) - 1)
            r = ab(model, scorer, data, {"prefix_pass": setup(True, True), "in_rows": setup(True, False)},
                   args.repeats, f"prefix, {kind} shape, {prefix}-token prefix ({saved} tokens saved)")
            results["prefix"][f"{kind}_{prefix}"] = {"shape": kind, "prefix_tokens": prefix, "saved_tokens": saved,
                                                     "scorer_runs_it_apart": saved >= min_saving, **r}
    finally:
        logprobs.prompts_lead_rows, logprobs.MIN_SCORED_PREFIX_SAVING = lead_rows, min_saving
        scorer.packer = packer
    path = common.write_result("ab_scoring_layout", {
        "machine": common.machine(peak), "setup": {"smoke": args.smoke, "repeats": args.repeats, "only": sorted(only),
                                                    "min_scored_prefix_saving": min_saving},
        "results": results, "load_average": {"before": load_before, "after": common.load_average()}},
        Path(args.out) if args.out else None, smoke=args.smoke)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
