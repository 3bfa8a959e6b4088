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
from retrograd.models.architectures import ARCHS, adapter_tensors


def check_exportable(config, targets: list[str]) -> None:
    """Refuse, before training, what a llama.cpp adapter cannot express."""
    if config.model_type not in ARCHS:
        raise ConfigError(f"a GGUF LoRA adapter is supported for model types {', '.join(ARCHS)}, not "
                          f"{config.model_type!r}; write a PEFT adapter folder instead (output.kind = 'peft')")
    bad = [t for t in targets if t in ("lm_head", "embed_tokens")]
    if bad:
        raise ConfigError(f"lora.targets {bad}: llama.cpp cannot apply a LoRA to the embeddings / output head "
                          "of this model (tied weights); remove them from the targets")


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
