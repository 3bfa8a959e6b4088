"""Write an HF model (weights + config + tokenizer) as a llama.cpp GGUF model, without llama.cpp's
converter: used for a merged LoRA or a full fine-tune whose base is an HF folder (a base that came
from a GGUF file keeps that file's metadata instead, see gguf_merged.py).

What is written, in llama.cpp's layout:
- hyperparameters (`<arch>.context_length`, `.embedding_length`, `.block_count`, ...) from config.json;
- the tokenizer as `tokenizer.ggml.model = "gpt2"` (byte-level BPE): every token string, its type
  (NORMAL, CONTROL for special tokens, USER_DEFINED for other added tokens, UNUSED for the padding
  rows of an embedding larger than the vocabulary), the merges, bos/eos/pad/unk ids, add_bos and
  the chat template;
- `tokenizer.ggml.pre`, the pre-tokenizer llama.cpp must use. It is read from the structure of
  tokenizer.json's `pre_tokenizer`; only shapes whose llama.cpp counterpart is known (and checked in
  tests by tokenizing through llama.cpp) are accepted, anything else is refused by name rather than
  written as a file that tokenizes differently from the trained model;
- the tensors (q/k rows RoPE-permuted for llama), 2-D weights as F32/F16/Q8_0, 1-D as F32.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import ConfigError
from retrograd.export.gguf_lora import finish_gguf
from retrograd.models.architectures import ARCHS, permute_rows


def _byte_level(p: dict) -> bool:
    return p.get("type") == "ByteLevel" and p.get("use_regex", True) and not p.get("add_prefix_space", False)


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE tokenizer.json, or a ConfigError."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConfigError(f"the tokenizer is a {model.get('type')!r} model; a GGUF is written here for byte-level "
                          "BPE tokenizers only (export --format hf and use llama.cpp's convert_hf_to_gguf.py)")
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if _byte_level(pre):
        return "gpt-2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if (steps and len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits")
            and _byte_level(steps[1])):
        return "smollm"  # digits split one by one, then GPT-2's regex (SmolLM / SmolLM2)
    raise ConfigError(f"the tokenizer's pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp counterpart known to "
                      "retrograd; export --format hf and use llama.cpp's convert_hf_to_gguf.py")


def check_hf_gguf(config, tokenizer) -> None:
    """Refuse, before training, a model or tokenizer this writer cannot express."""
    if config.model_type not in ARCHS:
        raise ConfigError(f"a GGUF model is written for {', '.join(ARCHS)} models, not {config.model_type!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope scaling {rope.get('rope_type')!r} is not written to GGUF here; export --format hf "
                          "and use llama.cpp's convert_hf_to_gguf.py")
    pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str()))


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def _add_hparams(w, config, arch: str) -> None:
    c = config
    n_head = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(getattr(c, "num_key_value_heads", None) or n_head)
    w.add_rope_freq_base(_rope_theta(c))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "LLAMA":
        w.add_rope_dimension_count(head_dim)
    if head_dim != c.hidden_size // n_head or arch == "QWEN3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _add_tokenizer(w, tokenizer, n_vocab: int) -> None:
    import gguf
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_name(tj))
    added = {t["id"]: t for t in tj.get("added_tokens") or []}
    id_to_token = {i: t for t, i in tj["model"]["vocab"].items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        elif i in id_to_token:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # embedding rows beyond the tokenizer's vocabulary
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges") or []]
    w.add_token_merges(merges or ["Ġ Ġ"])  # llama.cpp's BPE loader requires the key
    for kind in ("bos", "eos", "pad", "unk"):
        tid = getattr(tokenizer, f"{kind}_token_id", None)
        if tid is not None:
            getattr(w, f"add_{kind}_token_id")(int(tid))
    probe = tokenizer("a")["input_ids"]
    w.add_add_bos_token(bool(probe) and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id)
    if isinstance(tokenizer.chat_template, str):
        w.add_chat_template(tokenizer.chat_template)


def add_weight(writer, name: str, w: np.ndarray, dtype: str) -> None:
    """One tensor: 1-D (norms, biases) always F32, 2-D as f32 / f16 / q8_0."""
    import gguf
    if w.ndim == 1 or dtype == "f32":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def merged_state_dict(model, lora: dict | None) -> dict[str, torch.Tensor]:
    """HF weight name -> tensor of the trained model, with the LoRA (if any) merged: W + alpha/r * B @ A.
    The live model is left as it is."""
    from retrograd.export.gguf_merged import merged_deltas
    if not lora:
        return dict(model.state_dict())
    deltas = merged_deltas(model, lora)
    out = {}
    for key, t in model.state_dict().items():
        if ".lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[name] = t.float() + deltas.pop(name) if name in deltas else t
    return out


def write_hf_gguf(model, tokenizer, lora: dict | None, out: Path, dtype: str = "f32") -> Path:
    """The trained model (LoRA merged) as a standalone llama.cpp GGUF, written atomically."""
    import gguf
    cfg = model.config
    check_hf_gguf(cfg, tokenizer)
    arch = ARCHS[cfg.model_type][0]
    permute = ARCHS[cfg.model_type][1]
    weights = merged_state_dict(model, lora)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), cfg.num_hidden_layers)
    n_vocab = weights["model.embed_tokens.weight"].shape[0]
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
    w.add_name(Path(getattr(cfg, "_name_or_path", "") or "model").name or "model")
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    w.add_vocab_size(n_vocab)
    _add_hparams(w, cfg, arch)
    _add_tokenizer(w, tokenizer, n_vocab)
    n_head, n_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    tied = getattr(cfg, "tie_word_embeddings", False)
    for hf_name, t in weights.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        g = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise ConfigError(f"no llama.cpp tensor corresponds to {hf_name}")
        arr = t.detach().float().cpu().numpy()
        if permute and hf_name.endswith("q_proj.weight"):
            arr = permute_rows(arr, n_head)
        elif permute and hf_name.endswith("k_proj.weight"):
            arr = permute_rows(arr, n_kv)
        add_weight(w, g, arr, dtype)
    return finish_gguf(w, tmp, out)
