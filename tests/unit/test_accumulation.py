"""Gradient accumulation and pass splitting give the gradient of the big batch: SFT with batch_size x
gradient_accumulation = 4 in any split, or one micro-batch cut into passes by the token budget; a
preference step cut into passes. Float64, so "equal" means the same maths, not float32 luck."""
from types import SimpleNamespace

import pytest
import torch

from retrograd.config import load_config
from retrograd.models.load import load_model
from retrograd.models.lora import attach_lora
from retrograd.train.preference import PreferenceTask
from retrograd.train.sft import SftTask
from tiny import write_pref_run, write_run


def _run(cfg, tiny_model, pass_tokens):
    loaded = load_model(str(tiny_model), log=lambda *_: None)
    model, _ = attach_lora(loaded.model.double(), 4, 8, ["auto"], 0.0, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return SimpleNamespace(cfg=cfg, model=model, tokenizer=loaded.tokenizer, device=torch.device("cpu"),
                           loaded=loaded, pass_tokens=pass_tokens, log=lambda *_: None)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("batch_size,accumulation,pass_tokens", [(2, 2, None), (1, 4, None), (4, 1, 24)])
def test_sft_accumulation_equals_the_big_batch(tmp_path, tiny_model, batch_size, accumulation, pass_tokens):
    def grads(bs, acc, budget):
        cfg = load_config(write_run(tmp_path, tiny_model, f"[training]\nbatch_size = {bs}\n"
                                                          f"gradient_accumulation = {acc}\n[lora]\ndropout = 0.0"))
        run = _run(cfg, tiny_model, budget)
        task = SftTask(run)
        out = task.step(task.rows[:4])
        return out, _grads(run.model)

    big_metrics, big = grads(4, 1, None)
    metrics, small = grads(batch_size, accumulation, pass_tokens)
    assert metrics["train/loss"] == pytest.approx(big_metrics["train/loss"], rel=1e-12)
    assert metrics["train/target_tokens"] == big_metrics["train/target_tokens"]
    assert big.keys() == small.keys() and big
    for n in big:
        assert (small[n] - big[n]).norm() <= 1e-10 * big[n].norm(), n


def test_preference_passes_equal_one_pass(tmp_path, tiny_model):
    def grads(budget):
        cfg = load_config(write_pref_run(tmp_path, tiny_model, '[preference]\nloss = "simpo"\npairs_per_step = 4'))
        run = _run(cfg, tiny_model, budget)
        task = PreferenceTask(run)
        # one row per side in both: with prompts shared, one pass of 4 pairs would also share their
        # common prefix and split passes would not, a different layout whose attention softmax
        # transformers computes in float32 even for a float64 model (~1e-7 apart, which
        # test_preference_logprobs.py bounds); this test is about the accumulation arithmetic
        task.scorer.shares_prompts = False
        out = task.step(task.rows[:4])
        return out, _grads(run.model)

    one_metrics, one = grads(None)
    split_metrics, split = grads(40)  # a pass holds one pair (both sides) at most
    assert split_metrics["preference/loss"] == pytest.approx(one_metrics["preference/loss"], rel=1e-12)
    for n in one:
        assert (split[n] - one[n]).norm() <= 1e-10 * one[n].norm(), n


@pytest.mark.parametrize("trainable,extra,cpu_default,expected", [
    ("lora", "", 512, 512),  # SFT's and DPO's CPU default
    ("full", "", 512, 1024),  # a full fine-tune's passes are 1024 tokens at least
    ("full", "", 1024, 1024),  # GRPO's default already is
    ("full", "micro_batch = 256\n", 512, 256),  # the user's budget wins
])
def test_a_full_fine_tune_defaults_to_1024_token_passes_on_cpu(tmp_path, tiny_model, trainable, extra, cpu_default,
                                                              expected):
    from retrograd.train.setup import start_run
    cfg = write_run(tmp_path, tiny_model, f'[training]\ntrainable = "{trainable}"\n{extra}')
    if trainable == "full":
        text = cfg.read_text()
        cfg.write_text(text[:text.index("[lora]")] + text[text.index("[training]"):])
    assert start_run(load_config(cfg), lambda *_: None, cpu_default).pass_tokens == expected
