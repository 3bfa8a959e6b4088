"""`retrograd eval` and `retrograd chat`: the base model and the trained one, side by side.

Both take the run.toml (for the model, the data format and the output path) and a trained model
from `--adapter PATH` (PEFT folder or .gguf adapter), `--checkpoint DIR` (a .state), or by default
the run's `[output].path` when it exists. The base is the same weights with the adapter disabled.
"""
from __future__ import annotations

import json
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from retrograd.errors import ConfigError


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def load_models(cfg, adapter: str | None, checkpoint: str | None, base_only: bool = False):
    """(model, tokenizer, label of the trained side or None). The trained side is a PEFT model whose
    adapter can be disabled for the base, or a full model (then the base is loaded separately)."""
    from retrograd.config.load import output_kind
    from retrograd.models.load import load_model
    if adapter and checkpoint:
        raise ConfigError("give --adapter or --checkpoint, not both")
    if checkpoint and not base_only:
        from retrograd.export.from_checkpoint import load_checkpoint_model
        model, tok, lora, _ = load_checkpoint_model(checkpoint, _log)
        if lora is None:
            raise ConfigError(f"{checkpoint} is a full fine-tune; compare it with `retrograd eval` on its exported "
                              "HF folder as [model].path instead")
        return model.eval(), tok, checkpoint
    loaded = load_model(cfg.model.path, cfg.model.dtype, log=_log)
    if base_only:
        return loaded.model.eval(), loaded.tokenizer, None
    if adapter is None and cfg.training.trainable == "lora" and output_kind(cfg) in ("peft", "adapter") \
            and Path(cfg.output.path).exists():
        adapter = cfg.output.path
    if adapter is None:
        return loaded.model.eval(), loaded.tokenizer, None
    from retrograd.models.adapter_io import adapter_layout, apply_adapter
    from retrograd.models.lora import attach_lora
    spec = adapter_layout(adapter, loaded.model)
    model, _ = attach_lora(loaded.model, spec.rank, spec.alpha, spec.modules, 0.0, 0)
    apply_adapter(adapter, model)
    return model.eval(), loaded.tokenizer, str(adapter)


def _eval_preference(cfg, model, tok, label, data, as_json) -> int:
    """Per side: how often the chosen response is the more likely one (per-token mean log-prob, so
    length does not decide), and the mean per-token log-probs; for the trained side also the run's
    loss and reward accuracy with the base model as the reference."""
    from retrograd.algorithms.preference import PreferenceParams, preference_loss
    from retrograd.data.preference import load_pairs, response_lengths
    from retrograd.data.sft import Renderer
    from retrograd.train.preference import SequenceLogprobs, score_pairs
    pc = cfg.preference
    pairs = load_pairs(data, Renderer(tok, cfg.training.ctx, True, pc.template_variables))
    scorer, device = SequenceLogprobs(model), next(model.parameters()).device
    budget = cfg.training.micro_batch or 512
    with (model.disable_adapter() if label else nullcontext()):
        scores = {"base": score_pairs(scorer, model, pairs, budget, tok.pad_token_id, device)}
    if label:
        scores["trained"] = score_pairs(scorer, model, pairs, budget, tok.pad_token_id, device)
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
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(pairs)} pairs of {data}")
    print(f"{'':10s}{'accuracy':>10s}{'chosen logp/tok':>17s}{'rejected logp/tok':>19s}")
    for side in scores:
        print(f"{side:10s}{out[side + '/accuracy']:10.3f}{out[side + '/chosen_logps_per_token']:17.4f}"
              f"{out[side + '/rejected_logps_per_token']:19.4f}")
    if label:
        print(f"trained = {label}; {pc.loss} loss against the base {out['trained/preference_loss']:.4f}, "
              f"reward accuracy {out['trained/reward_accuracy']:.3f}, margin {out['trained/margin']:.4f}")
    return 0


def _eval_grpo(cfg, model, tok, label, data, as_json) -> int:
    """Mean reward of greedy completions of the evaluation prompts, base and trained."""
    from retrograd.data.prompts import load_prompts
    from retrograd.rl.rewards import rewards_from_config
    from retrograd.rl.sampler import eos_ids, sample
    g = cfg.grpo
    prompts = load_prompts(data, tok, cfg.training.ctx, g.sampling.max_new_tokens, g.template_variables)
    rewards = rewards_from_config(g, Path(cfg.source).parent)
    eos = eos_ids(tok, model)

    def mean_reward() -> dict:
        total, per = 0.0, {r.name: 0.0 for r in rewards}
        for i in range(0, len(prompts), 16):
            chunk = prompts[i:i + 16]
            s = sample(model, [p.ids for p in chunk], 1, g.sampling.max_new_tokens, eos_ids=eos,
                       pad_id=tok.pad_token_id, generator=None, temperature=0.0)
            texts = [tok.decode(c, skip_special_tokens=True) for c in s.completion_ids]
            columns = {k: [p.columns[k] for p in chunk] for k in chunk[0].columns}
            for r in rewards:
                values = r([p.text for p in chunk], texts, columns)
                per[r.name] += sum(values)
                total += r.weight * sum(values)
        return {"mean_reward": total / len(prompts), **{f"{k}/mean": v / len(prompts) for k, v in per.items()}}

    with (model.disable_adapter() if label else nullcontext()):
        results = {"base": mean_reward()}
    if label:
        results["trained"] = mean_reward()
    for r in rewards:
        if hasattr(r.fn, "close"):
            r.fn.close()
    out = {"data": str(data), "prompts": len(prompts), "trained_from": label,
           **{f"{side}/{k}": v for side, d in results.items() for k, v in d.items()}}
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(prompts)} prompts of {data}, greedy completions")
    for side, d in results.items():
        print(f"{side:10s} mean reward {d['mean_reward']:.4f}  "
              + "  ".join(f"{k} {v:.3f}" for k, v in d.items() if k != "mean_reward"))
    if label:
        print(f"trained = {label}")
    return 0


def run_eval(cfg, adapter=None, checkpoint=None, data=None, as_json=False) -> int:
    from retrograd.data.sft import Renderer, load_examples
    from retrograd.train.sft import TokenLoss, evaluate
    data = data or (cfg.evaluation.data if cfg.evaluation else None)
    if data is None:
        raise ConfigError("retrograd eval needs evaluation data: an [evaluation] table with data, or --data PATH")
    model, tok, label = load_models(cfg, adapter, checkpoint)
    if cfg.run.algorithm == "preference":
        return _eval_preference(cfg, model, tok, label, data, as_json)
    if cfg.run.algorithm == "grpo":
        return _eval_grpo(cfg, model, tok, label, data, as_json)
    rows = load_examples(data, cfg.sft.data_format, Renderer(tok, cfg.training.ctx, cfg.sft.assistant_only_loss,
                                                             cfg.sft.template_variables))
    loss_fn = TokenLoss(model)
    batch = (cfg.evaluation.batch_size if cfg.evaluation else None) or cfg.training.batch_size
    device = next(model.parameters()).device
    results = {}
    with (model.disable_adapter() if label else nullcontext()):
        results["base"] = evaluate(loss_fn, model, rows, batch, tok.pad_token_id, device)
    if label:
        results["trained"] = evaluate(loss_fn, model, rows, batch, tok.pad_token_id, device)
    out = {"data": str(data), "rows": len(rows), "trained_from": label,
           **{f"{k}/loss": v for k, v in results.items()},
           **{f"{k}/perplexity": math.exp(min(v, 50)) for k, v in results.items()}}
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{len(rows)} rows of {data}")
        print(f"{'':10s}{'loss':>10s}{'perplexity':>12s}")
        for k, v in results.items():
            print(f"{k:10s}{v:10.4f}{math.exp(min(v, 50)):12.3f}")
        if label:
            print(f"trained = {label}")
    return 0


def _generate(model, tok, messages, max_new_tokens: int, temperature: float, top_p: float) -> str:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(next(model.parameters()).device) for k, v in ids.items()}
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **sampling)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run_chat(cfg, adapter=None, checkpoint=None, base_only=False, compare=False, system=None,
             max_new_tokens=256, temperature=0.7, top_p=0.95, seed=0, stdin=None, stdout=None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    model, tok, label = load_models(cfg, adapter, checkpoint, base_only)
    if compare and not label:
        raise ConfigError("--compare needs a trained adapter (--adapter, --checkpoint, or an existing [output].path)")
    sides = [("base", True), (label, False)] if compare else [("base" if not label else label, False)]
    interactive = stdin.isatty()
    history = [{"role": "system", "content": system}] if system else []
    print(f"chatting with {', '.join(name for name, _ in sides)}; /reset clears the conversation, /exit quits",
          file=stdout)
    torch.manual_seed(seed)
    while True:
        if interactive:
            stdout.write("you> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = history[:1] if system else []
            print("(conversation cleared)", file=stdout)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        reply = ""
        for name, disable in sides:
            with (model.disable_adapter() if disable else nullcontext()):
                reply = _generate(model, tok, history, max_new_tokens, temperature, top_p)
            print(f"[{name}] {reply}" if compare else reply, file=stdout, flush=True)
        history.append({"role": "assistant", "content": reply})  # the trained side's answer continues
    return 0
