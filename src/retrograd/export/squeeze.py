"""`retrograd squeeze ADAPTER`: LoRA-Squeeze (algorithms/squeeze.py) on a PEFT adapter folder, a llama.cpp
GGUF adapter or a `.state` checkpoint: per-layer and mean retained variance at each target rank, the
recommended rank, and (with --out) the compressed adapter.

The compressed adapter keeps the source's format and its scale alpha / r (alpha' = alpha k / r): a
PEFT folder (adapter_config.json with r and lora_alpha changed, every other field kept), a GGUF
adapter (every metadata field kept, adapter.lora.alpha changed; q/k rows stay in the GGUF's own
order, which a rank truncation preserves). A `.state` checkpoint's adapter is written as a PEFT
folder: a squeezed adapter has no optimizer state a resume could continue, and a PEFT folder is what
`retrograd eval`, `lora.init_adapter` and `retrograd export` read.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms.squeeze import compress, default_target_ranks, recommend, retained, spectrum
from retrograd.errors import ConfigError


@dataclass
class Lora:
    fmt: str  # peft | gguf | state
    rank: int
    alpha: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module key -> (A [r, in], B [out, r])
    source: Path
    extra: dict = field(default_factory=dict)


def read_lora(path: str | Path) -> Lora:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"squeeze: {path}: no such file or folder")
    if p.is_file() and p.suffix == ".gguf":
        return _read_gguf(p)
    if p.is_dir() and (p / "adapter_config.json").is_file():
        cfg = json.loads((p / "adapter_config.json").read_text())
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
            raise ConfigError(f"squeeze: {p}: per-module rank_pattern / alpha_pattern adapters are not supported")
        files = [p / "adapter_model.safetensors"]
        if not files[0].is_file():
            raise ConfigError(f"squeeze: {p}: no adapter_model.safetensors")
        from safetensors.torch import load_file
        return Lora("peft", int(cfg["r"]), float(cfg["lora_alpha"]), _pairs(load_file(str(files[0])), "lora_A", "lora_B"),
                    p, {"config": cfg})
    if p.is_dir() and (p / "manifest.json").is_file():
        from safetensors.torch import load_file

        from retrograd.checkpoint.state import verify_state
        manifest = verify_state(p)
        lora = (manifest.get("base") or {}).get("lora")
        if not lora:
            raise ConfigError(f"squeeze: {p} is a full fine-tune checkpoint; there is no LoRA to squeeze")
        tensors = {k.replace(".default.weight", ".weight"): v for k, v in load_file(str(p / "weights.safetensors")).items()}
        return Lora("state", int(lora["rank"]), float(lora["alpha"]), _pairs(tensors, "lora_A", "lora_B"), p,
                    {"modules": lora["modules"], "base": manifest["base"].get("model")})
    raise ConfigError(f"squeeze: {path}: expected a PEFT adapter folder, a .gguf LoRA adapter or a .state checkpoint")


def _pairs(tensors: dict, a_tag: str, b_tag: str) -> dict:
    out = {}
    for name, t in tensors.items():
        if f".{a_tag}." in name or name.endswith(f".{a_tag}"):
            key = name.replace(a_tag, "{}")
            b = tensors.get(name.replace(a_tag, b_tag))
            if b is None:
                raise ConfigError(f"squeeze: {name} has no {b_tag} partner")
            out[key] = (t, b)
    if not out:
        raise ConfigError("squeeze: no LoRA factor pairs found")
    return out


def _read_gguf(p: Path) -> Lora:
    import gguf
    try:
        reader = gguf.GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise ConfigError(f"squeeze: {p}: not a readable GGUF file ({e})") from None
    fields = {f.name: f.contents() for f in reader.fields.values()}
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ConfigError(f"squeeze: {p}: this GGUF is not a LoRA adapter (general.type = {fields.get('general.type')!r})")
    tensors = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]))
               for t in reader.tensors}
    pairs = _pairs(tensors, "lora_a", "lora_b")
    rank = next(iter(pairs.values()))[0].shape[0]
    alpha = float(fields.get("adapter.lora.alpha") or rank)  # 0 / absent: llama.cpp scale 1
    return Lora("gguf", int(rank), alpha, pairs, p, {"reader": reader})


@dataclass
class Report:
    source_rank: int
    target_ranks: list[int]
    per_layer: dict[str, dict[int, float]]  # module -> rank -> retained variance
    mean: dict[int, float]
    minimum: dict[int, float]
    recommended: int


def analyse(lora: Lora, target_ranks: list[int] | None, min_retention: float) -> tuple[Report, dict]:
    ranks = sorted(set(target_ranks or default_target_ranks(lora.rank)))
    bad = [k for k in ranks if not 1 <= k <= lora.rank]
    if bad:
        raise ConfigError(f"squeeze: --target-ranks {bad} outside 1..{lora.rank} (the adapter's rank)")
    spectra = {key: spectrum(a, b) for key, (a, b) in lora.pairs.items()}
    per_layer = {key.replace(".{}", ""): {k: retained(sp.s, k) for k in ranks} for key, sp in spectra.items()}
    mean = {k: sum(v[k] for v in per_layer.values()) / len(per_layer) for k in ranks}
    minimum = {k: min(v[k] for v in per_layer.values()) for k in ranks}
    return Report(lora.rank, ranks, per_layer, mean, minimum, recommend(mean, min_retention, lora.rank)), spectra


def write_compressed(lora: Lora, spectra: dict, k: int, out: str | Path) -> Path:
    """The rank-k adapter in the source's format (a .state's as a PEFT folder), alpha / r kept."""
    out = Path(out)
    alpha = lora.alpha * k / lora.rank
    factors = {key: compress(sp, k) for key, sp in spectra.items()}
    if lora.fmt == "gguf":
        return _write_gguf(lora, factors, alpha, out)
    from safetensors.torch import save_file
    if lora.fmt == "peft":
        cfg = {**lora.extra["config"], "r": k, "lora_alpha": alpha}
    else:
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": k, "lora_alpha": alpha, "lora_dropout": 0.0,
               "bias": "none", "target_modules": lora.extra["modules"], "fan_in_fan_out": False,
               "inference_mode": True, "base_model_name_or_path": lora.extra["base"]}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = next(iter(lora.pairs.values()))[0].dtype
    tensors = {}
    for key, (a, b) in factors.items():
        tensors[key.format("lora_A")] = a.to(dtype).contiguous()
        tensors[key.format("lora_B")] = b.to(dtype).contiguous()
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    if lora.fmt == "peft":  # the tokenizer / template files a PEFT folder may carry
        for f in lora.source.iterdir():
            if f.is_file() and f.name not in ("adapter_model.safetensors", "adapter_config.json"):
                shutil.copy2(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _write_gguf(lora: Lora, factors: dict, alpha: float, out: Path) -> Path:
    import gguf

    from retrograd.export.gguf_lora import finish_gguf
    reader = lora.extra["reader"]
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        if f.name == "adapter.lora.alpha":
            writer.add_float32(f.name, float(alpha))
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    for key, (a, b) in factors.items():
        writer.add_tensor(key.format("lora_a"), np.ascontiguousarray(a.float().numpy()))
        writer.add_tensor(key.format("lora_b"), np.ascontiguousarray(b.float().numpy()))
    return finish_gguf(writer, tmp, out)


def run_squeeze(adapter: str, target_ranks: list[int] | None, min_retention: float, out: str | None,
                rank: int | None, as_json: bool) -> int:
    if not 0 < min_retention <= 1:
        raise ConfigError(f"--min-retention {min_retention}: give a share in (0, 1]")
    lora = read_lora(adapter)
    report, spectra = analyse(lora, target_ranks, min_retention)
    k = rank or report.recommended
    if rank is not None and not 1 <= rank <= lora.rank:
        raise ConfigError(f"--rank {rank}: give 1..{lora.rank} (the adapter's rank)")
    written = str(write_compressed(lora, spectra, k, out)) if out else None
    result = {"adapter": str(adapter), "format": lora.fmt, "source_rank": lora.rank, "alpha": lora.alpha,
              "layers": len(report.per_layer), "target_ranks": report.target_ranks,
              "mean_retained": report.mean, "min_retained": report.minimum,
              "recommended_rank": report.recommended, "min_retention": min_retention,
              "compressed": written, "compressed_rank": k if written else None,
              "compressed_alpha": lora.alpha * k / lora.rank if written else None,
              "per_layer": report.per_layer}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{adapter}: {lora.fmt} LoRA, rank {lora.rank}, alpha {lora.alpha:g}, {len(report.per_layer)} adapted modules")
    print(f"{'rank':>6s}{'mean retained':>16s}{'worst layer':>14s}")
    for k_ in report.target_ranks:
        mark = "  <- recommended" if k_ == report.recommended else ""
        print(f"{k_:6d}{report.mean[k_]:16.4f}{report.minimum[k_]:14.4f}{mark}")
    print(f"recommended rank: {report.recommended} (the smallest with mean retained variance >= {min_retention})")
    if written:
        print(f"wrote {written}: rank {k}, alpha {lora.alpha * k / lora.rank:g} (alpha / r kept)")
    return 0
