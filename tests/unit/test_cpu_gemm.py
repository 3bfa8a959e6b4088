"""float32 products through oneDNN where that is the CPU's faster library (models/cpu_gemm.py): which machines
choose it, the products and gradients against float64 references, the routed nn.Linear forward, and the
LoRA node and fused head under it. The tests force the choice either way, so they run the oneDNN path on
every CPU, not only where the machine picks it."""
import pytest
import torch
import torch.nn.functional as F

import retrograd.models.cpu_gemm as cpu_gemm
from retrograd.models.fused_head import linear_cross_entropy_sum, linear_token_logprobs, logits_into
from retrograd.models.mixed_lora import _MixedLoRALinear

# oneDNN and MKL sum in different orders: float32 products agree to rounding, not bit for bit
REL = 2e-5


@pytest.fixture
def library(monkeypatch):
    """library("onednn" | "mkl"): the choice this test runs under, whatever the machine would pick."""
    def force(name: str):
        monkeypatch.setattr(cpu_gemm, "fp32_gemm_library", lambda: name)
    return force


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = REL) -> float:
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).abs().max() / want.abs().max())
    assert err < rel, f"relative error {err:.2e} >= {rel}"
    return err


def test_the_choice_follows_the_cpu_and_the_override(monkeypatch):
    def choice(vendor: str, flags: set, env: str | None = None) -> str:
        monkeypatch.setattr(cpu_gemm, "_cpu_vendor_and_flags", lambda: (vendor, flags))
        if env is None:
            monkeypatch.delenv(cpu_gemm.ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_gemm.ENV, env)
        monkeypatch.setattr(cpu_gemm, "_LIBRARY", None)  # decided afresh, then put back
        return cpu_gemm.fp32_gemm_library()
    assert choice("AuthenticAMD", {"avx2", "avx512f", "avx512_bf16"}) == "onednn"
    assert choice("AuthenticAMD", {"avx2", "fma"}) == "mkl"  # the AVX2-only EPYC: not measured, torch's default
    assert choice("GenuineIntel", {"avx512f", "amx_bf16"}) == "mkl"
    assert choice("", set()) == "mkl"  # no /proc/cpuinfo
    assert choice("GenuineIntel", {"avx512f"}, env="onednn") == "onednn"
    assert choice("AuthenticAMD", {"avx512f"}, env=" MKL ") == "mkl"
    with pytest.warns(UserWarning, match="RETROGRAD_FP32_GEMM='blas' is neither"):
        assert choice("AuthenticAMD", {"avx512f"}, env="blas") == "onednn"  # the machine's own pick stands


def test_this_torch_build_has_the_onednn_op():
    assert cpu_gemm._onednn_works()


def test_only_large_float32_cpu_products_take_onednn(library):
    library("onednn")
    w = torch.randn(576, 192)
    assert cpu_gemm.uses_onednn(torch.randn(128, 192), w)
    assert cpu_gemm.uses_onednn(torch.randn(2, 64, 192), w)  # rows counted over the leading dimensions
    assert not cpu_gemm.uses_onednn(torch.randn(127, 192), w)
    assert not cpu_gemm.uses_onednn(torch.randn(512, 64), torch.randn(576, 64))  # too narrow a weight
    assert not cpu_gemm.uses_onednn(torch.randn(512, 192, dtype=torch.bfloat16), w.bfloat16())
    library("mkl")
    assert not cpu_gemm.uses_onednn(torch.randn(512, 192), w)


@pytest.mark.parametrize("layout", ["2d", "3d", "strided input", "transposed weight", "bias"])
def test_linear_is_x_times_w_transposed(library, layout):
    library("onednn")
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(256, 320, generator=g), torch.randn(200, 320, generator=g), None
    if layout == "3d":
        x = x.view(2, 128, 320)
    elif layout == "strided input":
        x = torch.randn(320, 256, generator=g).t()
    elif layout == "transposed weight":
        w = torch.randn(320, 200, generator=g).t()
    elif layout == "bias":
        bias = torch.randn(200, generator=g)
    assert cpu_gemm.uses_onednn(x, w)
    got = cpu_gemm.linear(x, w, bias)
    assert got.shape == (*x.shape[:-1], 200) and got.is_contiguous()
    _close(got, F.linear(x.double(), w.double(), None if bias is None else bias.double()))


def test_mm_into_writes_a_view(library):
    library("onednn")
    a, b = torch.randn(150, 256), torch.randn(256, 400)
    out = torch.full((150, 1000), 7.0)
    cpu_gemm.mm_into(a, b, out[:, 300:700])
    _close(out[:, 300:700], a.double() @ b.double())
    assert torch.all(out[:, :300] == 7.0) and torch.all(out[:, 700:] == 7.0)


@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained weight"])
def test_routed_linear_values_and_gradients(library, trained):
    library("onednn")
    torch.manual_seed(1)
    layer = torch.nn.Linear(256, 224).requires_grad_(trained)
    assert cpu_gemm.route_linears(layer) == 1 and cpu_gemm.route_linears(layer) == 0  # once per instance
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, 60, 256, requires_grad=True)
    grad = torch.randn(3, 60, 224)
    out = layer(x)
    out.backward(grad)
    assert calls == [1]  # module hooks still fire around the routed forward
    x64 = x.detach().double().requires_grad_()
    w64 = layer.weight.detach().double().requires_grad_()
    b64 = layer.bias.detach().double().requires_grad_()
    ref = F.linear(x64, w64, b64)
    ref.backward(grad.double())
    _close(out, ref)
    _close(x.grad, x64.grad)
    if trained:
        _close(layer.weight.grad, w64.grad)
        _close(layer.bias.grad, b64.grad)
    else:
        assert layer.weight.grad is None and layer.bias.grad is None


def test_routing_is_off_where_mkl_is_chosen(library):
    library("mkl")
    assert cpu_gemm.route_linears(torch.nn.Linear(256, 256)) == 0


def test_the_two_libraries_give_the_same_routed_layer_up_to_rounding(library):
    torch.manual_seed(2)
    layer = torch.nn.Linear(384, 256).requires_grad_(False)
    library("onednn")
    cpu_gemm.route_linears(layer)
    x = torch.randn(300, 384)
    fast = layer(x)
    library("mkl")
    plain = layer(x)
    _close(fast, plain)


def test_lora_node_under_onednn(library):
    library("onednn")
    torch.manual_seed(3)
    x = torch.randn(2, 100, 256, requires_grad=True)
    weight, bias = torch.randn(320, 256) * 0.05, torch.randn(320) * 0.1
    a = (torch.randn(8, 256) * 0.1).requires_grad_()
    b = (torch.randn(320, 8) * 0.1).requires_grad_()
    grad = torch.randn(2, 100, 320)
    out = _MixedLoRALinear.apply(x, None, weight, bias, a, b, 2.0)
    out.backward(grad)
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, a, b))
    ref = F.linear(x64, weight.double(), bias.double()) + 2.0 * (x64 @ a64.t()) @ b64.t()
    ref.backward(grad.double())
    _close(out, ref)
    for got, want in ((x.grad, x64.grad), (a.grad, a64.grad), (b.grad, b64.grad)):
        _close(got, want)


def test_fused_head_under_onednn(library):
    library("onednn")
    torch.manual_seed(4)
    vocab, hidden, rows = 3000, 256, 300
    weight = torch.randn(vocab, hidden) * 0.05
    h = torch.randn(rows, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (rows,))
    out = torch.empty(rows, vocab)
    _close(logits_into(h.detach(), weight, out), h.detach().double() @ weight.double().t())
    loss = linear_cross_entropy_sum(h, weight, y, chunk_size=160)
    loss.backward()
    h64 = h.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ weight.double().t(), y, reduction="sum")
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5 * float(ref.detach())
    _close(h.grad, h64.grad)
    h.grad = None
    logp = linear_token_logprobs(h, weight, y, chunk_size=160)
    g = torch.randn(rows)
    logp.backward(g)
    h64.grad = None
    ref_logp = torch.log_softmax(h64 @ weight.double().t(), -1).gather(1, y[:, None])[:, 0]
    ref_logp.backward(g.double())
    _close(logp, ref_logp)
    _close(h.grad, h64.grad)


def _lora_then_routed_linear(seed: int):
    """A LoRA node (base 256 -> 320) feeding a routed frozen nn.Linear (320 -> 224): every product large
    enough for oneDNN. -> (the block as a function of (x, lora_a, lora_b), its inputs)."""
    torch.manual_seed(seed)
    weight = torch.randn(320, 256) * 0.05
    layer = torch.nn.Linear(320, 224).requires_grad_(False)
    cpu_gemm.route_linears(layer)

    def block(x, a, b):
        return layer(_MixedLoRALinear.apply(x, None, weight, None, a, b, 2.0)).square().sum()
    inputs = (torch.randn(2, 100, 256), torch.randn(8, 256) * 0.1, torch.randn(320, 8) * 0.1)
    return block, inputs


def _run(block, inputs):
    leaves = [t.clone().requires_grad_() for t in inputs]
    loss = block(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_regions_call_onednn_through_an_opaque_op(library, fresh_dynamo):
    """Under torch.compile ([training] compile) the products go through retrograd::onednn_linear, which the
    compiler keeps as a call (its own lowering of oneDNN's aten op wants a frozen weight): forward x W^T for
    the LoRA base and the routed layer, backward their input gradients g W."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    library("onednn")
    block, inputs = _lora_then_routed_linear(5)
    graphs = []

    def record(gm, _example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm)
    loss, grads = _run(torch.compile(block, backend=aot_autograd(fw_compiler=record, bw_compiler=record)), inputs)
    assert len(graphs) == 2  # one forward, one backward graph: no graph break
    forward, backward = graphs
    assert forward.count("retrograd.onednn_linear.default") == 2
    assert backward.count("retrograd.onednn_linear.default") == 2
    assert "mkldnn._linear_pointwise.default" not in forward + backward
    eager_loss, eager_grads = _run(block, inputs)
    _close(loss, eager_loss)
    for got, want in zip(grads, eager_grads):
        _close(got, want)


def test_inductor_compiles_the_onednn_op_with_the_eager_values(library, fresh_dynamo):
    library("onednn")
    block, inputs = _lora_then_routed_linear(6)
    loss, grads = _run(torch.compile(block), inputs)
    eager_loss, eager_grads = _run(block, inputs)
    _close(loss, eager_loss)
    for got, want in zip(grads, eager_grads):
        _close(got, want)
    library("mkl")  # a machine that keeps MKL compiles plain products (and no oneDNN op)
    torch._dynamo.reset()
    _close(_run(torch.compile(block), inputs)[0], eager_loss)
