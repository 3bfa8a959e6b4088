"""Write a trained model as a standalone GGUF (`retrograd export --format gguf-merged`, or a full
fine-tune / merged LoRA with `[output] path = "*.gguf"`).

Route: start from the base model's own GGUF (its metadata and tokenizer are copied as they are), and
write every tensor again: the adapted weights become W + alpha/r * B @ A, moved to GGUF layout (the
llama q/k RoPE row permutation); 2-D weights are stored as F32, F16 or Q8_0, 1-D tensors (norms) as
F32. A base that did not come from a GGUF file (an HF folder) has no llama.cpp metadata to copy; it
is written from its config and tokenizer by gguf_from_hf.py. `write_model_gguf` picks the route.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import ConfigError
from retrograd.export.gguf_from_hf import add_weight
from retrograd.export.gguf_lora import finish_gguf
from retrograd.models.architectures import ARCHS, permute_rows

DTYPES = ("f32", "f16", "q8_0")


def merged_deltas(model, lora: dict) -> dict[str, torch.Tensor]:
    """HF weight name (model.layers.0.self_attn.q_proj.weight) -> alpha/r * B @ A."""
    scale = lora["alpha"] / lora["rank"]
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].weight.detach().float()
            b = module.lora_B["default"].weight.detach().float()
            out[name.removeprefix("base_model.model.") + ".weight"] = scale * (b @ a)
    return out


def _gguf_layout(cfg, names, hf_weights: dict) -> dict:
    """HF-layout weights -> {gguf tensor name: numpy array in GGUF layout (q/k rows permuted)}."""
    _, permute = ARCHS[cfg.model_type]
    out = {}
    for hf_name, t in hf_weights.items():
        g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if g is None:
            continue
        w = t.detach().float().cpu().numpy()
        if permute and hf_name.endswith("q_proj.weight"):
            w = permute_rows(w, cfg.num_attention_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            w = permute_rows(w, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        out[g] = w
    return out


def write_merged_gguf(base_gguf: Path, model, lora: dict | None, out: Path, dtype: str = "f32") -> Path:
    """`lora` set: add the LoRA deltas to the base GGUF's weights; None: the model is a full fine-tune
    and its own weights replace the base GGUF's."""
    import gguf
    cfg = model.config
    if cfg.model_type not in ARCHS:
        raise ConfigError(f"a merged GGUF is written for {', '.join(ARCHS)} models, not {cfg.model_type!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: a merged GGUF is f32, f16 or q8_0")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[cfg.model_type][0]), cfg.num_hidden_layers)
    if lora:
        deltas, replace = _gguf_layout(cfg, names, merged_deltas(model, lora)), {}
    else:
        deltas, replace = {}, _gguf_layout(cfg, names, dict(model.state_dict()))

    reader = gguf.GGUFReader(str(base_gguf))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name in deltas:
            w = w + deltas.pop(t.name)
        elif t.name in replace:
            if replace[t.name].shape != w.shape:
                raise ConfigError(f"{t.name}: the model has shape {replace[t.name].shape}, the base GGUF {w.shape}")
            w = replace[t.name]
        add_weight(writer, t.name, w, dtype)
    if deltas:
        raise ConfigError(f"the base GGUF has no tensors {sorted(deltas)[:3]} for the adapter's weights")
    return finish_gguf(writer, tmp, out)


def write_model_gguf(model_path: str, model, tokenizer, lora: dict | None, out: Path, dtype: str = "f32") -> Path:
    """The trained model as a llama.cpp GGUF: from the base's own GGUF when it came from one (its
    metadata and tokenizer kept byte for byte), otherwise from the HF config and tokenizer."""
    from retrograd.export.from_checkpoint import base_gguf
    from retrograd.export.gguf_from_hf import write_hf_gguf
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: a merged GGUF is f32, f16 or q8_0")
    source = base_gguf(model_path)
    if source is None:
        return write_hf_gguf(model, tokenizer, lora, Path(out), dtype)
    return write_merged_gguf(source, model, lora, Path(out), dtype)
