"""Load a causal LM and its tokenizer from an HF folder, a .gguf file, or a built-in alias.

A .gguf is de-quantised by transformers once and the result is kept as an HF folder in
`$RETROGRAD_HOME/converted/<sha256>/`: later loads take a second instead of ~20 s, and the
de-quantisation's memory peak is paid only once. The model's fingerprint is the SHA-256 of
the file or folder it came from.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.checkpoint.fingerprint import cached_sha256, fingerprint_path
from retrograd.errors import ModelError
from retrograd.models.builtin import BUILTINS, builtin_gguf, is_builtin
from retrograd.models.cpu_gemm import route_linears
from retrograd.paths import home

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what the user named
    resolved: str  # the file or folder actually read
    fingerprint: str


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def _finish(model, tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # A model loaded from GGUF keeps a quantizer marker although its weights are plain tensors;
    # transformers would then refuse to save or train it. Strip it.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False
    route_linears(model)  # float32 products through oneDNN where that library is this CPU's faster one
    return model, tokenizer


def _from_folder(folder: str, dtype, weights: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        if weights:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        else:  # the architecture only: parameters and buffers on the meta device, nothing read or allocated
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load a causal language model from {folder}: {e}") from None
    return _finish(model, tok)


def _converted_gguf(gguf: Path, dtype, log) -> tuple[str, str]:
    """HF folder converted from `gguf` (made once); returns (folder, sha256 of the gguf)."""
    digest = cached_sha256(gguf)
    folder = home() / "converted" / digest[:24]
    if (folder / ".complete").exists():
        return str(folder), digest
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log(f"converting {gguf.name} to an HF folder (once) ...")
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelError(f"loading {gguf} needs the 'gguf' package: pip install gguf ({e})") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"cannot load {gguf} as a causal language model: {e}") from None
    model, tok = _finish(model, tok)
    staging = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    (staging / ".complete").write_text(str(gguf) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)
    del model
    return str(folder), digest


def load_model(path: str, dtype: str = "float32", log=print, weights: bool = True) -> LoadedModel:
    """Load model + tokenizer. Raises ModelError with the path when it cannot. `weights=False` builds the
    model on the meta device without reading its weights (an FSDP2 rank that receives its shards from
    rank 0: dist.shard_model); a .gguf is converted first all the same, unless already cached."""
    _quiet_transformers()
    torch_dtype = DTYPES[dtype]
    name = path
    if is_builtin(path):
        gguf = builtin_gguf(path, log)
        folder, digest = _converted_gguf(gguf, torch_dtype, log)
        model, tok = _from_folder(folder, torch_dtype, weights)
        return LoadedModel(model, tok, name, str(gguf), digest)
    p = Path(os.path.expanduser(path))
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelError(f"model.path {path}: a file must be a .gguf model; for an HF model give its folder")
        folder, digest = _converted_gguf(p.resolve(), torch_dtype, log)
        model, tok = _from_folder(folder, torch_dtype, weights)
        return LoadedModel(model, tok, name, str(p.resolve()), digest)
    if p.is_dir():
        if not (p / "config.json").exists():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return load_model(str(ggufs[0]), dtype, log, weights)
            raise ModelError(f"model.path {path}: the folder has no config.json (not an HF model folder)")
        model, tok = _from_folder(str(p), torch_dtype, weights)
        return LoadedModel(model, tok, name, str(p.resolve()), fingerprint_path(p))
    if path.startswith("hf:") and _HUB_ID.match(path[3:]):
        # an explicit hub id needs the network; nothing in the tests uses one
        model, tok = _from_folder(path[3:], torch_dtype, weights)
        return LoadedModel(model, tok, name, path, path)
    raise ModelError(f"model.path {path!r} does not exist: give an HF model folder, a .gguf file, a built-in "
                     f"alias ({', '.join(BUILTINS)}) or hf:ORG/NAME for a Hugging Face Hub id")


def model_fingerprint(path: str) -> str:
    """A content fingerprint of a model path without loading it (for a [reference] model)."""
    if is_builtin(path):
        return fingerprint_path(builtin_gguf(path, lambda *_: None))
    p = Path(os.path.expanduser(path))
    if p.exists():
        return fingerprint_path(p)
    return path
