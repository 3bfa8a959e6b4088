"""The SFT loss: hand-computed values, the textbook cross-entropy, and finite differences."""
import math

import torch

from retrograd.models.fused_head import (IGNORE, cross_entropy_sum_reference, linear_cross_entropy_sum,
                                      select_targets)


def test_hand_computed_value():
    # one position, hidden = [1, 0], W rows = [1,0], [0,1], [0,0] -> logits [1, 0, 0]
    # -log softmax[0] = log(e + 2) - 1
    h = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    loss = linear_cross_entropy_sum(h, w, torch.tensor([0]))
    assert math.isclose(float(loss), math.log(math.e + 2) - 1, rel_tol=1e-6)
    # target 2 instead: -log softmax[2] = log(e + 2)
    loss2 = linear_cross_entropy_sum(h, w, torch.tensor([2]))
    assert math.isclose(float(loss2), math.log(math.e + 2), rel_tol=1e-6)


def test_gradient_hand_computed():
    # d loss / d h = sum_v p_v w_v - w_y ; with logits [1,0,0], y=0: p = [e,1,1]/(e+2)
    h = torch.tensor([[1.0, 0.0]], requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    linear_cross_entropy_sum(h, w, torch.tensor([0])).backward()
    z = math.e + 2
    expected = [math.e / z - 1.0, 1.0 / z]
    assert torch.allclose(h.grad, torch.tensor([expected]), atol=1e-6)


def test_matches_textbook_cross_entropy_and_its_gradients():
    torch.manual_seed(0)
    h = torch.randn(10, 6, requires_grad=True)
    w = torch.randn(13, 6, requires_grad=True)
    y = torch.randint(0, 13, (10,))
    ours = linear_cross_entropy_sum(h, w, y, chunk_size=4)
    gh, gw = torch.autograd.grad(ours, (h, w))
    ref = torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="sum")
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(gh, rh, atol=1e-5)
    assert torch.allclose(gw, rw, atol=1e-5)


def test_finite_differences():
    torch.manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.double, requires_grad=True)
    y = torch.randint(0, 7, (5,))
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy_sum(a, b, y, chunk_size=2), (h, w))


def test_scaled_backward_uses_grad_output():
    torch.manual_seed(2)
    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4)
    y = torch.tensor([0, 1, 2])
    (linear_cross_entropy_sum(h, w, y) / 3.0).backward()
    ref_h = h.detach().clone().requires_grad_()
    (torch.nn.functional.cross_entropy(ref_h @ w.t(), y, reduction="sum") / 3.0).backward()
    assert torch.allclose(h.grad, ref_h.grad, atol=1e-6)


def test_select_targets_shifts_and_masks():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float).reshape(2, 4, 1)  # [B=2, T=4, H=1]
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6], [IGNORE, 7, IGNORE, IGNORE]])
    h, y = select_targets(hidden, labels)
    # label at t is predicted from hidden at t-1
    assert y.tolist() == [5, 6, 7]
    assert h.squeeze(1).tolist() == [1.0, 2.0, 4.0]


def test_fused_path_equals_full_logits_path_on_a_batch():
    torch.manual_seed(3)
    hidden = torch.randn(2, 5, 4)
    w = torch.randn(9, 4)
    labels = torch.randint(0, 9, (2, 5))
    labels[0, :2] = IGNORE
    h, y = select_targets(hidden, labels)
    fused = linear_cross_entropy_sum(h, w, y)
    ref = cross_entropy_sum_reference(hidden @ w.t(), labels)
    assert torch.allclose(fused, ref, atol=1e-5)


def test_no_grad_evaluation_path():
    torch.manual_seed(4)
    h, w, y = torch.randn(6, 3), torch.randn(8, 3, requires_grad=True), torch.randint(0, 8, (6,))
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h, w, y, chunk_size=4)
    ref = torch.nn.functional.cross_entropy(h @ w.detach().t(), y, reduction="sum")
    assert torch.allclose(loss, ref, atol=1e-5)


def test_chunk_log_softmax_is_the_out_of_place_result_in_one_reused_buffer():
    from retrograd.models.fused_head import ChunkLogSoftmax
    torch.manual_seed(0)
    w = torch.randn(50, 8)
    h = torch.randn(7, 8)
    f = ChunkLogSoftmax(w, torch.float32)
    first = f(h[:4])
    assert torch.equal(first, torch.log_softmax(h[:4] @ w.t(), dim=-1))
    ptr = first.data_ptr()
    last = f(h[4:])  # a shorter last chunk: the same buffer's leading rows
    assert last.data_ptr() == ptr and last.shape == (3, 50)
    assert torch.equal(last, torch.log_softmax(h[4:] @ w.t(), dim=-1))
    # bf16 hidden and weight: float32 log-probabilities, as log_softmax(..., dtype=float32) gives them
    hb, wb = h.bfloat16(), w.bfloat16()
    out = ChunkLogSoftmax(wb, torch.float32)(hb)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.log_softmax(hb @ wb.t(), dim=-1, dtype=torch.float32))


def test_cpu_logits_are_written_in_vocabulary_blocks_equal_to_the_single_product(monkeypatch):
    from retrograd.models.fused_head import ChunkLogSoftmax, logits_block_columns, logits_into
    torch.manual_seed(5)
    h, w = torch.randn(600, 16), torch.randn(5000, 16)
    # ~1 MB of float32 output per block: 600 rows -> 436 columns, raised to the 512 floor; the last block ragged
    assert logits_block_columns(600, 5000) == 512 and 5000 % 512
    assert logits_block_columns(255, 49152) == 1024 and logits_block_columns(4, 49152) == 2048
    assert logits_block_columns(600, 300) == 300  # a vocabulary of at most one block: one product
    calls = []
    real_mm = torch.mm

    def counting_mm(*args, **kwargs):
        calls.append(args[1].shape)
        return real_mm(*args, **kwargs)

    out = torch.full((600, 5000), float("nan"))
    with monkeypatch.context() as patch:
        patch.setattr(torch, "mm", counting_mm)
        logits_into(h, w, out)
    assert [c[1] for c in calls] == [512] * 9 + [392]  # ten products, every column written once
    assert torch.equal(out, h @ w.t())
    assert torch.equal(ChunkLogSoftmax(w, torch.float32)(h), torch.log_softmax(h @ w.t(), dim=-1))


def test_chunk_buffers_outlive_the_call_die_with_the_weight_and_are_per_thread():
    import gc
    import threading
    import weakref

    from retrograd.models.fused_head import _BUFFERS, ChunkLogSoftmax
    torch.manual_seed(2)
    w, h = torch.randn(40, 8), torch.randn(5, 8)
    ptr = ChunkLogSoftmax(w, torch.float32)(h).data_ptr()
    assert ChunkLogSoftmax(w, torch.float32)(h[:3]).data_ptr() == ptr  # the next call (the next pass) reuses it
    other = ChunkLogSoftmax(torch.randn(40, 8), torch.float32)(h)  # another weight: its own buffer
    assert other.data_ptr() != ptr
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(ptr=ChunkLogSoftmax(w, torch.float32)(h).data_ptr()))
    thread.start()
    thread.join()
    assert seen["ptr"] != ptr  # a thread of its own never writes into this thread's buffer
    held = weakref.ref(_BUFFERS.by_weight[id(w)][1][torch.float32])
    del w
    gc.collect()
    assert held() is None  # the weight gone, so are its buffers


def test_bf16_head_through_the_kept_buffers_equals_the_out_of_place_ops():
    torch.manual_seed(3)
    h = torch.randn(9, 8).bfloat16().requires_grad_()
    w = torch.randn(30, 8).bfloat16()
    y = torch.randint(0, 30, (9,))
    for _ in range(2):  # the second call runs in the buffers the first one left
        loss = linear_cross_entropy_sum(h, w, y, chunk_size=4)
        (grad,) = torch.autograd.grad(loss, h)
        want = torch.zeros(())
        want_grad = torch.empty_like(h)
        c = 5  # 9 rows at a nominal 4: two chunks (fused_head.even_chunk_rows)
        for s in range(0, 9, c):  # the same chunked arithmetic with fresh tensors
            logp = torch.log_softmax(h[s:s + c].detach() @ w.t(), dim=-1, dtype=torch.float32)
            want -= logp.gather(1, y[s:s + c, None]).sum()
            probs = logp.exp()
            probs[torch.arange(len(y[s:s + c])), y[s:s + c]] -= 1.0
            want_grad[s:s + c] = probs.to(torch.bfloat16) @ w
        assert torch.equal(loss, want) and torch.equal(grad, want_grad)


def test_chunked_loss_and_gradient_do_not_depend_on_the_chunk_size():
    # the reused buffer must not carry one chunk's values into the next (a shorter last chunk included)
    torch.manual_seed(1)
    h = torch.randn(11, 6, requires_grad=True)
    w = torch.randn(17, 6)
    y = torch.randint(0, 17, (11,))
    whole = linear_cross_entropy_sum(h, w, y, chunk_size=11)
    (g_whole,) = torch.autograd.grad(whole, h)
    chunked = linear_cross_entropy_sum(h, w, y, chunk_size=4)
    (g_chunked,) = torch.autograd.grad(chunked, h)
    assert torch.allclose(whole, chunked, rtol=1e-6) and torch.allclose(g_whole, g_chunked, atol=1e-6)


def _trained_head_case(seed: int = 3):
    torch.manual_seed(seed)
    h = torch.randn(9, 6, requires_grad=True)
    w = torch.randn(17, 6, requires_grad=True)
    return h, w, torch.randint(0, 17, (9,))


def test_trained_head_gradient_is_written_by_the_first_chunk_and_scaled_in_place():
    # no zero fill of the [V, H] gradient (the first chunk's product writes it) and no out-of-place
    # [V, H] product in backward: the scale is applied in place, and the result is still the textbook one
    h, w, y = _trained_head_case()
    with torch.profiler.profile(record_shapes=True) as prof:
        loss = linear_cross_entropy_sum(h, w, y, chunk_size=4) / 7.0  # three chunks, the last one short
        loss.backward()
    on_head = [(e.name, e.input_shapes[0]) for e in prof.events() if e.input_shapes and e.input_shapes[0] == [17, 6]]
    assert ("aten::mul_", [17, 6]) in on_head
    assert not [n for n, _ in on_head if n in ("aten::fill_", "aten::zero_", "aten::mul")], on_head
    rh, rw = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.nn.functional.cross_entropy(rh @ rw.t(), y, reduction="sum") / 7.0).backward()
    assert torch.allclose(w.grad, rw.grad, atol=1e-6) and torch.allclose(h.grad, rh.grad, atol=1e-6)


def test_a_backward_that_keeps_the_graph_leaves_the_head_gradient_unscaled():
    # retain_graph: the in-place scale would make a second backward scale twice; that backward takes the
    # out-of-place product, and a second one gives the same gradient again
    h, w, y = _trained_head_case(4)
    loss = linear_cross_entropy_sum(h, w, y, chunk_size=4) * 0.5
    first = torch.autograd.grad(loss, w, retain_graph=True)[0]
    second = torch.autograd.grad(loss, w)[0]
    assert torch.equal(first, second)
    fresh = torch.autograd.grad(linear_cross_entropy_sum(h, w, y, chunk_size=4) * 0.5, w)[0]  # in place
    assert torch.equal(first, fresh)


def test_the_topk_kl_head_gradient_takes_the_same_path():
    from retrograd.models.fused_head import linear_topk_kl_sum, topk_bucket_kl
    h, w, _ = _trained_head_case(5)
    ids = torch.randint(0, 17, (9, 3))
    teacher = torch.log_softmax(torch.randn(9, 4), -1)[:, :3]
    (linear_topk_kl_sum(h, w, ids, teacher, chunk_size=4) * 0.25).backward()
    rh, rw = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (topk_bucket_kl(torch.log_softmax(rh @ rw.t(), -1), ids, teacher).sum() * 0.25).backward()
    assert torch.allclose(w.grad, rw.grad, atol=1e-6) and torch.allclose(h.grad, rh.grad, atol=1e-6)
