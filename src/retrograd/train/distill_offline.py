"""Offline top-k distillation ([distill] mode = "topk_offline"): the teacher runs once, training never.

`retrograd distill-teacher run.toml [--k 16] --out F.topk` (write_teacher_topk) renders the rows of
distill.data (and [evaluation].data) exactly as training will, runs the teacher over them, and keeps at
every trained position its k most likely tokens and their log-probabilities. The .topk file is a
safetensors file: per split ("train", "eval") the tensors ids [P, k] int32, logprobs [P, k] float32 and
offsets [rows + 1] int64 (row r owns positions offsets[r]:offsets[r+1]), and a header (safetensors
metadata) with the format version, k, row counts, vocabulary size, the tokenizer's hash, the data
files' fingerprints, training.ctx and the teacher. Training refuses the file when any of these no
longer matches what it would render (a changed tokenizer or data file would silently pair positions
with another text's targets).

Training (TopkTask, a Task of the offline loop in train/offline.py) minimises at every trained position
the forward KL(teacher || student) over k + 1 buckets, the top-k tokens and the tail mass
(models/fused_head.linear_topk_kl_sum: chunked, never [B, T, V]; under FSDP2, whose model gathers its
head inside its own forward only, from that forward's logits). Evaluation reads the eval split: the
same KL per position and the top-1 agreement with the teacher.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from retrograd.checkpoint.fingerprint import fingerprint_path
from retrograd.data.sampler import evenly_spaced
from retrograd.data.sft import Example, Renderer, collate, load_examples, resolve_data_path, split_by_tokens
from retrograd.device import configure_torch, pick_device
from retrograd.errors import ConfigError
from retrograd.models.fused_head import linear_topk_kl_sum, select_targets, topk_bucket_kl
from retrograd.models.load import load_model, model_fingerprint
from retrograd.models.logprobs import CE_CHUNK_ROWS, Scorer, to_device
from retrograd.train.offline import train_offline
from retrograd.train.setup import Run, TrainResult

TOPK_FORMAT = "retrograd-topk"
TOPK_VERSION = 1
MAX_K = 256
TEACHER_PASS_TOKENS = 4096  # rows x padded length per teacher forward


def tokenizer_hash(tok) -> str:
    """What decides the token ids of a rendered row: the vocabulary, the special tokens and the chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([tok.bos_token, tok.eos_token, tok.pad_token, sorted(tok.all_special_tokens)]).encode())
    h.update((tok.chat_template or "").encode())
    return h.hexdigest()


def render(tok, data: str, ctx: int, template_variables: dict) -> list[Example]:
    """The rows as training sees them: chat / prompt-completion rows train the assistant turns, text
    trains every token (as [sft] with assistant_only_loss = true)."""
    return load_examples(data, "auto", Renderer(tok, ctx, True, template_variables))


def _header(cfg, tok, vocab_size: int, k: int) -> dict:
    """The facts the file must agree with at training time (the safetensors metadata: str -> str)."""
    d, ev = cfg.distill, cfg.evaluation
    return {"format": TOPK_FORMAT, "version": str(TOPK_VERSION), "k": str(k), "vocab_size": str(vocab_size),
            "tokenizer_hash": tokenizer_hash(tok), "ctx": str(cfg.training.ctx),
            "template_variables": json.dumps(d.template_variables, sort_keys=True),
            "source_hash": fingerprint_path(resolve_data_path(d.data)),
            "eval_source_hash": fingerprint_path(resolve_data_path(ev.data)) if ev is not None else "",
            "teacher_fingerprint": model_fingerprint(d.teacher_path)}


@torch.no_grad()
def _teacher_topk(teacher: Scorer, rows: list[Example], k: int, pad_id: int, device) -> dict[str, torch.Tensor]:
    ids, logp = [], []
    for chunk in split_by_tokens(rows, TEACHER_PASS_TOKENS):
        for dist, _ in teacher.labelled_distributions(to_device(collate(chunk, pad_id), device)):
            top = dist.topk(k, dim=-1)
            ids.append(top.indices.to(torch.int32).cpu())
            logp.append(top.values.float().cpu())
    offsets = torch.tensor([0] + [e.n_targets for e in rows]).cumsum(0)
    return {"ids": torch.cat(ids), "logprobs": torch.cat(logp), "offsets": offsets}


def write_teacher_topk(cfg, k: int, out: str | None, log=print) -> dict:
    """`retrograd distill-teacher`: score distill.data (and [evaluation].data) with the teacher; write `out`."""
    from safetensors.torch import save_file
    d = cfg.distill
    if cfg.run.algorithm != "distill" or d.mode != "topk_offline":
        raise ConfigError(f"{cfg.source}: distill-teacher needs [run] algorithm = \"distill\" and [distill] "
                          "mode = \"topk_offline\"")
    if not 1 <= k <= MAX_K:
        raise ConfigError(f"--k {k}: give 1 to {MAX_K} tokens per position")
    path = Path(out or d.sidecar)
    configure_torch(cfg.training.threads)
    device = pick_device(cfg.model.device)
    student = load_model(cfg.model.path, cfg.model.dtype, log=log)  # for its tokenizer only: one model at a time
    tok = student.tokenizer
    del student
    teacher = load_model(d.teacher_path, cfg.model.dtype, log=log)
    if teacher.tokenizer.get_vocab() != tok.get_vocab():
        raise ConfigError(f"distill.teacher_path {d.teacher_path} and model.path {cfg.model.path} have different "
                          "tokenizers: distillation compares the two models' probabilities of the same token ids")
    scorer = Scorer(teacher.model.to(device).eval())
    vocab = scorer.head.weight.shape[0]
    if k > vocab:
        raise ConfigError(f"--k {k} is more than the vocabulary ({vocab} tokens)")
    splits = {"train": render(tok, d.data, cfg.training.ctx, d.template_variables)}
    if cfg.evaluation is not None:
        ev_rows = render(tok, cfg.evaluation.data, cfg.training.ctx, d.template_variables)
        splits["eval"] = [ev_rows[i] for i in evenly_spaced(len(ev_rows), cfg.evaluation.max_examples)]
    tensors, header = {}, _header(cfg, tok, vocab, k)
    for split, rows in splits.items():
        for name, t in _teacher_topk(scorer, rows, k, tok.pad_token_id, device).items():
            tensors[f"{split}.{name}"] = t.contiguous()
        header[f"{split}_rows"] = str(len(rows))
        log(f"{split}: {len(rows)} rows, {tensors[f'{split}.ids'].shape[0]} positions, top-{k} of the teacher")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=header)
    os.replace(tmp, path)  # a reader never sees half a file
    log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return {"path": str(path), **header}


def load_topk(path: str, expected: dict, rows: dict[str, list[Example]]) -> dict[str, dict[str, torch.Tensor]]:
    """Read a .topk file and refuse it unless it was written for exactly these rows and this tokenizer."""
    from safetensors import SafetensorError, safe_open
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"distill.sidecar {path} does not exist: write it first with "
                          "`retrograd distill-teacher run.toml --out " + str(path) + "`")
    try:
        with safe_open(str(p), "pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"distill.sidecar {path}: not a readable .topk file ({e})") from None
    if header.get("format") != TOPK_FORMAT or header.get("version") != str(TOPK_VERSION):
        raise ConfigError(f"distill.sidecar {path}: not a {TOPK_FORMAT} v{TOPK_VERSION} file "
                          f"(format {header.get('format')!r}, version {header.get('version')!r})")
    why = {"tokenizer_hash": "the tokenizer (or its chat template) changed", "source_hash": "distill.data changed",
           "eval_source_hash": "[evaluation].data changed (or was added / removed)",
           "ctx": "training.ctx changed", "template_variables": "distill.template_variables changed",
           "teacher_fingerprint": "distill.teacher_path is not the teacher that wrote it",
           "vocab_size": "the vocabulary size differs"}
    for key, reason in why.items():
        if header.get(key) != expected[key]:
            raise ConfigError(f"distill.sidecar {path}: {reason} since it was written; run `retrograd "
                              f"distill-teacher` again")
    out = {}
    for split, examples in rows.items():
        if f"{split}.offsets" not in tensors:
            raise ConfigError(f"distill.sidecar {path} has no {split} split; run `retrograd distill-teacher` again")
        t = {k: tensors[f"{split}.{k}"] for k in ("ids", "logprobs", "offsets")}
        counts = (t["offsets"][1:] - t["offsets"][:-1]).tolist()
        if len(counts) != len(examples):
            raise ConfigError(f"distill.sidecar {path}: {len(counts)} {split} rows, the data renders {len(examples)}")
        for e, n in zip(examples, counts):
            if e.n_targets != n:
                raise ConfigError(f"distill.sidecar {path}: {e.where} has {e.n_targets} trained tokens, the file "
                                  f"{n}; run `retrograd distill-teacher` again")
        t["ids"] = t["ids"].long()
        out[split] = t
    return out


class TopkTask:
    """A Task of the offline loop: rows are (row index, Example); a step sums the top-k KL of its rows."""
    eval_metric = "teacher_kl"

    def __init__(self, run: Run):
        cfg, tr, d, ev = run.cfg, run.cfg.training, run.cfg.distill, run.cfg.evaluation
        self.run, self.tr, self.ev = run, tr, ev
        self.scorer = Scorer(run.model)
        self.loss_scale = 1.0  # the offline loop sets it under FSDP2
        if not self.scorer.fusable:
            raise ConfigError(f"model.path {cfg.model.path}: offline top-k distillation needs a plain linear LM head "
                              "(this model transforms its logits); use mode = \"on_policy\"")
        tok = run.tokenizer
        examples = {"train": render(tok, d.data, tr.ctx, d.template_variables)}
        if ev is not None:
            ev_rows = render(tok, ev.data, tr.ctx, d.template_variables)
            examples["eval"] = [ev_rows[i] for i in evenly_spaced(len(ev_rows), ev.max_examples)]
        expected = _header(cfg, tok, self.scorer.head.weight.shape[0], 0)
        self.topk = load_topk(d.sidecar, expected, examples)
        self.rows = list(enumerate(examples["train"]))
        self.eval_rows = list(enumerate(examples.get("eval", [])))
        self.k = self.topk["train"]["ids"].shape[1]
        run.log(f"data: {len(self.rows)} training rows with the teacher's top-{self.k} from {d.sidecar}"
                + (f", {len(self.eval_rows)} evaluation rows" if ev else ""))
        self.epochs = d.offline_epochs
        self.shuffle = True
        self.rows_per_step = tr.batch_size * tr.gradient_accumulation
        self.step_description = f"{self.rows_per_step} rows ({tr.batch_size} x {tr.gradient_accumulation} accumulation)"
        self.fingerprints = {"data": expected["source_hash"], "topk": fingerprint_path(d.sidecar)}
        self.pad_id = tok.pad_token_id

    def prepare(self, resume_path) -> None:
        pass

    def _targets(self, split: str, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k of `rows`' positions, in the order select_targets returns them."""
        t = self.topk[split]
        index = torch.cat([torch.arange(int(t["offsets"][i]), int(t["offsets"][i + 1])) for i, _ in rows])
        return t["ids"][index].to(self.run.device), t["logprobs"][index].to(self.run.device)

    def step(self, rows: list) -> dict:
        n_targets = sum(e.n_targets for _, e in rows)
        loss_sum, n_tokens = 0.0, 0
        for i in range(0, len(rows), self.tr.batch_size):
            micro = rows[i:i + self.tr.batch_size]
            by_example = {id(e): (j, e) for j, e in micro}
            for chunk in split_by_tokens([e for _, e in micro], self.run.pass_tokens):
                loss_sum += self._pass_backward(chunk, [by_example[id(e)] for e in chunk], n_targets)
                n_tokens += sum(len(e.input_ids) for e in chunk)
        return {"train/loss": loss_sum / n_targets, "distill/topk_kl": loss_sum / n_targets, "train/tokens": n_tokens,
                "train/target_tokens": n_targets, "distill/topk_entries": self.k}

    def _pass_backward(self, chunk: list, indexed: list, n_targets: int) -> float:
        """One pass's forward and backward; returns its summed KL. Its own function so that the pass's
        graph dies before the next pass allocates (why: train/sft.py SftTask._pass_backward)."""
        batch = to_device(collate(chunk, self.pad_id), self.run.device)
        ids, logp = self._targets("train", indexed)
        if self.scorer.fused:  # chunked: never [positions, V] logits
            h, _ = select_targets(self.scorer.hidden(batch), batch["labels"])
            loss = linear_topk_kl_sum(h, self.scorer.head.weight, ids, logp, CE_CHUNK_ROWS)
        else:  # a sharded (FSDP2) model: its own forward gathers the head, so the KL reads its logits
            loss = sum(topk_bucket_kl(student, ids[s:s + len(y)], logp[s:s + len(y)].float()).sum()
                       for s, (student, y) in zip(range(0, len(ids), CE_CHUNK_ROWS),
                                                  self.scorer.labelled_distributions(batch)))
        (loss / n_targets * self.loss_scale).backward()
        return float(loss.detach())

    def loss_weight(self, rows: list) -> float:
        return float(sum(e.n_targets for _, e in rows))  # step's loss is a mean over target tokens

    @torch.no_grad()
    def evaluate(self) -> dict:
        model = self.run.model
        was_training = model.training
        model.eval()
        kl, same, n = 0.0, 0, 0
        bs = self.ev.batch_size or self.tr.batch_size
        for i in range(0, len(self.eval_rows), bs):
            rows = self.eval_rows[i:i + bs]
            batch = to_device(collate([e for _, e in rows], self.pad_id), self.run.device)
            ids, logp = self._targets("eval", rows)
            s = 0
            for student, y in self.scorer.labelled_distributions(batch):  # [C, V] float32, C <= CE_CHUNK_ROWS
                kl += float(topk_bucket_kl(student, ids[s:s + len(y)], logp[s:s + len(y)].float()).sum())
                same += int((student.argmax(-1) == ids[s:s + len(y), 0]).sum())
                s += len(y)
            n += s
        model.train(was_training)
        return {"eval/teacher_kl": kl / max(1, n), "eval/top1_agreement": same / max(1, n)}


def train_topk_offline(cfg, resume: str | None = None, log=print) -> TrainResult:
    return train_offline(cfg, TopkTask, resume, log)
