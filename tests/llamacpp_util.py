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


def next_token_logprobs(model: Path, prompt, adapter: Path | None = None, k: int = 20) -> dict[int, float]:
    """token id -> log-probability of the k most likely next tokens, from llama.cpp. `prompt` is text,
    or a list of token ids (which bypasses llama.cpp's tokenizer)."""
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
    res = server.handle_completions({"prompt": prompt, "max_tokens": 4, "n_probs": k, "temperature": 0.0, "ignore_eos": True,
                                     "cache_prompt": False})
    if not (res.get("choices") and res["choices"][0].get("logprobs")):
        raise RuntimeError(f"llama.cpp returned no logprobs: {str(res)[:500]}")
    top = res["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["id"]: t["logprob"] for t in top}


def write_tiny_llama_gguf(model_dir: Path, dst: Path) -> Path:
    """An F32 llama GGUF of a tiny HF llama model built in the tests (byte-level BPE vocabulary),
    written the way llama.cpp's converter lays it out (q/k rows permuted to interleaved RoPE)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retrograd.models.architectures import permute_rows
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_name("tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings
        arr = t.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            arr = permute_rows(arr, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = permute_rows(arr, c.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
