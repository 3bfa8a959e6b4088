"""LoRA on bf16 or float32 weights as one node in that dtype (models/mixed_lora.py): the same function as
PEFT's layer, its gradients by finite differences, taken only for plain LoRA on bf16 / float32 weights,
and fp16 models untouched."""
import pytest
import torch
import torch.nn.functional as F

from retrograd.models import mixed_lora
from retrograd.models.lora import attach_lora
from retrograd.models.mixed_lora import _MixedLoRALinear


class Projections(torch.nn.Module):
    """q/k/v-like layers reading one input, as in an attention block."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.q_proj = torch.nn.Linear(24, 24, bias=bias)
        self.k_proj = torch.nn.Linear(24, 8, bias=bias)
        self.v_proj = torch.nn.Linear(24, 8, bias=bias)

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)


def _adapted(dtype: torch.dtype, bias: bool = False, dropout: float = 0.0, seed: int = 0):
    """PEFT's LoRA on Projections, as attach_lora sets it up (attach_lora itself wants a causal LM)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(Projections(bias).to(dtype), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                   target_modules=["q_proj", "k_proj", "v_proj"]))
    assert mixed_lora.mixed_lora(model) == 3
    with torch.no_grad():  # B random (PEFT starts it at zero), so that every gradient is non-zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    return model


def _lora_layers(model):
    return [m for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj")) and hasattr(m, "lora_A")]


def _reference64(layer, x):
    """y = x W^T + b + s (x A^T) B^T in float64, straight from the layer's tensors."""
    w, a = layer.base_layer.weight.double(), layer.lora_A["default"].weight.detach().double()
    b = layer.lora_B["default"].weight.detach().double()
    bias = None if layer.base_layer.bias is None else layer.base_layer.bias.double()
    return F.linear(x, w, bias) + layer.scaling["default"] * (x @ a.t()) @ b.t()


def _run(model, x, grad):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out, x.grad, grads


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_the_node_has_the_gradients_of_finite_differences():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w, bias = torch.randn(5, 6, dtype=torch.float64, generator=g), torch.randn(5, dtype=torch.float64, generator=g)
    a = torch.randn(2, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, generator=g, requires_grad=True)
    dropped = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)  # LoRA dropout's input
    assert torch.autograd.gradcheck(lambda x, a, b: _MixedLoRALinear.apply(x, None, w, bias, a, b, 1.5), (x, a, b))
    assert torch.autograd.gradcheck(lambda x, d, a, b: _MixedLoRALinear.apply(x, d, w, bias, a, b, 1.5),
                                    (x, dropped, a, b))
    want = F.linear(x, w, bias) + 1.5 * (x @ a.t()) @ b.t()
    assert torch.allclose(_MixedLoRALinear.apply(x, None, w, bias, a, b, 1.5), want, atol=1e-12)
    want = F.linear(x, w, bias) + 1.5 * (dropped @ a.t()) @ b.t()
    assert torch.allclose(_MixedLoRALinear.apply(x, dropped, w, bias, a, b, 1.5), want, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_layers_take_the_node_and_match_float64(bias):
    model = _adapted(torch.bfloat16, bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 24, generator=g).to(torch.bfloat16)
    grad = torch.randn(3, 7, 40, generator=g).to(torch.bfloat16)
    out, gx, grads = _run(model, x, grad)
    assert out.dtype == torch.bfloat16
    assert "MixedLoRALinear" in type(model.base_model.model.q_proj(x).grad_fn).__name__
    # float64 reference of the same function, values and gradients
    x64 = x.double().requires_grad_()
    layers = _lora_layers(model)
    params = [(layer.lora_A["default"].weight.detach().double().requires_grad_(),
               layer.lora_B["default"].weight.detach().double().requires_grad_()) for layer in layers]
    outs = []
    for layer, (a, b) in zip(layers, params):
        bias64 = None if layer.base_layer.bias is None else layer.base_layer.bias.double()
        lora = layer.scaling["default"] * (x64 @ a.t()) @ b.t()
        outs.append(F.linear(x64, layer.base_layer.weight.double(), bias64) + lora)
    want = torch.cat(outs, -1)
    want.backward(grad.double())
    assert _rel(out, want) < 1e-2
    assert _rel(gx, x64.grad) < 1e-2
    for layer, (a, b) in zip(layers, params):
        name = [n for n, m in model.named_modules() if m is layer][0]
        assert grads[f"{name}.lora_A.default.weight"].dtype == torch.float64  # from the float32 .grad
        assert _rel(grads[f"{name}.lora_A.default.weight"], a.grad) < 1e-2
        assert _rel(grads[f"{name}.lora_B.default.weight"], b.grad) < 1e-2
    for name, p in model.named_parameters():  # the optimizer's tensors stay float32
        if "lora_" in name:
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


def test_as_close_to_float64_as_peft_and_keeps_less_for_backward(monkeypatch):
    model = _adapted(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, 24, generator=g).to(torch.bfloat16)
    grad = torch.randn(4, 16, 40, generator=g).to(torch.bfloat16)

    def saved_bytes():
        seen = {}

        def pack(t):
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = _run(model, x, grad)
        return result, sum(seen.values())

    (fast_out, fast_gx, fast_grads), fast_bytes = saved_bytes()
    monkeypatch.setattr(mixed_lora, "_fast_path_args", lambda *a: None)
    (peft_out, peft_gx, peft_grads), peft_bytes = saved_bytes()
    assert "MixedLoRALinear" not in type(model.base_model.model.q_proj(x).grad_fn).__name__
    ref = torch.cat([_reference64(layer, x.double()) for layer in _lora_layers(model)], -1)
    # PEFT rounds once (its float32 sum to bf16); the node rounds the rank-r product too: allow 2x PEFT's error
    assert _rel(fast_out, ref) <= 2 * _rel(peft_out, ref) + 1e-3
    assert _rel(fast_gx, peft_gx) < 2e-2
    for name, want in peft_grads.items():
        assert _rel(fast_grads[name], want) < 2e-2, name
    # PEFT keeps a float32 copy of the shared input per layer; the node keeps the bf16 input once
    assert fast_bytes < 0.6 * peft_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_attach_lora_gives_a_causal_lm_the_node_in_bf16_and_float32(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model, modules = attach_lora(LlamaForCausalLM(cfg).to(dtype), 4, 8, ["q", "v"], 0.0, 0)
    seen = []
    ids = torch.randint(0, 64, (2, 9))
    loss = model(input_ids=ids, labels=ids).loss
    stack, visited = [loss.grad_fn], set()
    while stack:  # every node of the backward graph
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        seen.append(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    nodes = sum("MixedLoRALinear" in name for name in seen)
    assert nodes == (0 if dtype == torch.float16 else 4)  # q and v in 2 layers
    loss.backward()
    lora = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 8 and all(g is not None and g.dtype == torch.float32 for g in lora.values())
    assert all(g.abs().sum() > 0 for n, g in lora.items() if "lora_B" in n)  # lora_A's are 0 while B is 0


def test_float32_layers_take_the_node_match_peft_and_allocate_less(monkeypatch):
    model = _adapted(torch.float32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, 24, generator=g)
    grad = torch.randn(3, 7, 40, generator=g)
    layer = model.base_model.model.q_proj
    assert "MixedLoRALinear" in type(layer(x.clone().requires_grad_()).grad_fn).__name__

    def forward_allocated_bytes() -> int:  # every block one layer's forward allocates, freed or kept
        inputs = x.clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            layer(inputs)
        return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)

    def run_counting_allocations():
        return _run(model, x, grad), forward_allocated_bytes()

    (fast_out, fast_gx, fast_grads), fast_bytes = run_counting_allocations()
    monkeypatch.setattr(mixed_lora, "_fast_path_args", lambda *a: None)
    (peft_out, peft_gx, peft_grads), peft_bytes = run_counting_allocations()
    assert "MixedLoRALinear" not in type(layer(x.clone().requires_grad_()).grad_fn).__name__
    # the same function up to float32 rounding (PEFT rounds the rank-r product, then its scaled copy)
    assert _rel(fast_out, peft_out) < 1e-6 and _rel(fast_gx, peft_gx) < 1e-6
    for name, want in peft_grads.items():
        assert _rel(fast_grads[name], want) < 1e-6, name
    ref = torch.cat([_reference64(layer, x.double()) for layer in _lora_layers(model)], -1)
    assert _rel(fast_out, ref) < 1e-6
    # PEFT allocates the base output, the rank-r product, its scaled copy and their sum (and the r-wide
    # product): 4 x 2016 + 336 bytes; the node the output and the r-wide product: 2016 + 336
    assert fast_bytes < 0.3 * peft_bytes, (fast_bytes, peft_bytes)


def test_float16_models_keep_pefts_forward_bit_for_bit():
    model = _adapted(torch.float16)
    x = torch.randn(2, 5, 24).to(torch.float16)
    layer = model.base_model.model.q_proj
    assert "MixedLoRALinear" not in type(layer(x.requires_grad_()).grad_fn).__name__
    assert torch.equal(layer(x), type(layer).forward(layer, x))


def test_lora_dropout_draws_the_same_mask_as_peft(monkeypatch):
    model = _adapted(torch.bfloat16, dropout=0.5)
    model.train()
    layer = model.base_model.model.q_proj
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 9, 24, generator=g).to(torch.bfloat16)
    grad = torch.randn(3, 9, 40, generator=g).to(torch.bfloat16)
    torch.manual_seed(7)
    fast = _run(model, x, grad)
    assert "MixedLoRALinear" in type(layer(x.clone().requires_grad_()).grad_fn).__name__
    monkeypatch.setattr(mixed_lora, "_fast_path_args", lambda *a: None)
    torch.manual_seed(7)
    peft = _run(model, x, grad)
    torch.manual_seed(8)  # another mask: far apart, so the agreement above is the same mask
    other = _run(model, x, grad)
    name = "base_model.model.q_proj.lora_A.default.weight"
    assert _rel(fast[0], peft[0]) < 1e-2 and _rel(fast[1], peft[1]) < 2e-2 and _rel(fast[2][name], peft[2][name]) < 2e-2
    assert _rel(other[2][name], peft[2][name]) > 0.2
    model.eval()  # no dropout: the rank-r branch reads x itself
    x64 = x.double()
    monkeypatch.undo()
    assert _rel(layer(x), _reference64(layer, x64)) < 1e-2


def test_falls_back_where_it_does_not_reproduce_peft():
    x = torch.randn(2, 5, 24).to(torch.bfloat16)

    def takes_node(layer, inp=x):
        return "MixedLoRALinear" in type(layer(inp.clone().requires_grad_()).grad_fn).__name__

    model = _adapted(torch.bfloat16)
    layer = model.base_model.model.q_proj
    assert takes_node(layer)
    with model.disable_adapter():  # adapters off: the base layer alone
        assert torch.equal(layer(x), layer.base_layer(x))
    layer.base_layer.weight.requires_grad_(True)  # a trained base weight: PEFT's forward gives its gradient
    assert not takes_node(layer)
    layer.base_layer.weight.requires_grad_(False)
    layer.merge()
    assert not takes_node(layer)  # merged: the base layer holds the adapter
    assert torch.allclose(layer(x).float(), _reference64(_adapted(torch.bfloat16).base_model.model.q_proj,
                                                         x.double()).float(), rtol=0.05, atol=0.05)


def test_hooks_on_the_sublayers_fire_because_pefts_forward_runs():
    """The node never calls base_layer, lora_A or lora_B: with a hook on one of them (a user's activation
    probe) or a global module hook, the call runs PEFT's forward, so the hook sees what it expects."""
    x = torch.randn(2, 5, 24).to(torch.bfloat16)
    model = _adapted(torch.bfloat16)
    layer = model.base_model.model.q_proj

    def node():
        return "MixedLoRALinear" in type(layer(x.clone().requires_grad_()).grad_fn).__name__

    for sublayer in (layer.base_layer, layer.lora_A["default"], layer.lora_B["default"]):
        seen = []
        handle = sublayer.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
        assert not node() and len(seen) == 1
        handle.remove()
        assert node() and len(seen) == 1  # removed: the node again, and the hook no longer runs
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        assert not node() and "Linear" in seen
    finally:
        handle.remove()
    assert node()


def test_the_output_can_be_edited_in_place():
    """Some models edit a projection's output in place (OLMo's clip_qkv clamps q/k/v): the node's output is
    no view, so that works and backward still runs."""
    model = _adapted(torch.bfloat16)
    layer = model.base_model.model.q_proj
    x = torch.randn(2, 5, 24).to(torch.bfloat16).requires_grad_()
    out = layer(x)
    assert "MixedLoRALinear" in type(out.grad_fn).__name__
    out.clamp_(-0.1, 0.1)
    out.sum().backward()
    assert x.grad is not None and layer.lora_B["default"].weight.grad.abs().sum() > 0


def test_fp16_dora_lora_bias_and_two_adapters_keep_pefts_forward():
    from peft import LoraConfig, get_peft_model

    def adapted(dtype=torch.bfloat16, **options):
        torch.manual_seed(0)
        model = get_peft_model(Projections().to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                   **options))
        mixed_lora.mixed_lora(model)
        return model, model.base_model.model.q_proj

    def node(layer, dtype=torch.bfloat16):
        return "MixedLoRALinear" in type(layer(torch.randn(2, 3, 24).to(dtype).requires_grad_()).grad_fn).__name__

    assert node(adapted()[1])  # the plain case, as a control
    assert not node(adapted(torch.float16)[1], torch.float16)  # fp16: g B would underflow in the node
    assert not node(adapted(use_dora=True)[1])
    assert not node(adapted(lora_bias=True)[1])
    model, layer = adapted()
    model.add_adapter("second", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "second"])
    assert not node(layer)


def test_the_training_setup_takes_the_node_for_bf16_weights(tmp_path, monkeypatch):
    """prepare_model (what `retrograd train` runs) gives a bf16 model's LoRA layers the node, dropout on."""
    from tiny import make_model_dir, write_run

    from retrograd.config import load_config
    from retrograd.train.setup import prepare_model
    make_model_dir(tmp_path / "m")
    cfg = load_config(write_run(tmp_path, tmp_path / "m", '[model]\ndtype = "bfloat16"\n[lora]\ndropout = 0.1\n'))
    _, _, model, _ = prepare_model(cfg, lambda *a: None)
    taken, fast_path_args = [], mixed_lora._fast_path_args

    def counting(*a):
        found = fast_path_args(*a)
        taken.append(found is not None)
        return found
    monkeypatch.setattr(mixed_lora, "_fast_path_args", counting)
    model.train()
    ids = torch.randint(0, 50, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    assert taken and all(taken)  # every adapted layer of every block
