"""build_optimizer: AdamW takes its fused kernel for plain CPU parameters, gives the update of the
for-loop AdamW to float32 rounding (written out by hand for one step), and bumps the weights'
version counters as an in-place update would, so version-keyed caches (the RL decoder's packed
weights) see the change. clip_gradients: torch's clip_grad_norm_ bit for bit, without its no-op
multiply when nothing is clipped."""
from types import SimpleNamespace

import pytest
import torch

from retrograd.algorithms.optim import build_optimizer, clip_gradients, fused_adamw_applies
from retrograd.rl import decoder

TR = SimpleNamespace(optimizer="adamw", lr=1e-2, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, weight_decay=0.1)


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def test_fused_adamw_matches_the_for_loop_and_the_formula():
    fused, plain = params(), params()
    opt = build_optimizer(fused, TR)
    assert opt.defaults["fused"] is True and fused_adamw_applies(fused)
    ref = torch.optim.AdamW(plain, lr=TR.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    before = [p.detach().clone() for p in fused]
    opt.step()
    ref.step()
    for a, b, w0, p in zip(fused, plain, before, params()):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-6)
        g = p.grad  # step 1 by hand: m = (1-b1) g, v = (1-b2) g^2, bias-corrected, decoupled decay
        m_hat, v_hat = (0.1 * g) / 0.1, (0.01 * g * g) / 0.01
        want = w0 * (1 - TR.lr * 0.1) - TR.lr * m_hat / (v_hat.sqrt() + 1e-8)
        assert torch.allclose(a.detach(), want, atol=1e-6), (a - want).abs().max()


def test_fused_step_bumps_versions_and_the_decoder_remakes_its_packed_copy():
    ps = params()
    opt = build_optimizer(ps, TR)
    versions = [p._version for p in ps]
    _, packed_before = decoder._prepared([ps[0]], [1.0], None, torch.float32)
    opt.step()
    assert all(p._version > v for p, v in zip(ps, versions))
    kind, packed_after = decoder._prepared([ps[0]], [1.0], None, torch.float32)
    assert packed_after is not packed_before
    if kind == "fused":  # a plain copy can be compared directly; a oneDNN-packed one is opaque
        assert torch.equal(packed_after, ps[0].detach())


def test_fused_is_not_used_for_unsupported_parameters():
    assert not fused_adamw_applies([])
    assert not fused_adamw_applies([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    sgd = build_optimizer(params(), SimpleNamespace(**{**vars(TR), "optimizer": "sgd"}))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["weight_decay"] == 0.1


@pytest.mark.parametrize("max_norm", [1e3, 1.0, 0.5])
def test_clip_gradients_equals_torch_clip_grad_norm_bit_for_bit(max_norm):
    """Unclipped (1e3), clipped (1.0, 0.5: the norm of params() is ~8): the same norm and the same
    gradients as torch.nn.utils.clip_grad_norm_, exactly; clipped gradients have the asked norm."""
    ours, theirs = params(), params()
    norm = clip_gradients(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm == float(want) and 1.0 < norm < 1e3
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    after = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ours])))
    assert after == pytest.approx(min(norm, max_norm), rel=1e-5)


def test_an_unclipped_step_does_not_touch_the_gradients_and_a_nan_norm_still_multiplies():
    ps = params()
    versions = [p.grad._version for p in ps]
    clip_gradients(ps, 1e3)
    assert [p.grad._version for p in ps] == versions  # no pass over the gradients: nothing written
    clip_gradients(ps, 1.0)
    assert all(p.grad._version > v for p, v in zip(ps, versions))
    bad, ref = params(), params()
    bad[1].grad[0] = ref[1].grad[0] = float("nan")
    assert clip_gradients(bad, 1e3) != clip_gradients(bad, 1e3)  # NaN, and as torch does, the NaN spreads
    torch.nn.utils.clip_grad_norm_(ref, 1e3)
    torch.nn.utils.clip_grad_norm_(ref, 1e3)
    assert all(torch.equal(a.grad.isnan(), b.grad.isnan()) for a, b in zip(bad, ref)) and bad[0].grad.isnan().all()
