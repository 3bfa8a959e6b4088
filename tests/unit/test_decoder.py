"""The fast decode engine (rl/decoder.py) against transformers' own forward.

The reference is independent of both decoders' caches: a plain teacher-forced forward of each
completion's whole prefix (prompt + tokens so far), one row at a time, with the LoRA adapter applied
by PEFT. Covered: left padding, a group sharing its prompt's prefill, rows leaving the batch, LoRA on
every projection (and the adapter disabled), biases (qwen2), an untied head, bf16 weights that still
carry a small adapter update, and the prepared copies being reused until a weight changes.
"""
from __future__ import annotations

import pytest
import torch

from retrograd.models.lora import attach_lora
from retrograd.rl.decoder import HFDecoder, LlamaDecoder
from retrograd.rl.sampler import decoder_for

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
GROUP = 2
PREFIX = [40, 41, 42, 43, 44, 45]  # a common start (system prompt) run once for all prompts


def _model(kind: str, tie: bool = True):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie)
    cfg = {"llama": lambda: LlamaConfig(**common),
           "qwen2": lambda: Qwen2Config(**common),  # q/k/v biases
           "mistral": lambda: MistralConfig(sliding_window=None, **common)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # biases that matter
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _with_adapter(model, scale: float = 0.3):
    model, _ = attach_lora(model, 4, 8, ["auto"], 0.0, 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale)
    return model.eval()


def _padded(offset: int = 0):
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    return ids, attention, offset + (attention.cumsum(-1) - 1).clamp(min=0)


def _reference(model, prefixes: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prefixes])


def _run(decoder, model, steps: int = 4, tol: float = 1e-5, prefix: list[int] | None = None):
    """Drive `decoder` through prefill (with every prompt starting with `prefix`, passed apart),
    `steps` steps and a row drop, checking every logit row."""
    prefix = prefix or []
    ids, attention, positions = _padded(len(prefix))
    logits = decoder.prefill(ids, attention, positions, GROUP, steps + 1,
                             prefix=torch.tensor(prefix) if prefix else None)
    rows = [prefix + PROMPTS[i // GROUP] for i in range(len(PROMPTS) * GROUP)]
    worst = 0.0
    for t in range(steps + 1):
        want = _reference(model, rows)
        worst = max(worst, float((logits - want).abs().max()))
        if t == steps:
            break
        tok = torch.tensor([(7 * i + 3 * t) % 290 + 1 for i in range(len(rows))])
        if t == 2:  # rows 1 and 4 finish: they leave the batch
            keep = [i for i in range(len(rows)) if i not in (1, 4)]
            decoder.keep(torch.tensor(keep))
            rows, tok = [rows[i] for i in keep], tok[keep]
        rows = [r + [int(x)] for r, x in zip(rows, tok)]
        logits = decoder.step(tok)
    assert worst < tol, worst
    return worst


@pytest.mark.parametrize("kind,tie", [("llama", True), ("llama", False), ("qwen2", True), ("mistral", False)])
def test_fast_decoder_equals_a_teacher_forced_forward(kind, tie):
    model = _with_adapter(_model(kind, tie))
    _run(LlamaDecoder(model, torch.float32), model)
    _run(HFDecoder(model), model)  # the generic path, same protocol
    _run(LlamaDecoder(model, torch.float32), model, prefix=PREFIX)  # a common prefix prefilled once
    _run(HFDecoder(model), model, prefix=PREFIX)
    with model.disable_adapter():  # the adapter switched off is seen too
        _run(LlamaDecoder(model, torch.float32), model)


def test_bf16_weights_keep_a_small_adapter_update():
    """The adapter runs in float32 beside the bf16 base matmul: an update far below bf16's resolution
    of the weights reaches the projection's output whole, where folding it into bf16 weights (W + BA
    rounded) would lose most of it."""
    model = _with_adapter(_model("llama"), scale=1e-3)
    x = torch.randn(5, 32)
    with_adapter = LlamaDecoder(model, torch.bfloat16).layers[0][1]  # o_proj
    with model.disable_adapter():
        without = LlamaDecoder(model, torch.bfloat16).layers[0][1]
    assert with_adapter.weight is without.weight  # one prepared base copy serves both
    o = model.base_model.model.model.layers[0].self_attn.o_proj
    a, b, scale = o.lora_A["default"].weight, o.lora_B["default"].weight, o.scaling["default"]
    with torch.no_grad():
        want = scale * (x @ a.t()) @ b.t()  # the adapter's contribution in float32
        got = with_adapter(x) - without(x)
        folded = x.bfloat16() @ (o.base_layer.weight + scale * b @ a).bfloat16().t() - x.bfloat16() @ o.base_layer.weight.bfloat16().t()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)
    assert float((folded.float() - want).abs().max()) > 100 * float((got - want).abs().max())
    ids, attention, positions = _padded()  # and the whole bf16 forward stays close to float32
    close = [LlamaDecoder(model, d).prefill(ids, attention, positions, 1, 1) for d in (torch.float32, torch.bfloat16)]
    assert 0 < float((close[0] - close[1]).abs().max()) < 0.05
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_prepared_weights_are_reused_until_a_weight_changes():
    model = _model("llama")  # full fine-tune: no adapter
    first = LlamaDecoder(model, torch.bfloat16)
    again = LlamaDecoder(model, torch.bfloat16)
    assert again.layers[0][0].weight is first.layers[0][0].weight  # nothing changed: the same copy
    with torch.no_grad():  # an optimizer step: in place
        model.model.layers[0].self_attn.q_proj.weight.add_(0.5)
    changed = LlamaDecoder(model, torch.bfloat16)
    assert changed.layers[0][0].weight is not first.layers[0][0].weight
    assert changed.layers[1][0].weight is first.layers[1][0].weight  # untouched layers keep theirs
    _run(LlamaDecoder(model, torch.float32), model)  # and the logits follow the new weight


def test_other_models_take_the_generic_path():
    from transformers import AutoModelForCausalLM, GPT2Config
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    fast, context = decoder_for(model.eval())
    assert fast is None
    with context as generic:
        assert isinstance(generic, HFDecoder)
        _run(generic, model)
    fast, _ = decoder_for(_model("llama").eval())
    assert isinstance(fast, LlamaDecoder)


def test_sample_defaults_to_the_models_own_precision():
    from retrograd.rl.sampler import sample
    model = _model("llama").to(torch.bfloat16).eval()
    kw = dict(eos_ids=set(), pad_id=0, temperature=1.0)

    def run(**extra):
        return sample(model, PROMPTS, 2, 4, generator=torch.Generator().manual_seed(0), **kw, **extra).behaviour_logprobs
    assert run() == run(dtype=torch.bfloat16) != run(dtype=torch.float32)
