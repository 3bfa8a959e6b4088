"""`retrograd eval`: the base model and the trained one, side by side, measured the way each training
loop evaluates (SFT: loss and perplexity; preference: accuracy, log-probs and the run's loss against
the base; GRPO and PPO: mean reward of greedy completions, exactly as the run's own evaluation).

The trained side comes from `--adapter PATH` (PEFT folder or .gguf adapter), `--checkpoint DIR`
(a .state), or by default the run's `[output].path` when it exists; the base is the same weights
with the adapter disabled. Functions return dicts; the CLI formats them.
"""
from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from pathlib import Path

from retrograd.errors import ConfigError


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def check_flags(adapter: str | None, checkpoint: str | None) -> None:
    """--adapter / --checkpoint must exist: said before anything else is read or loaded."""
    for flag, path in (("--adapter", adapter), ("--checkpoint", checkpoint)):
        if path and not Path(path).exists():
            raise ConfigError(f"{flag} {path}: no such file or folder")


def load_trained(cfg, adapter: str | None, checkpoint: str | None, base_only: bool = False, log=_log):
    """(model, tokenizer, label of the trained side or None). The trained side is a PEFT model whose
    adapter can be disabled for the base."""
    from retrograd.config.load import output_kind
    from retrograd.models.load import load_model
    if adapter and checkpoint:
        raise ConfigError("give --adapter or --checkpoint, not both")
    check_flags(adapter, checkpoint)
    if checkpoint and not base_only:
        from retrograd.export.from_checkpoint import load_checkpoint_model
        model, tok, lora, _ = load_checkpoint_model(checkpoint, log)
        if lora is None:
            raise ConfigError(f"{checkpoint} is a full fine-tune; compare it with `retrograd eval` on its exported "
                              "HF folder as [model].path instead")
        return model.eval(), tok, checkpoint
    loaded = load_model(cfg.model.path, cfg.model.dtype, log=log)
    if base_only:
        return loaded.model.eval(), loaded.tokenizer, None
    adapter_flag = adapter is not None
    if adapter is None and cfg.training.trainable == "lora" and output_kind(cfg) in ("peft", "adapter") \
            and Path(cfg.output.path).exists():
        adapter = cfg.output.path
    if adapter is None:
        return loaded.model.eval(), loaded.tokenizer, None
    from retrograd.models.adapter_io import adapter_layout, apply_adapter
    from retrograd.models.lora import attach_lora
    source = "--adapter" if adapter_flag else "output.path"
    spec = adapter_layout(adapter, loaded.model, source)
    model, _ = attach_lora(loaded.model, spec.rank, spec.alpha, spec.modules, 0.0, 0)
    apply_adapter(adapter, model, source)
    return model.eval(), loaded.tokenizer, str(adapter)


def _sides(model, label):
    """("base", context) and, with a trained adapter, ("trained", context)."""
    yield "base", (model.disable_adapter() if label else nullcontext())
    if label:
        yield "trained", nullcontext()


def eval_sft(cfg, model, tok, label, data) -> dict:
    from retrograd.data.sft import Renderer, load_examples
    from retrograd.models.logprobs import Scorer
    from retrograd.train.sft import evaluate
    rows = load_examples(data, cfg.sft.data_format, Renderer(tok, cfg.training.ctx, cfg.sft.assistant_only_loss,
                                                             cfg.sft.template_variables))
    scorer, device = Scorer(model), next(model.parameters()).device
    batch = (cfg.evaluation.batch_size if cfg.evaluation else None) or cfg.training.batch_size
    out = {"data": str(data), "rows": len(rows), "trained_from": label}
    for side, context in _sides(model, label):
        with context:
            loss = evaluate(scorer, model, rows, batch, tok.pad_token_id, device)
        out.update({f"{side}/loss": loss, f"{side}/perplexity": math.exp(min(loss, 50))})
    return out


def eval_preference(cfg, model, tok, label, data) -> dict:
    """Per side: how often the chosen response is the more likely one (per-token mean log-prob, so
    length does not decide), and the mean per-token log-probs; for the trained side also the run's
    loss and reward accuracy with the base model as the reference."""
    from retrograd.algorithms.preference import PreferenceParams, preference_loss
    from retrograd.data.preference import load_pairs, response_lengths
    from retrograd.data.sft import Renderer
    from retrograd.models.logprobs import Scorer
    from retrograd.train.preference import SCORING_PASS_FACTOR, score_pairs
    pc = cfg.preference
    pairs = load_pairs(data, Renderer(tok, cfg.training.ctx, True, pc.template_variables))
    scorer, device = Scorer(model), next(model.parameters()).device
    budget = (cfg.training.micro_batch or 512) * SCORING_PASS_FACTOR  # the passes training evaluates in
    scores = {}
    for side, context in _sides(model, label):
        with context:
            scores[side] = score_pairs(scorer, model, pairs, budget, tok.pad_token_id, device)
    n_c, n_r = response_lengths(pairs)
    out = {"data": str(data), "pairs": len(pairs), "trained_from": label}
    for side, s in scores.items():
        lc, lr = s[:, 0] / n_c, s[:, 1] / n_r
        out.update({f"{side}/accuracy": float((lc > lr).double().mean()), f"{side}/chosen_logps_per_token": float(lc.mean()),
                    f"{side}/rejected_logps_per_token": float(lr.mean())})
    if label:
        b, t = scores["base"], scores["trained"]
        params = PreferenceParams(pc.loss, pc.beta, pc.label_smoothing or 0.0, pc.gamma_beta_ratio or 0.5)
        loss, st = preference_loss(params, t[:, 0], t[:, 1], n_c, n_r, b[:, 0], b[:, 1])
        out.update({"trained/preference_loss": float(loss.mean()), "trained/reward_accuracy": float(st["accuracy"].mean()),
                    "trained/margin": float(st["margin"].mean())})
    return out


def eval_rl(cfg, model, tok, label, data) -> dict:
    """Mean reward of greedy completions of the evaluation prompts, base and trained (the rewards,
    stop strings and overlong penalty of the GRPO / PPO run: the same numbers as its eval/mean_reward)."""
    from retrograd.data.prompts import load_prompts
    from retrograd.rl.rewards import rewards_from_config
    from retrograd.rl.sampler import eos_ids
    from retrograd.train.rollouts import greedy_rewards
    g = cfg.grpo or cfg.ppo
    prompts = load_prompts(data, tok, cfg.training.ctx, g.sampling.max_new_tokens, g.template_variables)
    rewards = rewards_from_config(g, Path(cfg.source).parent)
    eos = eos_ids(tok, model)
    out = {"data": str(data), "prompts": len(prompts), "trained_from": label}
    try:
        for side, context in _sides(model, label):
            with context:
                r = greedy_rewards(model, tok, prompts, rewards, g.sampling, eos, g.overlong_penalty)
            out[f"{side}/mean_reward"] = r.pop("mean_reward")
            out.update({f"{side}/{k}/mean": v for k, v in r.items()})
    finally:
        for r in rewards:
            if hasattr(r.fn, "close"):
                r.fn.close()
    return out


def eval_distill(cfg, model, tok, label, data) -> dict:
    """Per side, the exact KL(student || teacher) per position over the whole vocabulary and the top-1
    agreement: on the student's greedy completions of `data`'s prompts (on_policy, as the run's own
    evaluation), or on the rows of `data` as written (topk_offline)."""
    from retrograd.data.sampler import evenly_spaced
    from retrograd.models.logprobs import Scorer, to_device
    from retrograd.rl.sampler import eos_ids
    from retrograd.train.distill import evaluate_against_teacher, load_teacher
    from retrograd.train.distill_offline import render
    import torch

    from retrograd.data.sft import collate as collate_rows
    d, device = cfg.distill, next(model.parameters()).device
    teacher = load_teacher(cfg, tok, device, _log)
    out = {"data": str(data), "trained_from": label}
    limit = cfg.evaluation.max_examples if cfg.evaluation else None
    if d.mode == "on_policy":
        from retrograd.data.prompts import load_prompts
        prompts = load_prompts(data, tok, cfg.training.ctx, d.sampling.max_new_tokens, d.template_variables,
                               cut_answers=True)
        prompts = [prompts[i] for i in evenly_spaced(len(prompts), limit)]
        out["prompts"] = len(prompts)
        for side, context in _sides(model, label):
            with context:
                r = evaluate_against_teacher(model, tok, teacher, prompts, d.sampling, eos_ids(tok, model))
            out.update({f"{side}/teacher_kl": r["eval/teacher_kl"], f"{side}/top1_agreement": r["eval/top1_agreement"]})
        return out
    rows = render(tok, data, cfg.training.ctx, d.template_variables)
    rows = [rows[i] for i in evenly_spaced(len(rows), limit)]
    out["rows"] = len(rows)
    student = Scorer(model)
    for side, context in _sides(model, label):
        kls, same = [], []
        with context:
            for i in range(0, len(rows), 8):
                kl, agree = student.compare(teacher, to_device(collate_rows(rows[i:i + 8], tok.pad_token_id), device))
                kls.append(kl)
                same.append(agree)
        out.update({f"{side}/teacher_kl": float(torch.cat(kls).mean()),
                    f"{side}/top1_agreement": float(torch.cat(same).double().mean())})
    return out


def evaluate_trained(cfg, adapter=None, checkpoint=None, data=None) -> dict:
    """The base and the trained model on `data` (default [evaluation].data), by the run's algorithm."""
    check_flags(adapter, checkpoint)
    data = data or (cfg.evaluation.data if cfg.evaluation else None)
    if data is None:
        raise ConfigError("retrograd eval needs evaluation data: an [evaluation] table with data, or --data PATH")
    model, tok, label = load_trained(cfg, adapter, checkpoint)
    by_algorithm = {"preference": eval_preference, "grpo": eval_rl, "ppo": eval_rl, "distill": eval_distill}
    return by_algorithm.get(cfg.run.algorithm, eval_sft)(cfg, model, tok, label, data)
