"""What `retrograd inspect --model PATH` reports: architecture, sizes, parameter counts, dtype,
suggested LoRA targets and whether llama.cpp adapters can be written for it."""
from __future__ import annotations

from collections import Counter

from retrograd.models.architectures import ARCHS as GGUF_ARCHS
from retrograd.models.lora import ALIASES, block_linear_names


def describe(loaded) -> dict:
    model, cfg = loaded.model, loaded.model.config
    params = list(model.named_parameters())
    unique = {id(p): p for _, p in params}
    emb = model.get_input_embeddings().weight
    targets = block_linear_names(model)
    alias_of = {name: alias for alias, names in ALIASES.items() for name in names}
    return {
        "model": loaded.source,
        "resolved": loaded.resolved,
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "attention_heads": getattr(cfg, "num_attention_heads", None),
        "kv_heads": getattr(cfg, "num_key_value_heads", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "parameters": sum(p.numel() for p in unique.values()),
        "embedding_parameters": emb.numel(),
        "dtypes": dict(Counter(str(p.dtype).removeprefix("torch.") for p in unique.values())),
        "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None)),
        "lora_targets": targets,
        "lora_target_aliases": [alias_of.get(t, t) for t in targets],
        "gguf_adapter_export": cfg.model_type in GGUF_ARCHS,
        "fingerprint": loaded.fingerprint,
    }


def format_description(d: dict) -> str:
    lines = [
        f"model          {d['model']}" + (f"  ({d['resolved']})" if d["resolved"] != d["model"] else ""),
        f"architecture   {d['architecture']} (model_type {d['model_type']})",
        f"shape          {d['layers']} layers, hidden {d['hidden_size']}, {d['attention_heads']} heads "
        f"({d['kv_heads']} kv), vocab {d['vocab_size']}, context {d['max_position_embeddings']}",
        f"parameters     {d['parameters']:,} ({d['embedding_parameters']:,} in the embeddings"
        + (", tied with the output head)" if d["tied_embeddings"] else ")"),
        f"dtype          {', '.join(f'{k} x{v}' for k, v in d['dtypes'].items())} (tensors)",
        f"chat template  {'yes' if d['chat_template'] else 'no (train on text rows)'}",
        f"LoRA targets   {', '.join(d['lora_targets'])}  (\"auto\"; aliases {', '.join(d['lora_target_aliases'])})",
        f"llama.cpp      {'GGUF LoRA adapters supported' if d['gguf_adapter_export'] else 'no GGUF adapter export for this model type (use a PEFT folder)'}",
    ]
    return "\n".join(lines)
