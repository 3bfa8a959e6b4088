"""`retrograd eval` and `retrograd chat`: the base model and the trained one, side by side.

The measuring lives in train/evaluate.py (beside the loops it mirrors); here the results are
printed, and the chat's terminal loop runs.
"""
from __future__ import annotations

import json
import sys
from contextlib import nullcontext

import torch

from retrograd.errors import ConfigError


def run_eval(cfg, adapter=None, checkpoint=None, data=None, as_json=False) -> int:
    from retrograd.train.evaluate import evaluate_trained
    out = evaluate_trained(cfg, adapter, checkpoint, data)
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    sides = [s for s in ("base", "trained") if any(f"{s}/{k}" in out for k in ("loss", "accuracy", "mean_reward",
                                                                              "teacher_kl"))]
    if cfg.run.algorithm == "preference":
        print(f"{out['pairs']} pairs of {out['data']}")
        print(f"{'':10s}{'accuracy':>10s}{'chosen logp/tok':>17s}{'rejected logp/tok':>19s}")
        for side in sides:
            print(f"{side:10s}{out[side + '/accuracy']:10.3f}{out[side + '/chosen_logps_per_token']:17.4f}"
                  f"{out[side + '/rejected_logps_per_token']:19.4f}")
        if out["trained_from"]:
            print(f"trained = {out['trained_from']}; {cfg.preference.loss} loss against the base "
                  f"{out['trained/preference_loss']:.4f}, reward accuracy {out['trained/reward_accuracy']:.3f}, "
                  f"margin {out['trained/margin']:.4f}")
        return 0
    if cfg.run.algorithm == "distill":
        what = (f"greedy completions of {out['prompts']} prompts" if "prompts" in out else f"{out['rows']} rows")
        print(f"{what} of {out['data']}, against the teacher {cfg.distill.teacher_path}")
        print(f"{'':10s}{'KL to teacher':>15s}{'top-1 agreement':>17s}")
        for side in sides:
            print(f"{side:10s}{out[side + '/teacher_kl']:15.4f}{out[side + '/top1_agreement']:17.3f}")
    elif cfg.run.algorithm in ("grpo", "ppo"):
        print(f"{out['prompts']} prompts of {out['data']}, greedy completions")
        for side in sides:
            per = {k.split("/", 1)[1]: v for k, v in out.items()
                   if k.startswith(side + "/") and k != f"{side}/mean_reward"}
            print(f"{side:10s} mean reward {out[side + '/mean_reward']:.4f}  "
                  + "  ".join(f"{k} {v:.3f}" for k, v in per.items()))
    else:
        print(f"{out['rows']} rows of {out['data']}")
        print(f"{'':10s}{'loss':>10s}{'perplexity':>12s}")
        for side in sides:
            print(f"{side:10s}{out[side + '/loss']:10.4f}{out[side + '/perplexity']:12.3f}")
    if out["trained_from"]:
        print(f"trained = {out['trained_from']}")
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
    from retrograd.train.evaluate import load_trained
    model, tok, label = load_trained(cfg, adapter, checkpoint, base_only)
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
