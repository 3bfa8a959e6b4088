"""`retrograd explain run.toml [--set K=V ...] [--json]`: a dry run before spending hours. Without
loading weights: the resolved config with where each value came from (default, the file, --set), the
data (rows or prompts, tokens per row from the model's tokenizer when it is at hand, else an
estimate), steps and tokens per step, an estimate of the time and peak memory on this machine, and
warnings about settings that are likely mistakes.

The estimates are rough and say so: time = tokens x FLOPs per token / (this machine's measured fp32
matmul throughput x an efficiency of EFFICIENCY), FLOPs per token 6 N for a full fine-tune and 4 N with
LoRA (no weight gradients for the frozen base), plus generation for rollout algorithms (2 N per
sampled token); memory = weights + gradients and AdamW state of what trains + a per-token activation
allowance.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

EFFICIENCY = 0.5  # share of the matmul peak a training step reaches on CPU (measured 0.4-0.8 in benchmarks/)
ACTIVATION_BYTES_PER_TOKEN_PER_LAYER_HIDDEN = 40  # fp32 activations kept for backward, per hidden unit
CHARS_PER_TOKEN = 3.5  # when no tokenizer is at hand


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def sources(path: Path, overrides: list[str], resolved: dict) -> dict[str, str]:
    """key -> "--set" | "file" | "default" for every resolved key."""
    from retrograd.config.load import _parse_toml, parse_override
    in_file = set(_flatten(_parse_toml(path)))
    in_set = {".".join(parse_override(o)[0]) for o in overrides}
    out = {}
    for key in _flatten(resolved):
        parents = {key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)}  # a --set of a whole table
        out[key] = "--set" if key in in_set or parents & in_set else "file" if key in in_file or parents & in_file \
            else "default"
    return out


def _model_facts(path: str) -> dict:
    """Parameter count, layers and hidden size from a config.json or GGUF header, without the weights."""
    from retrograd.models.builtin import BUILTINS, is_builtin
    p = Path(path)
    try:
        if is_builtin(path):
            from retrograd import paths
            spec = BUILTINS[path.removeprefix("builtin:")]
            p = paths.home() / "models" / spec.alias / Path(spec.member).name
            if not p.is_file():
                return {"note": "the built-in model is not fetched yet (the first run fetches ~93 MB)",
                        "params": 134_515_008, "layers": 30, "hidden": 576, "vocab": 49152}
        if p.is_dir() and (p / "config.json").is_file():
            c = json.loads((p / "config.json").read_text())
            h, n, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
            inter = c.get("intermediate_size", 4 * h)
            params = n * (4 * h * h + 3 * h * inter) + v * h * (1 if c.get("tie_word_embeddings", True) else 2)
            return {"params": params, "layers": n, "hidden": h, "vocab": v}
        if p.is_file() and p.suffix == ".gguf":
            import gguf
            r = gguf.GGUFReader(str(p))
            arch = r.fields["general.architecture"].contents()
            fields = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.")}
            params = sum(int(math.prod(int(d) for d in t.shape)) for t in r.tensors)
            return {"params": params, "layers": int(fields.get(f"{arch}.block_count", 0)),
                    "hidden": int(fields.get(f"{arch}.embedding_length", 0)),
                    "vocab": len(r.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in r.fields
                    else 0}
    except (OSError, KeyError, ValueError) as e:
        return {"note": f"could not read the model's shape: {e}"}
    return {"note": "the model's shape is unknown until it loads (a hub name)"}


def _data(cfg) -> dict:
    from retrograd.data.jsonl import read_jsonl
    from retrograd.data.sft import resolve_data_path
    a = cfg.run.algorithm
    key, path = {"sft": ("sft.data", cfg.sft and cfg.sft.data), "preference": ("preference.data", cfg.preference and
                 cfg.preference.data), "grpo": ("grpo.prompts", cfg.grpo and cfg.grpo.prompts),
                 "ppo": ("ppo.prompts", cfg.ppo and cfg.ppo.prompts)}.get(a, (None, None))
    if a == "distill":
        d = cfg.distill
        key, path = ("distill.prompts", d.prompts) if d.mode == "on_policy" else ("distill.data", d.data)
    if not path:
        return {}
    p = resolve_data_path(path)
    if p.suffix in (".txt", ".md"):
        chars = len(p.read_text(encoding="utf-8", errors="replace"))
        return {"key": key, "path": str(p), "rows": None, "chars": chars, "est_tokens": int(chars / CHARS_PER_TOKEN)}
    rows = [row for _, row in read_jsonl(p)]
    chars = sum(len(json.dumps(r, ensure_ascii=False)) for r in rows)
    return {"key": key, "path": str(p), "rows": len(rows), "chars": chars,
            "est_tokens_per_row": round(chars / max(1, len(rows)) / CHARS_PER_TOKEN)}


def matmul_gflops() -> float:
    import torch
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    t0, n = time.perf_counter(), 10
    for _ in range(n):
        a @ b
    return 2 * 512 ** 3 * n / (time.perf_counter() - t0) / 1e9


def explain(path: str, overrides: list[str]) -> dict:
    from retrograd.config.load import config_as_dict, load_config
    cfg = load_config(path, overrides)
    resolved = config_as_dict(cfg)
    src = sources(Path(cfg.source), overrides, resolved)
    tr, a = cfg.training, cfg.run.algorithm
    model = _model_facts(cfg.model.path)
    data = _data(cfg)
    warnings = []
    # steps and tokens per step, by algorithm
    if a in ("sft", "preference") or (a == "distill" and cfg.distill.mode == "topk_offline"):
        per_step_rows = tr.batch_size * tr.gradient_accumulation * (2 if a == "preference" else 1)
        if a == "preference" and cfg.preference.pairs_per_step:
            per_step_rows = 2 * cfg.preference.pairs_per_step
        rows = data.get("rows") or 0
        epochs = cfg.distill.offline_epochs if a == "distill" else tr.epochs
        steps = tr.max_steps or (math.ceil(rows / max(1, per_step_rows // (2 if a == "preference" else 1))) * epochs
                                 if rows else None)
        tokens_per_step = per_step_rows * min(tr.ctx, data.get("est_tokens_per_row") or tr.ctx)
        sampled_per_step = 0
    else:
        t = {"grpo": cfg.grpo, "ppo": cfg.ppo, "distill": cfg.distill}[a]
        prompts = {"grpo": lambda: t.prompts_per_update, "ppo": lambda: t.rollout_batch_size,
                   "distill": lambda: t.prompts_per_update}[a]()
        per_prompt = {"grpo": lambda: t.group_size, "ppo": lambda: 1, "distill": lambda: t.samples_per_prompt}[a]()
        steps = t.updates or tr.max_steps or (math.ceil((data.get("rows") or 0) / prompts) * tr.epochs or None)
        sampled_per_step = prompts * per_prompt * t.sampling.max_new_tokens
        epochs_per_update = {"grpo": lambda: t.grpo_epochs, "ppo": lambda: t.ppo_epochs,
                             "distill": lambda: t.distill_epochs}[a]()
        tokens_per_step = (prompts * (data.get("est_tokens_per_row") or 64) + sampled_per_step) * epochs_per_update
        if a == "grpo" and t.group_size < 4:
            warnings.append(f"grpo.group_size = {t.group_size}: group-relative advantages are noisy below 4")
    est = {}
    if model.get("params") and steps:
        gflops = matmul_gflops()
        n = model["params"]
        train_flops = (4 if tr.trainable == "lora" else 6) * n * tokens_per_step + 2 * n * sampled_per_step
        step_s = train_flops / (gflops * 1e9 * EFFICIENCY)
        bytes_w = n * (2 if cfg.model.dtype == "bfloat16" else 4)
        trained = n if tr.trainable == "full" else 0.02 * n
        act = (tr.micro_batch or min(tokens_per_step, 1024)) * model.get("layers", 24) * model.get("hidden", 1024) \
            * ACTIVATION_BYTES_PER_TOKEN_PER_LAYER_HIDDEN
        est = {"matmul_fp32_gflops": round(gflops, 1), "seconds_per_step": float(f"{step_s:.3g}"),
               "total_minutes": float(f"{step_s * steps / 60:.3g}"),
               "peak_memory_gb": round((bytes_w + trained * 12 + act) / 1e9 + 0.8, 1),
               "how": f"{'4' if tr.trainable == 'lora' else '6'} N FLOPs per trained token + 2 N per sampled token at "
                      f"{EFFICIENCY:.0%} of the measured matmul peak; weights + 12 bytes per trained parameter + "
                      "activations + ~0.8 GB runtime"}
    if tr.trainable == "full" and tr.lr > 1e-4:
        warnings.append(f"training.lr = {tr.lr:g} with a full fine-tune: 1e-5..5e-5 is the usual range")
    if tr.trainable == "lora" and tr.lr < 1e-5:
        warnings.append(f"training.lr = {tr.lr:g} with LoRA: 1e-4..1e-3 is the usual range")
    if cfg.checkpoint is None:
        warnings.append("no [checkpoint]: a stopped run cannot be resumed")
    elif cfg.checkpoint.mode in ("best_eval", "steps_and_best_eval") and cfg.evaluation is None:
        warnings.append("checkpoint.mode keeps best.state, but there is no [evaluation]")
    if cfg.evaluation is None:
        warnings.append("no [evaluation]: progress is measured on training data only")
    if steps and tr.warmup_steps >= steps:
        warnings.append(f"training.warmup_steps = {tr.warmup_steps} >= the {steps} steps: the lr never reaches its peak")
    return {"config": str(cfg.source), "algorithm": a, "model": {"path": cfg.model.path, **model}, "data": data,
            "steps": steps, "tokens_per_step": tokens_per_step, "sampled_tokens_per_step": sampled_per_step,
            "estimate": est, "warnings": warnings,
            "values": {k: {"value": v, "source": src.get(k, "default")} for k, v in _flatten(resolved).items()}}


def run_explain(path: str, overrides: list[str], as_json: bool) -> int:
    e = explain(path, overrides)
    if as_json:
        print(json.dumps(e, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table
    console = Console()
    m = e["model"]
    console.print(f"[bold]{e['config']}[/]: {e['algorithm']} on {m['path']}"
                  + (f" ({m['params'] / 1e6:.0f}M parameters, {m.get('layers')} layers)" if m.get("params") else ""))
    if m.get("note"):
        console.print(f"  model: {m['note']}")
    d = e["data"]
    if d:
        console.print(f"  data: {d['key']} = {d['path']}: "
                      + (f"{d['rows']} rows, ~{d['est_tokens_per_row']} tokens each (estimate)" if d.get("rows")
                         is not None else f"~{d['est_tokens']} tokens of text (estimate)"))
    console.print(f"  steps: {e['steps'] or '?'}; ~{e['tokens_per_step']} trained tokens per step"
                  + (f" ({e['sampled_tokens_per_step']} sampled at most)" if e["sampled_tokens_per_step"] else ""))
    est = e["estimate"]
    if est:
        console.print(f"  estimate on this machine ({est['matmul_fp32_gflops']} GFLOP/s fp32 matmul): "
                      f"~{est['seconds_per_step']} s per step, ~{est['total_minutes']} min in all, peak memory "
                      f"~{est['peak_memory_gb']} GB (rough: {est['how']})")
    for w in e["warnings"]:
        console.print(f"  [yellow]warning[/]: {w}")
    t = Table(title="resolved config", show_header=True, header_style="bold")
    for col in ("key", "value", "from"):
        t.add_column(col)
    style = {"--set": "cyan", "file": "white", "default": "dim"}
    for k, v in e["values"].items():
        t.add_row(k, str(v["value"]), f"[{style[v['source']]}]{v['source']}[/]")
    console.print(t)
    return 0
