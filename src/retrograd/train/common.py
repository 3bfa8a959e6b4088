"""Run plumbing shared by every training loop: seeding and RNG capture, stop signals, the run
folder, and writing the final result to [output].path. (Device choices live in retrograd/device.py,
the optimizer step in algorithms/optim.py.)

Loops call these explicitly; nothing here owns the loop.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from retrograd.config.load import dump_toml, output_kind


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopRequest:
    """SIGINT / SIGTERM set a flag that the loop checks after each optimizer step, so the run
    saves a checkpoint and its output and exits cleanly. A second signal stops at once, unless it
    comes within a second of the first: Ctrl-C under torchrun reaches each rank twice (from the
    terminal and forwarded by torchrun), and that is still one request."""

    def __init__(self):
        self.signal: int | None = None
        self._first_at = 0.0
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.signal is not None:
            if time.monotonic() - self._first_at < 1.0:
                return
            raise KeyboardInterrupt
        self.signal, self._first_at = signum, time.monotonic()
        name = signal.Signals(signum).name
        from retrograd import dist
        if dist.current().main:
            print(f"\n{name} received: finishing this step, then saving and exiting "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 0


def prepare_run_dir(cfg) -> Path:
    run_dir = Path(cfg.run.directory)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg), encoding="utf-8")
    return run_dir


def _replace_dir(staging: Path, final: Path) -> None:
    old = final.with_name(f".replaced-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def save_output(model, tokenizer, cfg) -> Path:
    """Write the final result: a llama.cpp GGUF adapter, a PEFT adapter folder (LoRA) or an HF model
    folder (full). Written beside the target and renamed into place, so a kill never leaves half a result."""
    final = Path(cfg.output.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    if output_kind(cfg) == "adapter":
        from peft import get_peft_model_state_dict
        from retrograd.export.gguf_lora import write_gguf_lora
        return write_gguf_lora(final, get_peft_model_state_dict(model), cfg.lora.alpha, model.config, cfg.lora.dtype)
    if output_kind(cfg) == "model" and final.suffix == ".gguf":
        # a standalone llama.cpp model with the trained weights
        from retrograd.export.gguf_merged import write_model_gguf
        lora = ({"rank": cfg.lora.rank, "alpha": cfg.lora.alpha} if cfg.training.trainable == "lora" else None)
        return write_model_gguf(cfg.model.path, model, tokenizer, lora, final, "f32")
    staging = final.with_name(f".staging-{final.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    if output_kind(cfg) == "model" and cfg.training.trainable == "lora":
        # a standalone HF model with the adapter merged into the weights (the run is over, so the
        # live model can be merged in place)
        model.merge_and_unload().save_pretrained(str(staging), safe_serialization=True)
    elif cfg.training.trainable == "lora":
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cfg.lora.dtype]
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in get_peft_model_state_dict(model).items()}
        staging.mkdir(parents=True)
        save_file(state, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config["default"].save_pretrained(str(staging))
    else:
        model.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    _replace_dir(staging, final)
    return final
