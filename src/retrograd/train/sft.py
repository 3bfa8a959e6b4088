"""SFT as a Task of the shared loop (train/loop.py): rows are chat / prompt-completion / text
examples, a step is the summed next-token loss of its micro-batches.

Loss normalisation: the summed token loss of all micro-batches of a step is divided by the number
of trained tokens of the whole step, so gradient accumulation gives the same update as one big
batch (TRL's and torchtune's convention).
"""
from __future__ import annotations

import torch

from retrograd.algorithms.sft import cross_entropy_sum_reference, linear_cross_entropy_sum, select_targets
from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.data.sampler import evenly_spaced
from retrograd.data.sft import Example, Renderer, collate, load_examples, resolve_data_path, split_by_tokens
from retrograd.train.loop import Setup, TrainResult, run_training

SftResult = TrainResult  # the name earlier versions exported

# rows of logits alive at once in the fused loss: 256 x 49k vocabulary x 4 B = 50 MB (1,024 rows
# cost ~250 MB more peak memory and were no faster)
CE_CHUNK_ROWS = 256
# configs that transform logits after the head; those models take the plain full-logits path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


class TokenLoss:
    """Summed next-token loss of a micro-batch, through the fused chunked head when the model's
    head is a plain linear layer (no [B, T, V] logits), else through the model's own logits."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.head = base.get_output_embeddings()
        self.decoder = getattr(base, base.base_model_prefix)
        self.base = base
        plain_head = isinstance(self.head, torch.nn.Linear) and self.head.bias is None
        transforms = any(getattr(base.config, k, None) not in (None, 1.0) for k in _LOGIT_TRANSFORMS)
        self.fused = plain_head and not transforms

    def hidden(self, batch: dict) -> torch.Tensor:
        return self.decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            use_cache=False).last_hidden_state  # [B, T, H]

    def logits(self, batch: dict) -> torch.Tensor:
        return self.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         use_cache=False).logits  # [B, T, V]

    def __call__(self, batch: dict) -> torch.Tensor:
        if not self.fused:
            return cross_entropy_sum_reference(self.logits(batch), batch["labels"])
        h, y = select_targets(self.hidden(batch), batch["labels"])  # [N, H], [N]
        return linear_cross_entropy_sum(h, self.head.weight, y, chunk_size=CE_CHUNK_ROWS)


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device) if v is not None else None) for k, v in batch.items()}


def evaluate(loss_fn: TokenLoss, model, examples: list[Example], batch_size: int, pad_id: int, device) -> float:
    """Mean next-token loss over every trained token of `examples`."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            total += float(loss_fn(to_device(collate(chunk, pad_id), device)))
            n += sum(e.n_targets for e in chunk)
    model.train(was_training)
    return total / max(1, n)


class SftTask:
    eval_metric = "loss"

    def __init__(self, s: Setup):
        tr, sft, ev = s.cfg.training, s.cfg.sft, s.cfg.evaluation
        self.s, self.tr, self.ev = s, tr, ev
        renderer = Renderer(s.tokenizer, tr.ctx, sft.assistant_only_loss, sft.template_variables)
        self.rows = load_examples(sft.data, sft.data_format, renderer)
        self.eval_rows = []
        if ev is not None:
            eval_all = load_examples(ev.data, sft.data_format, renderer)
            self.eval_rows = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
        truncated = sum(e.truncated for e in self.rows)
        s.log(f"data: {len(self.rows)} training rows ({truncated} truncated to ctx {tr.ctx})"
              + (f", {len(self.eval_rows)} evaluation rows" if ev else ""))
        self.shuffle = sft.shuffle
        self.rows_per_step = tr.batch_size * tr.gradient_accumulation
        self.step_description = (f"{self.rows_per_step} rows ({tr.batch_size} x {tr.gradient_accumulation} "
                                 "accumulation)")
        self.fingerprints = {"data": fingerprint_path(resolve_data_path(sft.data))}
        if ev is not None:
            self.fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
        self.loss_fn = TokenLoss(s.model)
        self.pad_id = s.tokenizer.pad_token_id

    def prepare(self, resume_path) -> None:
        pass

    def step(self, rows: list[Example]) -> dict:
        n_targets = sum(e.n_targets for e in rows)
        loss_sum, n_tokens = 0.0, 0
        for i in range(0, len(rows), self.tr.batch_size):
            for chunk in split_by_tokens(rows[i:i + self.tr.batch_size], self.s.pass_tokens):
                loss = self.loss_fn(to_device(collate(chunk, self.pad_id), self.s.device))
                (loss / n_targets).backward()
                loss_sum += float(loss.detach())
                n_tokens += sum(len(e.input_ids) for e in chunk)
        return {"train/loss": loss_sum / n_targets, "train/tokens": n_tokens, "train/target_tokens": n_targets}

    def evaluate(self) -> dict:
        bs = self.ev.batch_size or self.tr.batch_size
        return {"eval/loss": evaluate(self.loss_fn, self.s.model, self.eval_rows, bs, self.pad_id, self.s.device)}


def train_sft(cfg, resume: str | None = None, log=print) -> TrainResult:
    return run_training(cfg, SftTask, resume, log)
