"""The compute side of `retrograd serve`: served base models, LoRA training runs, and sampling.

A training run is its own module tree over the served base model's frozen tensors (shared, not
copied) with a PEFT LoRA adapter, so runs never see each other's adapters, an AdamW optimizer created at the first
`optim_step` and re-tuned from each step's AdamParams, and gradients that accumulate across
`forward_backward` calls until the step (Tinker's contract).

Sampling weights are plain tensor dicts (a snapshot of a run's adapter, or a sampler checkpoint
read from disk). They are swapped into a model with the same LoRA layout for the duration of one
request (`swapped_adapter`), then the run's own tensors are put back: a sampler never holds a
second copy of the base model.

Everything here runs on the server's single compute thread (service/server.py), so nothing in
this module locks.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms.optim import Dimuon, adamw, clip_gradients
from retrograd.algorithms.tinker_losses import REQUIRED_INPUTS, datum_loss, resolve_config
from retrograd.models.lora import ALIASES, attach_lora, block_linear_names
from retrograd.models.logprobs import Scorer
from retrograd.rl.sampler import eos_ids, sample, stop_string_check

ATTN = ("q", "k", "v", "o")
MLP = ("ffn_gate", "ffn_up", "ffn_down")
# tokens per forward/backward pass; a request's datums are split to fit (`retrograd serve
# --pass-tokens` sets it once at start-up: fewer tokens, less activation memory per pass)
PASS_TOKENS = 4096


class UserError(ValueError):
    """The client's request cannot be served as sent (a 400, or a failed future of category user)."""


@dataclass
class BaseModel:
    name: str  # what clients call it (base_model)
    path: str  # what load_model reads (also recorded in checkpoint manifests for `retrograd export`)
    model: torch.nn.Module
    tokenizer: object
    tokenizer_dir: str  # a local folder AutoTokenizer.from_pretrained can read (get_tokenizer)
    arch: str
    max_context: int
    hub_id: str | None = None  # the tokenizer's Hugging Face id, for clients on other machines


def lora_modules(model, train_attn: bool, train_mlp: bool) -> list[str]:
    """Leaf module names LoRA wraps for Tinker's train_attn / train_mlp switches."""
    available = block_linear_names(model)
    wanted = (ATTN if train_attn else ()) + (MLP if train_mlp else ())
    names = [n for alias in wanted for n in ALIASES[alias] if n in available]
    if not names:
        raise UserError("the LoRA config trains nothing: set train_attn and/or train_mlp")
    return list(dict.fromkeys(names))


@dataclass
class Run:
    """One training client's model (Tinker's model_id / training run)."""
    run_id: str
    base: BaseModel
    model: torch.nn.Module
    lora: dict  # rank, alpha, modules, seed, train_attn, train_mlp, train_unembed
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0  # optimizer steps taken (a checkpoint's `step`)
    optimizer_kind: str = "adamw"  # or "dimuon" (chosen at creation, as in Tinker)

    @classmethod
    def create(cls, run_id: str, base: BaseModel, rank: int, alpha: float, seed: int, train_attn=True,
               train_mlp=True, train_unembed=False) -> "Run":
        if not 1 <= rank <= 512:
            raise UserError(f"lora rank {rank} is out of range (1..512)")
        modules = lora_modules(base.model, train_attn, train_mlp)
        model, _ = attach_lora(shared_copy(base.model), rank, alpha, modules, 0.0, seed)
        model.train()
        # the LM head is never adapted here: train_unembed is reported as false, whatever was asked
        lora = {"rank": rank, "alpha": alpha, "modules": modules, "seed": seed, "train_attn": train_attn,
                "train_mlp": train_mlp, "train_unembed": False}
        run = cls(run_id, base, model, lora)
        run.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return run

    # ---- training ------------------------------------------------------------------------------
    def forward_backward(self, data, loss_fn: str, loss_fn_config: dict, forward_only: bool, custom=None):
        """Per-datum target log-probs and {"loss:sum": total}; accumulates gradients unless
        forward_only. `custom` (loss_fn "custom"): a server-side custom loss (service/custom_loss.py),
        whose own metrics are returned too."""
        config = resolve_config(loss_fn, loss_fn_config) if custom is None else {}
        checked = [_check_datum(i, d, "cross_entropy" if custom is not None else loss_fn,
                                self.base.model.config.vocab_size, self.base.max_context) for i, d in enumerate(data)]
        outputs, total, extra = [None] * len(data), 0.0, {}
        for chunk in _chunks(checked, PASS_TOKENS):
            loss, lps, metrics = self._pass(checked, chunk, loss_fn, config, forward_only, custom)
            for k, v in metrics.items():  # means weighted by their chunk's datums
                extra[k] = extra.get(k, 0.0) + (v * len(chunk) / len(data) if k.endswith(":mean") else v)
            total += loss
            for i, lp in zip(chunk, lps):
                outputs[i] = lp
        return outputs, {"loss:sum": total, **extra}

    def _pass(self, checked, chunk, loss_fn, config, forward_only, custom):
        """One pass over the datums `chunk`: (its loss, their log-probs as numpy, a custom loss's metrics).
        Its own function so that the pass's graph dies before the next pass allocates (why:
        train/sft.py SftTask._pass_backward)."""
        from retrograd.service import custom_loss
        metrics = {}
        with torch.set_grad_enabled(not forward_only):
            rows = [(checked[i][0], checked[i][1]["target_tokens"]) for i in chunk]
            lps = Scorer(self.model).target_logprobs(rows)
            if custom is None:
                loss = sum(datum_loss(loss_fn, lp, checked[i][1], config) for i, lp in zip(chunk, lps))
            else:
                loss, metrics = custom_loss.run(custom, lps, [checked[i][1] for i in chunk])
            if not forward_only and loss.requires_grad:
                loss.backward()
        return float(loss.detach()), [lp.detach().float().numpy() for lp in lps], metrics

    def optim_step(self, lr: float, beta1: float, grad_clip_norm: float, beta2: float = 0.95, eps: float = 1e-12,
                   weight_decay: float = 0.0) -> dict:
        """One step of the run's optimizer with this step's hyperparameters (AdamW reads them all,
        Dimuon lr and beta1)."""
        optimizer = self.ensure_optimizer()
        for g in optimizer.param_groups:
            if self.optimizer_kind == "dimuon":
                g.update(lr=lr, beta1=beta1)
            else:
                g.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        norm = clip_gradients(list(self.params.values()), grad_clip_norm)  # the norm before clipping
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        if set(tensors) != set(self.params):
            raise UserError(f"{source}: its tensors do not fit this LoRA layout "
                            f"({len(tensors)} tensors, the model has {len(self.params)})")
        with torch.no_grad():
            for n, p in self.params.items():
                if tensors[n].shape != p.shape:
                    raise UserError(f"{source}: {n} has shape {tuple(tensors[n].shape)}, expected {tuple(p.shape)}")
                p.copy_(tensors[n])

    def ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:  # hyperparameters are set again by every optim_step
            params = list(self.params.values())
            self.optimizer = (Dimuon(params, lr=0.0) if self.optimizer_kind == "dimuon" else
                              adamw(params, lr=0.0, betas=(0.9, 0.95), eps=1e-12))
        return self.optimizer

    # ---- sampling ------------------------------------------------------------------------------
    @contextmanager
    def swapped_adapter(self, tensors: dict[str, torch.Tensor] | None):
        """The run's model carrying `tensors` (None: its own) for one sampling request."""
        if tensors is None:
            yield self.model
            return
        originals = {n: p.data for n, p in self.params.items()}
        try:
            for n, p in self.params.items():
                p.data = tensors[n]
            yield self.model
        finally:
            for n, p in self.params.items():
                p.data = originals[n]


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree that shares the frozen base tensors (parameters and buffers):
    PEFT then wraps the copy's layers without touching the served base model, and a run costs its
    adapter, not another copy of the weights. (The sampler's generic path, `lora_folded`, re-points a
    shared weight's .data while one request runs on the compute thread; nothing else runs meanwhile.)"""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def _check_datum(i: int, d, loss_fn: str, vocab: int, max_context: int):
    """(tokens, torch inputs) after checking shapes, length and ids; errors name the datum."""
    n = len(d.tokens)
    if n == 0:
        raise UserError(f"datum {i}: model_input is empty")
    if n > max_context:
        raise UserError(f"datum {i}: {n} tokens exceed the model's context of {max_context}")
    if "target_tokens" not in d.inputs:
        raise UserError(f"datum {i}: loss_fn_inputs has no target_tokens")
    missing = [k for k in REQUIRED_INPUTS[loss_fn] if k not in d.inputs]
    if missing:
        raise UserError(f"datum {i}: loss {loss_fn} needs loss_fn_inputs {missing}")
    inputs = {}
    for name, arr in d.inputs.items():
        if arr.ndim == 0 or arr.shape[0] != n:
            raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}, but model_input has "
                            f"{n} tokens (position t of model_input predicts target_tokens[t])")
        inputs[name] = torch.from_numpy(np.ascontiguousarray(arr))
    targets = inputs["target_tokens"].long()
    if targets.ndim > 2 or (targets.ndim == 2 and loss_fn != "cross_entropy"):
        raise UserError(f"datum {i}: target_tokens must be [N] (or [N, K] for cross_entropy)")
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise UserError(f"datum {i}: target_tokens hold ids outside the vocabulary (0..{vocab - 1})")
    if min(d.tokens) < 0 or max(d.tokens) >= vocab:
        raise UserError(f"datum {i}: model_input holds token ids outside the vocabulary (0..{vocab - 1})")
    inputs["target_tokens"] = targets
    if "weights" in inputs and inputs["weights"].shape != targets.shape:
        raise UserError(f"datum {i}: weights must have the shape of target_tokens {list(targets.shape)}")
    return d.tokens, inputs


def _chunks(checked, budget: int) -> list[list[int]]:
    out, cur, width = [], [], 0
    for i, (tokens, _) in enumerate(checked):
        w = max(width, len(tokens))
        if cur and w * (len(cur) + 1) > budget:
            out.append(cur)
            cur, w = [], len(tokens)
        cur.append(i)
        width = w
    return out + ([cur] if cur else [])


def sample_sequences(model, tokenizer, prompt: list[int], num_samples: int, params: dict):
    """Checked SamplingParams (api.sampling_params) -> sequences (tokens, logprobs, stopped) from our
    sampler. stop: None -> EOS; [] -> nothing stops but max_tokens; token ids replace EOS; strings add
    to it."""
    max_tokens = params["max_tokens"]
    stop = params.get("stop")
    eos, strings = eos_ids(tokenizer, model), []
    if isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        eos = set(stop)
    elif isinstance(stop, list) and stop:
        strings = [str(s) for s in stop]
    elif isinstance(stop, list):
        eos = set()
    temperature = float(params.get("temperature", 1.0))
    seed = params.get("seed")
    gen = torch.Generator().manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    top_k = int(params.get("top_k", -1))
    out = sample(model, [prompt], num_samples, max_tokens, eos_ids=eos, pad_id=tokenizer.pad_token_id or 0,
                 generator=gen, temperature=temperature, top_k=top_k if top_k > 0 else 0,
                 top_p=float(params.get("top_p", 1.0)), stop=stop_string_check(tokenizer, strings))
    return [{"tokens": t, "logprobs": lp, "stopped": not tr}
            for t, lp, tr in zip(out.completion_ids, out.behaviour_logprobs, out.truncated)]


def read_base(name: str, path: str, log=print) -> BaseModel:
    from retrograd.models.lean_mlp import lean_mlp
    from retrograd.models.load import load_model
    loaded = load_model(path, "float32", log=log)
    model = loaded.model
    lean_mlp(model)  # what its training passes keep for backward: models/lean_mlp.py
    model.requires_grad_(False)
    model.eval()
    folder = Path(loaded.resolved)
    tok_dir = str(folder if folder.is_dir() else _converted_folder(loaded))
    cfg = model.config
    return BaseModel(name, path, model, loaded.tokenizer, tok_dir, getattr(cfg, "model_type", "unknown"),
                     int(getattr(cfg, "max_position_embeddings", 2048) or 2048), hub_id(path))


def hub_id(path: str) -> str | None:
    """The Hugging Face id of a served model's tokenizer when known: the built-in's upstream, or a
    name given as hf:ORG/NAME."""
    from retrograd.models.builtin import BUILTINS
    spec = BUILTINS.get(path.removeprefix("builtin:"))
    if spec is not None:
        return spec.hub_id
    return path.removeprefix("hf:") if path.startswith("hf:") else None


def _converted_folder(loaded) -> str:
    """The HF folder a .gguf / built-in model was converted into (holds its tokenizer files)."""
    path = getattr(loaded.model, "name_or_path", None) or getattr(loaded.model.config, "_name_or_path", "")
    return str(path)
