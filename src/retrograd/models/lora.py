"""LoRA through PEFT: resolve `lora.targets` to module names, attach, and list trainable tensors.

Targets accept retrograd-rs aliases (q, k, v, o, ffn_up, ffn_down, ffn_gate), HF module names
(q_proj, ...) and "auto": every nn.Linear inside the transformer blocks (not the LM head or the
embeddings, which llama.cpp adapters cannot express when they are tied).
"""
from __future__ import annotations

import torch

from retrograd.errors import ConfigError

ALIASES = {
    "q": ("q_proj", "query", "wq", "c_attn"), "k": ("k_proj", "key", "wk"), "v": ("v_proj", "value", "wv"),
    "o": ("o_proj", "out_proj", "dense", "wo", "c_proj"),
    "ffn_up": ("up_proj", "w3", "fc1", "c_fc"), "ffn_down": ("down_proj", "w2", "fc2"),
    "ffn_gate": ("gate_proj", "w1"),
}
_EXCLUDED = ("lm_head", "embed_tokens", "wte", "embed_out", "output")


def block_linear_names(model: torch.nn.Module) -> list[str]:
    """Leaf names of the nn.Linear modules inside the blocks, in model order, deduplicated."""
    names = []
    for full, mod in model.named_modules():
        leaf = full.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf not in _EXCLUDED and leaf not in names:
            names.append(leaf)
    return names


def resolve_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    available = block_linear_names(model)
    if targets == ["auto"]:
        if not available:
            raise ConfigError("lora.targets = ['auto'] found no linear layer in the model's blocks")
        return available
    if "auto" in targets:
        raise ConfigError('lora.targets: "auto" must be the only entry')
    out = []
    for t in targets:
        if t in _EXCLUDED:
            raise ConfigError(f"lora.targets: {t!r} (the embeddings / LM head) cannot be a LoRA target here; "
                              "llama.cpp cannot load an adapter on a tied output")
        if t in ALIASES:
            match = [n for n in ALIASES[t] if n in available]
            if not match:
                raise ConfigError(f"lora.targets: alias {t!r} matches no module of this model; "
                                  f"its linear layers are: {', '.join(available)}")
            out.append(match[0])
        elif t in available:
            out.append(t)
        else:
            raise ConfigError(f"lora.targets: {t!r} matches no module of this model; use 'auto', an alias "
                              f"({', '.join(ALIASES)}) or one of: {', '.join(available)}")
    return list(dict.fromkeys(out))


def attach_lora(model: torch.nn.Module, rank: int, alpha: float, targets: list[str], dropout: float, seed: int):
    """Wrap `model` with a PEFT LoRA adapter initialised from `seed` (A random, B zero). On bf16 and float32
    weights its layers run as one node that computes in that dtype (models/mixed_lora.py); on fp16 they
    are PEFT's own."""
    from peft import LoraConfig, get_peft_model

    from retrograd.models.mixed_lora import mixed_lora
    modules = resolve_targets(model, targets)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=dropout, bias="none",
                     task_type="CAUSAL_LM")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    torch.random.set_rng_state(state)  # the init seed must not shift the training RNG stream
    mixed_lora(peft_model)
    return peft_model, modules


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor of every trainable parameter (what a checkpoint stores)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
