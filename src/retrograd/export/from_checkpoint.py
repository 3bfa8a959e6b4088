"""`retrograd export CHECKPOINT --format gguf|peft|hf --out PATH`: rebuild the model a `.state`
checkpoint was trained on (its manifest names the base model and the LoRA layout), load the saved
tensors, and write the requested format.

  gguf  llama.cpp LoRA adapter (LoRA checkpoints)
  peft  PEFT adapter folder (LoRA checkpoints)
  hf    HF model folder: the LoRA merged into the weights, or the fully fine-tuned model
  gguf-merged  a standalone llama.cpp GGUF with the LoRA merged in, or the full fine-tune
               (f32 / f16 / q8_0), from a GGUF base's metadata or an HF base's config + tokenizer
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from retrograd.checkpoint.state import verify_state
from retrograd.errors import CheckpointError, ConfigError

FORMATS = ("gguf", "peft", "hf", "gguf-merged")


def _check_target(out: Path, force: bool, needed_bytes: int) -> None:
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it")
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
    if free < needed_bytes:
        raise ConfigError(f"not enough disk space for {out}: about {needed_bytes / 1e6:.0f} MB needed, "
                          f"{free / 1e6:.0f} MB free")


def base_gguf(model_path: str) -> Path | None:
    """The GGUF file the base model was loaded from (the built-in model included), or None."""
    from retrograd.models.builtin import builtin_gguf, is_builtin
    if is_builtin(model_path):
        return builtin_gguf(model_path)
    if model_path.endswith(".gguf") and Path(model_path).is_file():
        return Path(model_path)
    return None


def load_checkpoint_model(checkpoint: str | Path, log=print):
    """(model, tokenizer, lora layout or None, manifest) rebuilt from a verified .state checkpoint."""
    from retrograd.models.load import load_model
    from retrograd.models.lora import attach_lora

    checkpoint = Path(checkpoint)
    manifest = verify_state(checkpoint)
    base = manifest.get("base")
    if not base:
        raise CheckpointError(f"{checkpoint}: its manifest does not record the base model (written by an older "
                              "retrograd); use a checkpoint of a current run")
    lora = base.get("lora")
    loaded = load_model(base["model"], base["dtype"], log=log)
    model = loaded.model
    if lora:
        model, _ = attach_lora(model, lora["rank"], lora["alpha"], lora["modules"], 0.0, 0)
    if (checkpoint / ".metadata").exists():  # an FSDP2 run's shards: re-cut into this one process's model
        from retrograd.dist import load_sharded
        load_sharded(model, None, checkpoint)
        return model, loaded.tokenizer, lora, manifest
    tensors = load_file(str(checkpoint / "weights.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n in tensors if n not in params]
    if missing:
        raise CheckpointError(f"{checkpoint}: tensors {missing[:3]} do not fit the model {base['model']}")
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
    return model, loaded.tokenizer, lora, manifest


def export_checkpoint(checkpoint: str | Path, fmt: str, out: str | Path, dtype: str = "f32", force: bool = False,
                      log=print) -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    manifest = verify_state(checkpoint)
    lora = (manifest.get("base") or {}).get("lora")
    if manifest.get("base") and fmt in ("gguf", "peft") and lora is None:
        raise ConfigError(f"--format {fmt} writes a LoRA adapter, but {checkpoint} is a full fine-tune; use --format hf")
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer, lora, manifest = load_checkpoint_model(checkpoint, log)
    _check_target(out, force, manifest["files"]["weights.safetensors"]["bytes"] if lora and fmt in ("gguf", "peft")
                  and "weights.safetensors" in manifest["files"] else 4 * sum(p.numel() for p in model.parameters()))

    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    if fmt == "gguf-merged":
        from retrograd.export.gguf_merged import write_model_gguf
        return write_model_gguf(manifest["base"]["model"], model, tokenizer, lora, out, dtype)
    if fmt == "gguf":
        from peft import get_peft_model_state_dict
        from retrograd.export.gguf_lora import check_exportable, write_gguf_lora
        check_exportable(model.config, lora["modules"])
        return write_gguf_lora(out, get_peft_model_state_dict(model), lora["alpha"], model.config, dtype)
    if fmt == "peft":
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
        out.mkdir(parents=True)
        state = {k: v.detach().to(torch_dtype).contiguous() for k, v in get_peft_model_state_dict(model).items()}
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config["default"].save_pretrained(str(out))
    else:
        (model.merge_and_unload() if lora else model).save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
    return out
