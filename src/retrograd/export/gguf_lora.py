"""Write a PEFT LoRA adapter as a llama.cpp LoRA GGUF (`llama-cli -m base.gguf --lora adapter.gguf`).

Format (llama.cpp `llama_adapter_lora_init`): KV `general.architecture` = the base model's arch,
`general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha` (float32); one pair of
tensors per adapted weight, `<gguf weight name>.lora_a` = PEFT lora_A (r, in) and `.lora_b` = PEFT
lora_B (out, r), written as-is. llama.cpp applies `alpha / r * B(Ax)`, exactly PEFT's scale.

The one transform: GGUF `llama` uses interleaved RoPE where HF uses rotate-half, so the HF -> GGUF
converter permutes the output rows of q_proj / k_proj, and the lora_B rows of those projections
need the same permutation (without it the adapter loads but gives wrong logits).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import ConfigError

# HF model_type -> (gguf arch name, whether q/k rows are RoPE-permuted by convert_hf_to_gguf)
ARCHS = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


def check_exportable(config, targets: list[str]) -> None:
    """Refuse, before training, what a llama.cpp adapter cannot express."""
    if config.model_type not in ARCHS:
        raise ConfigError(f"a GGUF LoRA adapter is supported for model types {', '.join(ARCHS)}, not "
                          f"{config.model_type!r}; write a PEFT adapter folder instead (output.kind = 'peft')")
    bad = [t for t in targets if t in ("lm_head", "embed_tokens")]
    if bad:
        raise ConfigError(f"lora.targets {bad}: llama.cpp cannot apply a LoRA to the embeddings / output head "
                          "of this model (tied weights); remove them from the targets")


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


def write_gguf_lora(path: str | Path, peft_state: dict[str, torch.Tensor], alpha: float, config,
                    dtype: str = "f32") -> Path:
    """Write the adapter atomically (a temporary file renamed into place)."""
    import gguf
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch_name, _ = ARCHS[config.model_type]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch_name)])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    np_dtype = {"f32": np.float32, "f16": np.float16}.get(dtype, np.float32)  # bf16 is stored as f32
    for name, arr in adapter_tensors(peft_state, config):
        writer.add_tensor(name, arr.astype(np_dtype))
    return finish_gguf(writer, tmp, path)


def finish_gguf(writer, tmp: Path, path: Path) -> Path:
    """Write a prepared GGUFWriter's file to `tmp` and rename it to `path` (never half a file there)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
