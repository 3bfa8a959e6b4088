"""Markdown tables from the benchmarks' result files, and the README sections they fill.

Reads the newest benchmarks/results/<kind>_<YYYYMMDD_HHMMSS>.json of each kind (sft_lora, sft_lora_bf16, sft_full,
dpo, service from common.write_result; grpo and distill in their own older layout; smoke results,
named <kind>_smoke_..., are never picked) and prints, per kind, a line naming the machine, its CPU
and measured matmul peak, then a table of medians with min-max over the interleaved runs and the
ratios between sides.

    python benchmarks/report.py                       # print every table
    python benchmarks/report.py sft_lora dpo          # some of them
    python benchmarks/report.py --write benchmarks/README.md
    python benchmarks/report.py summary --write README.md   # the headline table of the top README

--write replaces the text between `<!-- report:KIND -->` and `<!-- /report:KIND -->` in that file
with KIND's table (a kind with no result yet says so); nothing else in the file changes.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NUM, PCT = "{:.{p}f}", "pct"

# per kind: title, side (key, label) columns, ratio pairs (a / b of the medians), rows (metric, label, decimals)
KINDS = {
    "sft_lora": {
        "title": "SFT LoRA, retrograd vs TRL SFTTrainer",
        "sides": [("retrograd", "retrograd"), ("trl", "TRL")], "pairs": [("retrograd", "trl")],
        "rows": [("tokens_per_s", "tokens/s, steps 2+", 1), ("step_s", "seconds per step, steps 2+", 2),
                 ("step1_s", "step 1 s (warm-up)", 2), ("achieved_gflops", "matmul GFLOP/s achieved", 0),
                 ("machine_share", "% of the fp32 matmul peak", PCT), ("peak_rss_mb", "peak RSS MB", 0),
                 ("peak_rss_after_load_mb", "peak RSS after model load MB", 0), ("load_s", "model load s", 1)]},
    "dpo": {
        "title": "DPO LoRA, retrograd vs TRL DPOTrainer (reference in every step, and precomputed)",
        "sides": [("retrograd", "retrograd"), ("trl", "TRL"), ("trl_precompute", "TRL precompute")],
        "pairs": [("retrograd", "trl"), ("retrograd", "trl_precompute")],
        "rows": [("pairs_per_s", "pairs/s, steps 2+", 3),
                 ("pairs_per_s_end_to_end", "pairs/s end to end (reference + steps)", 3),
                 ("pairs_per_s_wall", "pairs/s wall (reference + whole loop)", 3),
                 ("step_s", "seconds per step, steps 2+", 2), ("reference_s", "reference scoring s (once)", 1),
                 ("outside_steps_s", "loop time outside the steps s", 2), ("peak_rss_mb", "peak RSS MB", 0),
                 ("peak_rss_after_load_mb", "peak RSS after model load MB", 0)]},
    "service": {
        "title": "SFT LoRA through the service (tinker SDK -> retrograd serve) vs retrograd train",
        "sides": [("retrograd", "retrograd train"), ("service", "SDK -> serve")], "pairs": [("service", "retrograd")],
        "rows": [("tokens_per_s", "tokens/s, steps 2+", 1), ("step_s", "seconds per step, steps 2+", 3),
                 ("peak_rss_mb", "peak RSS MB (server for the service)", 0)]},
    "grpo": {
        "title": "GRPO LoRA, retrograd vs TRL GRPOTrainer",
        "sides": [("retrograd", "rg fp32"), ("trl", "TRL fp32"), ("retrograd_bf16", "rg bf16"), ("trl_bf16", "TRL bf16")],
        "pairs": [("retrograd", "trl"), ("retrograd_bf16", "trl_bf16")],
        "rows": [("s_per_update", "seconds per update", 2), ("sampling_s", "sampling s", 2),
                 ("training_s", "training s", 2), ("sampling_tokens_per_s", "sampling tokens/s", 0),
                 ("sampling_share_of_matmul_peak", "sampling share of the matmul peak", PCT),
                 ("peak_rss_mb", "peak RSS MB", 0)]},
    "distill": {
        "title": "On-policy distillation, retrograd vs TRL DistillationTrainer",
        "sides": [("retrograd", "retrograd"), ("trl", "TRL")], "pairs": [("retrograd", "trl")],
        "rows": [("s_per_update", "seconds per update", 2), ("sampling_s", "sampling s", 2),
                 ("training_s", "training s", 2), ("s_per_1k_completion_tokens", "seconds per 1k completion tokens", 1),
                 ("sampling_tokens_per_s", "sampling tokens/s", 0), ("peak_rss_mb", "peak RSS MB", 0)]},
}
KINDS["sft_full"] = {**KINDS["sft_lora"], "title": "SFT full fine-tune, retrograd vs TRL SFTTrainer"}
KINDS["sft_lora_bf16"] = {**KINDS["sft_lora"], "title": "SFT LoRA with bf16 weights, retrograd vs TRL SFTTrainer",
                          "rows": [(m, "% of the bf16 matmul peak" if m == "machine_share" else label, d)
                                   for m, label, d in KINDS["sft_lora"]["rows"]]}
KINDS["sft_lora_compile"] = {**KINDS["sft_lora"],
                             "title": "SFT LoRA, both sides torch.compile'd, retrograd vs TRL SFTTrainer",
                             "sides": [("retrograd", "retrograd, compile"), ("trl", "TRL, torch_compile"),
                                       ("retrograd_eager", "retrograd, eager")],
                             "pairs": [("retrograd", "trl"), ("retrograd", "retrograd_eager")]}
KINDS["sft_lora_bf16_compile"] = {**KINDS["sft_lora_compile"], "rows": KINDS["sft_lora_bf16"]["rows"],
                                  "title": "SFT LoRA with bf16 weights, both sides torch.compile'd, retrograd vs TRL"}
KINDS["sft_full_compile"] = {**KINDS["sft_lora_compile"],
                             "title": "SFT full fine-tune, both sides torch.compile'd, retrograd vs TRL SFTTrainer"}

# the summary (top-level README): per benchmark, its headline comparisons
# (label, kind, ours, theirs, metric, higher_is_better)
HEADLINES = [
    ("SFT LoRA, tokens/s", "sft_lora", "retrograd", "trl", "tokens_per_s", True),
    ("SFT LoRA bf16, tokens/s", "sft_lora_bf16", "retrograd", "trl", "tokens_per_s", True),
    ("SFT LoRA compiled (both sides), tokens/s", "sft_lora_compile", "retrograd", "trl", "tokens_per_s", True),
    ("SFT LoRA bf16 compiled (both sides), tokens/s", "sft_lora_bf16_compile", "retrograd", "trl", "tokens_per_s", True),
    ("SFT full fine-tune, tokens/s", "sft_full", "retrograd", "trl", "tokens_per_s", True),
    ("SFT full fine-tune compiled (both sides), tokens/s", "sft_full_compile", "retrograd", "trl", "tokens_per_s", True),
    ("DPO LoRA, pairs/s per step", "dpo", "retrograd", "trl", "pairs_per_s", True),
    ("DPO LoRA, pairs/s end to end (1 epoch, reference included)", "dpo", "retrograd", "trl",
     "pairs_per_s_end_to_end", True),
    ("DPO LoRA vs TRL precompute_ref_log_probs, pairs/s end to end", "dpo", "retrograd", "trl_precompute",
     "pairs_per_s_end_to_end", True),
    ("GRPO LoRA fp32, seconds per update", "grpo", "retrograd", "trl", "s_per_update", False),
    ("GRPO LoRA bf16, seconds per update", "grpo", "retrograd_bf16", "trl_bf16", "s_per_update", False),
    ("On-policy distillation, seconds per update", "distill", "retrograd", "trl", "s_per_update", False),
    ("Service (SDK -> serve) vs retrograd train, tokens/s", "service", "service", "retrograd", "tokens_per_s", True),
]


def render_summary(folder: Path = RESULTS) -> str:
    """One table over every benchmark's newest result on each CPU met (CPUs of one model name can
    differ in silicon: cpu_label): the headline metric of both sides (median), how many times faster
    ours is, the peak-RSS ratio, the CPU and the result file."""
    lines = ["| comparison | ours | theirs | speed-up | peak RSS ours / theirs | CPU, fp32 matmul peak | result |",
             "|---|---|---|---|---|---|---|"]
    for label, kind, ours, theirs, metric, higher in HEADLINES:
        found = newest_per_cpu(kind, (ours, theirs), folder)
        if not found:
            lines.append(f"| {label} | - | - | - | - | - | no result yet |")
        for path, r in found:
            try:
                a, b = r["summary"][ours][metric]["median"], r["summary"][theirs][metric]["median"]
                speed = a / b if higher else b / a
                ra, rb = (r["summary"][k].get("peak_rss_mb", {}).get("median") for k in (ours, theirs))
                m = r.get("machine") or {}
                peak = (m.get("matmul_gflops") or {}).get("fp32") or r.get("matmul_gflops")
                cpu = cpu_label(r) + (f", {peak:.0f} GFLOP/s" if peak else "")
                digits = 1 if b >= 100 else 2 if b >= 10 else 3
                lines.append(f"| {label} | {a:.{digits}f} | {b:.{digits}f} | **{speed:.2f}×** | "
                             f"{f'{ra / rb:.2f}×' if ra and rb else '-'} | {cpu} | `{path.name}` |")
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                lines.append(f"| {label} | - | - | - | - | - | `{path.name}`: {type(e).__name__} |")
    return "\n".join(lines)


def cpu_name(r: dict) -> str:
    """The CPU's model name as the result recorded it, "(R)" marks left out."""
    m = r.get("machine") or {}
    return (m.get("cpu") or r.get("cpu") or "?").replace("(R)", "")


def cpu_label(r: dict) -> str:
    """The CPU as far as speed goes: its model name and its widest vector unit / native bf16 (two
    "AMD EPYC" machines here differ: one with AVX-512 and bf16, one with AVX2 only)."""
    flags = (r.get("machine") or {}).get("flags") or {}
    name = cpu_name(r)
    if not flags:
        return name
    unit = "AVX-512" if flags.get("avx512f") else "AVX2" if flags.get("avx2") else "no AVX2"
    bf16 = ", AMX bf16" if flags.get("amx_bf16") else ", bf16" if flags.get("avx512_bf16") else ""
    return f"{name} ({unit}{bf16})"


def newest_per_cpu(kind: str, sides: tuple, folder: Path = RESULTS) -> list[tuple[Path, dict]]:
    """The newest result of `kind` holding both `sides`, per CPU (cpu_label), newest first. An older file
    that did not record the CPU's flags counts only where no file with flags names the same CPU model
    (it cannot tell which of that model's kinds it ran on, so a flagged result of the model replaces it)."""
    out, unflagged, seen = [], [], set()
    for path in reversed(result_files(kind, folder)):
        try:
            r = json.loads(path.read_text())
        except ValueError:
            continue
        if not all(k in (r.get("summary") or {}) for k in sides) or cpu_label(r) in seen:
            continue
        seen.add(cpu_label(r))
        (out if (r.get("machine") or {}).get("flags") else unflagged).append((path, r))
    flagged_models = {cpu_name(r) for _, r in out}
    return out + [(path, r) for path, r in unflagged if cpu_name(r) not in flagged_models]


def result_files(kind: str, folder: Path = RESULTS) -> list[Path]:
    """`kind`'s result files, oldest first (KIND_<date>_<time>.json; smoke runs are named otherwise)."""
    pattern = re.compile(rf"^{re.escape(kind)}_(\d{{8}}_\d{{6}})\.json$")
    stamped = sorted((m.group(1), p) for p in folder.glob(f"{kind}_*.json") if (m := pattern.match(p.name)))
    return [p for _, p in stamped]


def newest(kind: str, folder: Path = RESULTS) -> Path | None:
    found = result_files(kind, folder)
    return found[-1] if found else None


def fmt(value, decimals) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f} %" if decimals == PCT else f"{value:.{decimals}f}"


def cell(s, decimals) -> str:
    if not isinstance(s, dict) or "median" not in s:
        return "-"
    text = fmt(s["median"], decimals)
    lo, hi = (fmt(s.get(k), decimals).removesuffix(" %") for k in ("min", "max"))
    if s.get("min") is not None and lo != hi:
        text = text.removesuffix(" %") + f" ({lo}–{hi})" + (" %" if decimals == PCT else "")
    return text


def machine_line(r: dict, path: Path | None) -> str:
    m = r.get("machine") or {}
    peak = m.get("matmul_gflops") or {"fp32": r.get("matmul_gflops"), "bf16": r.get("matmul_gflops_bf16")}
    cpu = m.get("cpu") or r.get("cpu") or "unknown CPU"
    flags = m.get("flags") or {}
    parts = [cpu_label(r) if flags else cpu, f"{m['cpus']} CPUs" if m.get("cpus") else None, f"{m.get('threads', 2)} threads"]
    if flags:
        parts.append("native bf16: " + (", ".join(f for f in ("avx512_bf16", "amx_bf16") if flags.get(f)) or "no"))
    if peak.get("fp32"):
        parts.append(f"matmul fp32 {peak['fp32']:.0f}" + (f" / bf16 {peak['bf16']:.0f}" if peak.get("bf16") else "")
                     + " GFLOP/s")
    v = r.get("versions") or {}
    parts.append(", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "peft", "trl") if v.get(k)))
    stamp = re.search(r"_(\d{4})(\d\d)(\d\d)_\d{6}\.json$", path.name) if path else None
    date = (r.get("date") or "")[:10] or ("-".join(stamp.groups()) if stamp else None)
    loads = [x["load_average"][0] for x in (r.get("load_average") or {}).get("before_runs", [])]
    runs = f"{r['settings']['repeats']} interleaved runs each" if "repeats" in (r.get("settings") or {}) else (
        f"{r['repeats']} interleaved runs each" if r.get("repeats") else None)
    head = "; ".join(p for p in parts if p)
    tail = "; ".join(p for p in (runs, f"load average {min(loads):.1f}–{max(loads):.1f} before runs" if loads else None,
                                 f"`results/{path.name}`" if path else None, date) if p)
    return f"Machine: {head}. {tail}."


def table(r: dict, spec: dict) -> list[str]:
    labels = dict(spec["sides"])
    sides = [k for k, _ in spec["sides"] if k in r.get("summary", {})]
    pairs = [(a, b) for a, b in spec["pairs"] if a in sides and b in sides]
    head = ["median (min–max)"] + [labels[k] for k in sides] + [f"{labels[a]} / {labels[b]}" for a, b in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for metric, label, decimals in spec["rows"]:
        stats = [r["summary"][k].get(metric) for k in sides]
        if all(not isinstance(s, dict) for s in stats):
            continue
        ratios = []
        for a, b in pairs:
            sa, sb = r["summary"][a].get(metric), r["summary"][b].get(metric)
            ok = isinstance(sa, dict) and isinstance(sb, dict) and sb["median"]
            ratios.append(f"{sa['median'] / sb['median']:.2f}×" if ok else "")
        lines.append("| " + " | ".join([label] + [cell(s, decimals) for s in stats] + ratios) + " |")
    return lines


def notes(kind: str, r: dict) -> list[str]:
    out = []
    f = r.get("flops_per_step")
    if f:
        out.append(f"Matmul work per step: {f['total'] / 1e9:.1f} GFLOP ({f['tokens']} tokens; {f['counting']}).")
    loss = (r.get("checks") or {}).get("loss")
    if isinstance(loss, str):  # bench_grpo / bench_distill state their check in words
        out.append(f"Loss check passed: {loss}.")
        trained = (r.get("checks") or {}).get("trained_completions")
        if trained:
            out.append("Completions trained per update, every run: " + ", ".join(f"{k} {v}" for k, v in trained.items())
                       + ".")
    elif loss:
        worst = max(loss.get("max_abs_diff_vs_reference", {}).values(), default=0.0)
        first = r.get("loss") or {}
        span = f" ({first['first']:.4f} → {first['last']:.4f})" if "first" in first else ""
        out.append(f"Loss check passed: every step of every run within {loss['tolerance']}; largest difference "
                   f"{worst:.1e}{span}.")
    if kind == "service" and "overhead_percent" in r:
        out.append(f"Service overhead (time per token): {r['overhead_percent']:+.1f} %; passes of "
                   f"{r['settings']['pass_tokens']} tokens on both sides.")
    return out


def render(r: dict, path: Path | None = None, kind: str | None = None) -> str:
    kind = kind or r.get("benchmark")
    spec = KINDS.get(kind)
    if spec is None:
        return f"(no table for benchmark kind {kind!r})"
    smoke = " (smoke run: a tiny random model, not a measurement)" if r.get("smoke") else ""
    lines = [f"**{spec['title']}**{smoke}", "", machine_line(r, path), "", *table(r, spec)]
    extra = notes(kind, r)
    return "\n".join(lines + ([""] + extra if extra else []))


def render_kind(kind: str, folder: Path = RESULTS) -> str:
    if kind == "summary":
        return render_summary(folder)
    found = newest_per_cpu(kind, (), folder)  # one table per CPU met, the newest result of each
    if not found:
        return f"No result yet (run the benchmark; it writes `benchmarks/results/{kind}_<timestamp>.json`)."
    out = []
    for path, r in found:
        try:
            out.append(render(r, path, kind))
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # an older or broken file: say so, go on
            out.append(f"`{path.name}` could not be rendered ({type(e).__name__}: {e}).")
    return "\n\n".join(out)


def write_sections(readme: Path, folder: Path = RESULTS, kinds=None) -> list[str]:
    """Replace each <!-- report:KIND --> ... <!-- /report:KIND --> block; returns the kinds replaced."""
    text = readme.read_text(encoding="utf-8")
    done = []

    def replace(m):
        kind = m.group(1)
        if kinds and kind not in kinds:
            return m.group(0)
        done.append(kind)
        return f"<!-- report:{kind} -->\n{render_kind(kind, folder)}\n<!-- /report:{kind} -->"

    text = re.sub(r"<!-- report:(\w+) -->.*?<!-- /report:\1 -->", replace, text, flags=re.S)
    readme.write_text(text, encoding="utf-8")
    return done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kinds", nargs="*", help=f"which tables (default all: {', '.join(KINDS)})")
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of result files (benchmarks/results)")
    p.add_argument("--write", type=Path, metavar="FILE", help="fill the <!-- report:KIND --> blocks of FILE")
    args = p.parse_args()
    unknown = [k for k in args.kinds if k not in KINDS and k != "summary"]
    if unknown:
        p.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    if args.write:
        done = write_sections(args.write, args.results, args.kinds or None)
        print(f"{args.write}: replaced {', '.join(done) or 'nothing (no report markers)'}")
        return
    for kind in args.kinds or KINDS:
        print(f"## {kind}\n\n{render_kind(kind, args.results)}\n")


if __name__ == "__main__":
    sys.exit(main())
