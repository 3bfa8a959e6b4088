"""Read an existing LoRA adapter (a PEFT folder or a llama.cpp GGUF adapter) for `lora.init_adapter`:
its rank, alpha and target modules, and its A/B tensors in PEFT layout for a given model."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import ConfigError
from retrograd.models.architectures import ARCHS, adapter_tensors, unpermute_rows


@dataclass
class AdapterSpec:
    rank: int
    alpha: float
    modules: list[str]  # leaf module names, e.g. q_proj


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_spec(path: str | Path, source: str = "lora.init_adapter") -> AdapterSpec:
    """`source` names where the path came from in error messages (a config key or a CLI flag)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{source} {path}: no such file or folder")
    if _is_gguf(path):
        import gguf
        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as e:
            raise ConfigError(f"{source} {path}: not a readable GGUF file ({e})") from None
        fields = {f.name: f.contents() for f in reader.fields.values()}
        if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
            raise ConfigError(f"{source} {path}: this GGUF is not a LoRA adapter "
                              f"(general.type = {fields.get('general.type')!r}); is it a base model?")
        a = [t for t in reader.tensors if t.name.endswith(".lora_a")]
        if not a:
            raise ConfigError(f"{source} {path}: the adapter has no lora_a tensors")
        rank = int(a[0].shape[1])  # ggml ne = [in, r]
        gguf_kinds = sorted({t.name.split(".")[2] for t in a})
        alpha = float(fields.get("adapter.lora.alpha") or rank)  # 0/absent: llama.cpp scale 1
        return AdapterSpec(rank, alpha, gguf_kinds)  # GGUF kinds, mapped to modules by load_tensors
    if path.is_dir() and (path / "adapter_config.json").exists():
        cfg = json.loads((path / "adapter_config.json").read_text())
        targets = cfg.get("target_modules")
        if isinstance(targets, str):
            raise ConfigError(f"{source} {path}: target_modules is a pattern ({targets!r}); "
                              "list the module names instead")
        return AdapterSpec(int(cfg["r"]), float(cfg["lora_alpha"]), sorted(targets))
    raise ConfigError(f"{source} {path}: expected a PEFT adapter folder (adapter_config.json) "
                      "or a .gguf LoRA adapter")


def adapter_layout(path: str | Path, model, source: str = "lora.init_adapter") -> AdapterSpec:
    """rank, alpha and the model's leaf module names of an adapter (GGUF tensor kinds mapped)."""
    spec = read_spec(path, source)
    if _is_gguf(Path(path)):
        spec.modules = gguf_module_names(model, spec.modules)
    return spec


def gguf_module_names(model, kinds: list[str]) -> list[str]:
    """GGUF tensor kinds (attn_q, ffn_up, ...) -> the model's leaf module names."""
    import gguf
    cfg = model.config
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[cfg.model_type][0]), cfg.num_hidden_layers)
    found = {}
    for full, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            g = names.get_name(full.removeprefix("base_model.model.") + ".weight", try_suffixes=(".weight",))
            if g and g.startswith("blk."):  # blk.N.<kind>.weight
                found.setdefault(g.split(".")[2], full.rsplit(".", 1)[-1])
    missing = [k for k in kinds if k not in found]
    if missing:
        raise ConfigError(f"the GGUF adapter adapts {missing}, which this model does not have")
    return sorted({found[k] for k in kinds})


def load_tensors(path: str | Path, model, source: str = "lora.init_adapter") -> dict[str, torch.Tensor]:
    """The adapter's tensors keyed by the PEFT model's own parameter names (…lora_A.default.weight)."""
    path = Path(path)
    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    if _is_gguf(path):
        import gguf
        cfg = model.config
        if cfg.model_type not in ARCHS:
            raise ConfigError(f"{source}: GGUF adapters are read for {', '.join(ARCHS)} models only")
        reader = gguf.GGUFReader(str(path))
        arrays = {t.name: np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
                  for t in reader.tensors}
        # the exporter's own name mapping, run on the PEFT model, tells which GGUF name is which parameter
        peft_names = {k.replace(".default.weight", ".weight"): k for k in params}
        state = {k: params[v].detach() for k, v in peft_names.items()}
        out = {}
        for (gname, _), key in zip(adapter_tensors(state, cfg), sorted(state)):
            if gname not in arrays:
                raise ConfigError(f"{source} {path}: it has no tensor {gname} (does not match this model's "
                                  "LoRA layout)")
            arr = arrays[gname]
            n_head = cfg.num_attention_heads
            n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
            if ARCHS[cfg.model_type][1] and ".lora_B." in key and ".q_proj." in key:
                arr = unpermute_rows(arr, n_head)
            elif ARCHS[cfg.model_type][1] and ".lora_B." in key and ".k_proj." in key:
                arr = unpermute_rows(arr, n_kv)
            out[peft_names[key]] = torch.from_numpy(np.ascontiguousarray(arr))
        return out
    from safetensors.torch import load_file
    saved = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for k, v in saved.items():
        name = k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
        out[name] = v
    return out


def apply_adapter(path: str | Path, model, source: str = "lora.init_adapter") -> None:
    """Copy the adapter's weights into the freshly attached LoRA of `model`; mismatches are errors."""
    tensors = load_tensors(path, model, source)
    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    if set(tensors) != set(params):
        extra, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
        raise ConfigError(f"{source} {path} does not match this base model: "
                          f"unexpected {extra[:2]}, missing {missing[:2]}")
    with torch.no_grad():
        for n, p in params.items():
            t = tensors[n]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"{source} {path} does not match this base model: {n} has shape "
                                  f"{tuple(t.shape)}, the model needs {tuple(p.shape)} (trained on another base?)")
            p.copy_(t.to(p.dtype))
