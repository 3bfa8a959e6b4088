"""Architecture tables: how llama.cpp names and lays out each supported model family's tensors.

`ARCHS` maps an HF `model_type` to its GGUF architecture and whether llama.cpp's converter permutes
the q/k rows (GGUF `llama` uses interleaved RoPE where HF uses rotate-half); `adapter_tensors` maps a
PEFT LoRA state dict to llama.cpp adapter tensor names with that permutation applied to lora_B, and
`unpermute_rows` undoes it when a GGUF adapter is read back. Used by export/ (writing) and
models/adapter_io.py (reading).
"""
from __future__ import annotations

import numpy as np
import torch

from retrograd.errors import ConfigError

# HF model_type -> (gguf arch name, whether q/k rows are RoPE-permuted by convert_hf_to_gguf)
ARCHS = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's llama q/k row permutation (rotate-half -> interleaved RoPE)."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def adapter_tensors(peft_state: dict[str, torch.Tensor], config) -> list[tuple[str, np.ndarray]]:
    """(gguf name, float32 array) pairs from a PEFT state dict (keys like
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight)."""
    import gguf
    arch_name, permute = ARCHS[config.model_type]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_name), config.num_hidden_layers)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    out = []
    for key in sorted(peft_state):
        if ".lora_A." not in key and ".lora_B." not in key:
            raise ConfigError(f"adapter tensor {key!r} is not a LoRA A/B matrix; llama.cpp adapters hold only those")
        module = key.removeprefix("base_model.model.").split(".lora_")[0]
        gguf_name = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if gguf_name is None:
            raise ConfigError(f"no llama.cpp tensor corresponds to {module}")
        arr = peft_state[key].detach().to("cpu", torch.float32).numpy()
        if ".lora_B." in key and permute and module.endswith("q_proj"):
            arr = permute_rows(arr, n_head)
        elif ".lora_B." in key and permute and module.endswith("k_proj"):
            arr = permute_rows(arr, n_kv)
        out.append((gguf_name + (".lora_a" if ".lora_A." in key else ".lora_b"), np.ascontiguousarray(arr)))
    return out


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_rows (interleaved -> rotate-half RoPE row order)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
