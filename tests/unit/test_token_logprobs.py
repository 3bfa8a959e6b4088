"""linear_token_logprobs (per-row target log-probability through the fused chunked head) against
log_softmax on full logits, values and gradients, for a frozen and a trained head."""
import torch

from retrograd.models.fused_head import linear_token_logprobs


def reference(h, w, y):
    return torch.log_softmax(h @ w.t(), -1).gather(1, y[:, None]).squeeze(1)


def test_values_and_gradients_match_full_logits():
    torch.manual_seed(0)
    h = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64)
    y = torch.randint(0, 50, (13,))
    coef = torch.randn(13, dtype=torch.float64)
    got = linear_token_logprobs(h, w, y, chunk_size=4)
    (got * coef).sum().backward()
    g_fused = h.grad.clone()
    h.grad = None
    want = reference(h, w, y)
    (want * coef).sum().backward()
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(g_fused, h.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: linear_token_logprobs(x, w, y, chunk_size=5), (h,))


def test_trained_head_gets_gradients_too():
    torch.manual_seed(1)
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 30, (9,))
    linear_token_logprobs(h, w, y, chunk_size=4).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    reference(h, w, y).sum().backward()
    assert torch.allclose(gh, h.grad, atol=1e-12) and torch.allclose(gw, w.grad, atol=1e-12)


def test_no_grad_path():
    h, w, y = torch.randn(5, 4), torch.randn(7, 4), torch.randint(0, 7, (5,))
    with torch.no_grad():
        assert torch.allclose(linear_token_logprobs(h, w, y, 2), reference(h, w, y), atol=1e-6)


def test_unlikely_targets_and_bf16_inputs_stay_exact():
    """The in-place softmax reads log p(y) before its exponentials: a target ~200 nats below the
    best token (whose exp underflows to 0 in float32) still gets its exact log-probability and a
    finite gradient; bf16 hidden states get float32 log-probabilities."""
    torch.manual_seed(0)
    w = torch.randn(50, 8)
    h = torch.randn(3, 8, requires_grad=True)
    y = torch.tensor([1, 2, 3])
    with torch.no_grad():
        w[2] = -40 * h[1].sign() * 1.0  # token 2 is hopeless for row 1
    got = linear_token_logprobs(h, w, y, chunk_size=2)
    want = torch.log_softmax(h @ w.t(), -1).gather(1, y[:, None]).squeeze(1)
    assert want[1] < -150 and torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    got.sum().backward()
    assert torch.isfinite(h.grad).all()
    hb = h.detach().bfloat16().requires_grad_()
    lb = linear_token_logprobs(hb, w.bfloat16(), y)
    assert lb.dtype == torch.float32
    ref = torch.log_softmax((hb.float() @ w.bfloat16().float().t()), -1).gather(1, y[:, None]).squeeze(1)
    assert torch.allclose(lb, ref, atol=0.5, rtol=0.02)


def test_rows_split_into_even_chunks(monkeypatch):
    """Chunks of about the nominal size, all alike: 288 rows under a 256-row nominal run as one chunk (not
    256 + a thin 32, nor two thin 144s: slow products), 400 as 2 x 200; a count that fits is one chunk; every
    chunk holds 0.75-1.5x the nominal rows; the values do not depend on the split."""
    from retrograd.models import fused_head
    assert fused_head.even_chunk_rows(288, 256) == 288
    assert fused_head.even_chunk_rows(257, 256) == 257
    assert fused_head.even_chunk_rows(383, 256) == 383
    assert fused_head.even_chunk_rows(384, 256) == 192
    assert fused_head.even_chunk_rows(400, 256) == 200
    assert fused_head.even_chunk_rows(1020, 256) == 255
    assert fused_head.even_chunk_rows(1024, 256) == 256
    assert fused_head.even_chunk_rows(200, 256) == 200
    assert fused_head.even_chunk_rows(0, 256) == 1
    for rows in range(1, 200):
        size = fused_head.even_chunk_rows(rows, 8)
        n = -(-rows // size)
        last = rows - (n - 1) * size
        assert (n == 1 and size == rows) if rows < 12 else (6 <= size <= 12), (rows, size)
        assert last >= size - n + 1, (rows, size)  # the last chunk is never thin

    seen = []
    call = fused_head.ChunkLogSoftmax.__call__
    monkeypatch.setattr(fused_head.ChunkLogSoftmax, "__call__",
                        lambda self, h: seen.append(h.shape[0]) or call(self, h))
    torch.manual_seed(2)
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 6, dtype=torch.float64)
    y = torch.randint(0, 30, (9,))
    got = linear_token_logprobs(h, w, y, chunk_size=4)
    assert seen == [5, 4]  # 9 rows at a nominal 4: two chunks
    assert torch.allclose(got, reference(h, w, y), atol=1e-12)
