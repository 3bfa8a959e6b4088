"""Test helpers for comparing against a real llama.cpp runtime (the prebuilt `xllamacpp` wheel).

`write_f32_base` rewrites a (quantized) GGUF model with every tensor de-quantized to F32, so
llama.cpp and the de-quantized torch model hold identical weights and logits can be compared
tightly. `next_token_logprobs` runs llama.cpp (optionally with a LoRA adapter) and returns the
top-k log-probabilities of the next token after a prompt.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_f32_base(src: Path, dst: Path) -> Path:
    import gguf
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, arr.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def next_token_logprobs(model: Path, prompt: str, adapter: Path | None = None, k: int = 20) -> dict[int, float]:
    """token id -> log-probability of the k most likely next tokens, from llama.cpp."""
    import xllamacpp as xlc
    p = xlc.CommonParams()
    p.model.path = str(model)
    p.n_ctx = 256
    p.n_parallel = 1
    p.cpuparams.n_threads = 2
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.cache_type_k = xlc.ggml_type.GGML_TYPE_F32
    p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    p.warmup = False
    if adapter is not None:
        p.lora_adapters = [xlc.CommonAdapterLoraInfo(str(adapter), 1.0)]
    server = xlc.Server(p)
    res = server.handle_completions({"prompt": prompt, "max_tokens": 1, "n_probs": k, "temperature": 0.0,
                                     "cache_prompt": False})
    top = res["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["id"]: t["logprob"] for t in top}
