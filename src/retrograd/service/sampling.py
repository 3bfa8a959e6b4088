"""Samplers and sampling of `retrograd serve`: sampling sessions (their weights: a run's snapshot, a
checkpoint, or the base model), `asample` in slices that share the compute thread fairly, prompt
log-probs (all, top-k, the last N), copies of a SamplingClient joining their session, and the samples
recorded for stable_reinforce (`record_stability_info`), with the check of a training datum's
provenance against them.

A session keeps its `samplers_per_session` newest samplers: each holds a weight snapshot, and an RL
loop makes one per iteration.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
from safetensors.torch import load_file

from retrograd.models.logprobs import Scorer
from retrograd.service import validate as v, wire
from retrograd.service.engine import BaseModel, Run, sample_sequences
from retrograd.service.errors import HttpError, not_found
from retrograd.service.registry import Caller

RECORDED_SEQUENCES = 100_000  # samples kept for stable_reinforce (record_stability_info), newest


@dataclass
class Sampler:
    sampler_id: str
    owner: str
    base: BaseModel
    model_path: str | None  # the tinker path it was made from, if any
    tensors: dict | None  # adapter tensors; None samples the base model
    lora: dict | None
    origin_run: str | None


class Sampling:
    """The service's samplers; `svc` is the Service (sessions, checkpoints, runs, the executor)."""

    def __init__(self, svc):
        self.svc = svc
        self.samplers: dict[str, Sampler] = {}  # in creation order (the oldest of a session leaves first)
        self.clone_counters: dict[str, int] = {}  # sampling session -> SamplingClient copies joined
        # sequence id -> (owner, tokens, log-probs) of samples drawn with record_stability_info (newest last)
        self.recorded: dict[str, tuple[str, list[int], list[float]]] = {}
        self.hosts: dict[tuple, Run] = {}  # models that carry sampler tensors when their run is not live

    def release(self, session_id: str) -> None:
        """Forget a finished session's samplers."""
        for sid in [s for s in self.samplers if s.startswith(session_id + ":")]:
            del self.samplers[sid]
            self.clone_counters.pop(sid, None)

    def create_session(self, caller: Caller, body: dict) -> dict:
        session = self.svc._live_session(caller, body.get("session_id"))
        sampler_id = f"{session}:sample:{v.integer(body, 'sampling_session_seq_id', 0, lo=0)}"
        self.keep(sampler_id, self._make(caller, sampler_id, body.get("model_path"), body.get("base_model")))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def keep(self, sampler_id: str, sampler: Sampler) -> None:
        """Register a sampler; a session keeps its newest `samplers_per_session` (each holds a weight
        snapshot, and an RL loop makes one per iteration: without this memory grows with every step)."""
        self.samplers.pop(sampler_id, None)
        self.samplers[sampler_id] = sampler
        prefix = sampler_id.split(":", 1)[0] + ":"
        mine = [s for s in self.samplers if s.startswith(prefix)]
        for old in mine[:max(0, len(mine) - self.svc.limits.samplers_per_session)]:
            del self.samplers[old]

    def _make(self, caller: Caller, sampler_id: str, model_path, base_model) -> Sampler:
        if model_path:
            row = self.svc.checkpoints.find(caller, model_path, readable=True)
            if row.kind == "external":
                raise HttpError(400, f"{row.tinker_path} is an external (PEFT) export; sample from its "
                                     "sampler_weights or weights checkpoint")
            folder, manifest = self.svc.checkpoints.verified(row)
            info = manifest["service"]
            base = self.svc._base(info["base_model"])
            self.svc._may_sample(caller, base.name)
            return Sampler(sampler_id, caller.owner, base, row.tinker_path,
                           load_file(str(folder / "weights.safetensors")), info["lora"], row.run_id)
        base = self.svc._base(base_model)
        self.svc._may_sample(caller, base.name)
        return Sampler(sampler_id, caller.owner, base, None, None, None, None)

    def join(self, caller: Caller, body: dict) -> dict:
        """A copy of a SamplingClient (unpickled elsewhere) gets a counter of its own in the session."""
        sid = v.string(body, "sampling_session_id")
        s = self.samplers.get(sid)
        if s is None or s.owner != caller.owner:
            raise not_found(f"sampling session {sid!r}")
        self.clone_counters[sid] = self.clone_counters.get(sid, 0) + 1
        return {"type": "join_sampling_session", "client_counter": self.clone_counters[sid]}

    def get(self, caller: Caller, sampler_id: str) -> dict:
        s = self.samplers.get(sampler_id)
        if s is None or s.owner != caller.owner:
            raise not_found(f"sampler {sampler_id!r} (a session keeps its {self.svc.limits.samplers_per_session} newest)")
        return {"sampler_id": sampler_id, "base_model": s.base.name, "model_path": s.model_path}

    def asample(self, caller: Caller, body: dict) -> dict:
        sid = v.string(body, "sampling_session_id", required=False)
        if sid is not None:
            sampler = self.samplers.get(sid)
            if sampler is None or sampler.owner != caller.owner:
                raise not_found(f"sampling session {sid!r}")
        else:
            sampler = self._make(caller, "adhoc", body.get("model_path"), body.get("base_model"))
        self.svc._may_sample(caller, sampler.base.name)
        base = sampler.base
        prompt = []
        chunks = v.table(body, "prompt").get("chunks", [])
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise HttpError(400, "prompt.chunks must be a list of objects")
        for chunk in chunks:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise HttpError(400, f"prompt chunks of type {chunk.get('type')!r} are not supported (text only)")
            prompt.extend(v.token_ids(chunk.get("tokens", []), "prompt tokens", base.model.config.vocab_size))
        if not prompt:
            raise HttpError(400, "the prompt is empty")
        n = v.integer(body, "num_samples", 1, lo=1, hi=256)
        params = sampling_params(v.table(body, "sampling_params"), len(prompt), base.max_context)
        if n * params["max_tokens"] > self.svc.limits.sample_tokens:
            raise HttpError(400, f"num_samples x max_tokens = {n} x {params['max_tokens']} exceeds this server's "
                                 f"{self.svc.limits.sample_tokens} tokens per sampling request; split the request")
        want_plp = v.boolean(body, "prompt_logprobs", False)
        topk = v.integer(body, "topk_prompt_logprobs", 0, lo=0, hi=base.model.config.vocab_size)
        last_n = v.integer(body, "prompt_logprobs_last_n", None, lo=1, hi=len(prompt) - 1)
        if last_n is not None and not (want_plp or topk):
            raise HttpError(400, "prompt_logprobs_last_n applies to prompt log-probs: set prompt_logprobs")
        # the SDK's SamplingClient(record_stability_info=True) sets it on every request
        record = v.boolean(body, "record_stability_info", False)
        # the sequences are sampled in slices of `sample_chunk`, other owners' jobs running in between
        sizes = [min(self.svc.limits.sample_chunk, n - i) for i in range(0, n, self.svc.limits.sample_chunk)]
        sequences: list = []
        request_id = self.svc.executor.new_request_id()

        def part(k: int, size: int):
            def run():
                seed = params["seed"] + k if params["seed"] is not None else None
                with self.model_for(sampler) as model:
                    sequences.extend(sample_sequences(model, base.tokenizer, prompt, size, {**params, "seed": seed}))
                    if k == len(sizes) - 1:
                        if record:
                            self.record(caller.owner, request_id, sequences)
                        plp, top = (Scorer(model).prompt_logprobs(prompt, topk, last_n) if want_plp or topk
                                    else (None, None))
                        return wire.encode_sample_response(sequences, plp if want_plp else None, top)
            return run

        self.svc.executor.submit_parts(caller.owner, [part(k, size) for k, size in enumerate(sizes)], request_id)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}

    def model_for(self, sampler: Sampler):
        """A model carrying the sampler's weights: its run's own model when that run is live in this
        server, else a host model with the same LoRA layout (made once per layout)."""
        if sampler.tensors is None:
            return nullcontext(sampler.base.model)
        run = self.svc.runs.get(sampler.origin_run)
        if run is None or run.lora["modules"] != sampler.lora["modules"] or run.lora["rank"] != sampler.lora["rank"]:
            key = (sampler.base.name, sampler.lora["rank"], sampler.lora["alpha"], tuple(sampler.lora["modules"]))
            if key not in self.hosts:
                lo = sampler.lora
                self.hosts[key] = Run.create("host", sampler.base, lo["rank"], lo["alpha"], 0, lo["train_attn"],
                                             lo["train_mlp"], lo.get("train_unembed", False))
            run = self.hosts[key]
        return run.swapped_adapter(sampler.tensors)


    def record(self, owner: str, request_id: str, sequences: list) -> None:
        """Keep what was sampled, by the SDK's sequence ids ("{request}:{i}"); the oldest go first."""
        for i, s in enumerate(sequences):
            self.recorded[f"{request_id}:{i}"] = (owner, list(s["tokens"]), list(s["logprobs"]))
        for old in list(self.recorded)[:max(0, len(self.recorded) - RECORDED_SEQUENCES)]:
            del self.recorded[old]

    def recorded_logprobs(self, caller: Caller, i: int, d):
        """stable_reinforce: the sampler's log-probs of datum i's targets, from what this server recorded
        when it sampled them (record_stability_info), located by the datum's provenance spans; NaN on
        prompt runs. The recorded tokens must be the datum's targets there."""
        targets = d.inputs.get("target_tokens")
        n = len(d.tokens)
        if not d.target_spans:
            raise HttpError(400, f"datum {i}: stable_reinforce needs provenance spans on loss_fn_inputs "
                                 "(Datum.with_provenance), naming the sampled sequences its targets reproduce")
        if sum(length for *_, length in d.target_spans) != n:
            raise HttpError(400, f"datum {i}: its provenance spans cover {sum(s[3] for s in d.target_spans)} "
                                 f"positions, the datum has {n}")
        q, pos = np.full(n, np.nan, dtype=np.float32), 0
        for kind, sequence_id, offset, length in d.target_spans:
            if kind == "sampled" and length:
                rec = self.recorded.get(sequence_id)
                if rec is None or rec[0] != caller.owner:
                    raise not_found(f"datum {i}: recorded sequence {sequence_id!r} (sample it with "
                                    "record_stability_info; records are kept per session)")
                tokens, lps = rec[1][offset:offset + length], rec[2][offset:offset + length]
                if len(tokens) != length or targets is None or list(targets[pos:pos + length]) != tokens:
                    raise HttpError(400, f"datum {i}: positions {pos}..{pos + length - 1} are not the tokens "
                                         f"sequence {sequence_id} sampled at {offset}..{offset + length - 1}")
                q[pos:pos + length] = lps
            pos += length
        return q


def sampling_params(p: dict, prompt_len: int, max_context: int) -> dict:
    """Tinker's SamplingParams, checked: max_tokens >= 1 (default: up to 256 within the context),
    temperature >= 0 (0: greedy), top_p in (0, 1], top_k (-1 or 0: off), seed, stop (None: EOS;
    [] nothing; token ids; strings)."""
    w = "sampling_params."
    max_tokens = v.integer(p, "max_tokens", None, lo=1, where=w)
    if max_tokens is None:
        max_tokens = max(1, min(256, max_context - prompt_len))
    if prompt_len + max_tokens > max_context:
        raise HttpError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                             f"of {max_context}")
    stop = p.get("stop")
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and (
            all(isinstance(x, str) for x in stop) or all(isinstance(x, int) and not isinstance(x, bool) for x in stop)))):
        raise HttpError(400, f"{w}stop must be a string, a list of strings or a list of token ids, got {stop!r:.80}")
    return {"max_tokens": max_tokens, "temperature": v.number(p, "temperature", 1.0, lo=0.0, hi=100.0, where=w),
            "top_p": v.number(p, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True, where=w),
            "top_k": v.integer(p, "top_k", -1, lo=-1, where=w), "seed": v.integer(p, "seed", None, where=w),
            "stop": stop}
