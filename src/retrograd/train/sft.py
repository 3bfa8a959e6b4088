"""SFT as a Task of the offline loop (train/offline.py): rows are chat / prompt-completion / text
examples, a step is the summed next-token loss of its micro-batches.

Loss normalisation: the summed token loss of all micro-batches of a step is divided by the number
of trained tokens of the whole step, so gradient accumulation gives the same update as one big
batch (TRL's and torchtune's convention).
"""
from __future__ import annotations

import torch

from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.data.sampler import evenly_spaced
from retrograd.data.sft import Example, Renderer, collate, load_examples, resolve_data_path, split_by_tokens
from retrograd.models.logprobs import Scorer, to_device
from retrograd.train.offline import train_offline
from retrograd.train.setup import Run, TrainResult

SftResult = TrainResult  # the name earlier versions exported


def evaluate(scorer: Scorer, model, examples: list[Example], batch_size: int, pad_id: int, device) -> float:
    """Mean next-token loss over every trained token of `examples`."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            total += float(scorer.loss_sum(to_device(collate(chunk, pad_id), device)))
            n += sum(e.n_targets for e in chunk)
    model.train(was_training)
    return total / max(1, n)


class SftTask:
    eval_metric = "loss"

    def __init__(self, run: Run):
        tr, sft, ev = run.cfg.training, run.cfg.sft, run.cfg.evaluation
        self.run, self.tr, self.ev = run, tr, ev
        renderer = Renderer(run.tokenizer, tr.ctx, sft.assistant_only_loss, sft.template_variables)
        self.rows = load_examples(sft.data, sft.data_format, renderer)
        self.eval_rows = []
        if ev is not None:
            eval_all = load_examples(ev.data, sft.data_format, renderer)
            self.eval_rows = [eval_all[i] for i in evenly_spaced(len(eval_all), ev.max_examples)]
        truncated = sum(e.truncated for e in self.rows)
        run.log(f"data: {len(self.rows)} training rows ({truncated} truncated to ctx {tr.ctx})"
                + (f", {len(self.eval_rows)} evaluation rows" if ev else ""))
        self.shuffle = sft.shuffle
        self.epochs = tr.epochs
        self.rows_per_step = tr.batch_size * tr.gradient_accumulation
        self.step_description = (f"{self.rows_per_step} rows ({tr.batch_size} x {tr.gradient_accumulation} "
                                 "accumulation)")
        self.fingerprints = {"data": fingerprint_path(resolve_data_path(sft.data))}
        if ev is not None:
            self.fingerprints["eval_data"] = fingerprint_path(resolve_data_path(ev.data))
        self.scorer = Scorer(run.model)
        self.pad_id = run.tokenizer.pad_token_id
        self.loss_scale = 1.0

    def prepare(self, resume_path) -> None:
        pass

    def step(self, rows: list[Example]) -> dict:
        n_targets = sum(e.n_targets for e in rows)
        loss_sum, n_tokens = 0.0, 0
        for i in range(0, len(rows), self.tr.batch_size):
            for chunk in split_by_tokens(rows[i:i + self.tr.batch_size], self.run.pass_tokens):
                loss_sum += self._pass_backward(chunk, n_targets)
                n_tokens += sum(len(e.input_ids) for e in chunk)
        return {"train/loss": loss_sum / n_targets, "train/tokens": n_tokens, "train/target_tokens": n_targets}

    def _pass_backward(self, chunk: list[Example], n_targets: int) -> float:
        """One pass's forward and backward; returns its summed loss. A function of its own so that the
        pass's autograd graph dies at the return, before the next pass's forward allocates. Held by a
        loop variable (as `loss` was), the freed graph's thousands of small nodes stay in the heap
        between the freed activations and split them, so the next pass could not reuse that memory:
        +250-300 MB peak RSS for 512-token passes of SmolLM2 (2.25 GB -> 2.0 GB). Every loop that
        runs several passes per step does the same (policy_update, preference, distill_offline, the
        service's engine)."""
        loss = self.scorer.loss_sum(to_device(collate(chunk, self.pad_id), self.run.device))
        (loss / n_targets * self.loss_scale).backward()
        return float(loss.detach())

    def loss_weight(self, rows: list[Example]) -> float:
        return float(sum(e.n_targets for e in rows))  # step's loss is a mean over target tokens

    def evaluate(self) -> dict:
        bs = self.ev.batch_size or self.tr.batch_size
        return {"eval/loss": evaluate(self.scorer, self.run.model, self.eval_rows, bs, self.pad_id, self.run.device)}


def train_sft(cfg, resume: str | None = None, log=print) -> TrainResult:
    return train_offline(cfg, SftTask, resume, log)
