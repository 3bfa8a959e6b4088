"""The LM head fused with its loss, as pure tensor functions: next-token cross-entropy (SFT) and
per-token log-probabilities (preference, RL, the service), chunked over rows.

`linear_cross_entropy_sum(hidden, weight, targets)` computes  sum_i -log softmax(hidden_i @ W^T)[t_i]
over the selected positions only, in chunks of rows, and never keeps the [N, V] logits: the
gradient w.r.t. `hidden` (and `weight` when it requires grad) is computed chunk by chunk during the
forward, where the softmax is at hand, and only scaled in backward. For a 49k vocabulary and
1,024 target tokens that saves ~200 MB of logits plus the same again for their gradient, and the
second lm_head matmul that a recompute-in-backward scheme would pay.

This is valid because the loss is a scalar leaf of the graph: backward receives one number.
"""
from __future__ import annotations

import threading
import weakref

import torch

from retrograd.models.cpu_gemm import mm_into

IGNORE = -100


class _HeadBuffers(threading.local):
    """Per thread, per head weight: the [rows, V] buffers its chunks are written into, kept from one call to
    the next. Held by the weight's id next to a weak reference to it, dropped when the weight is (they go
    with the model); per thread, so two threads scoring with one model never share one. (Not a
    WeakKeyDictionary: its lookups compare tensors with ==.)"""

    def __init__(self):
        self.by_weight: dict[int, tuple[weakref.ref, dict]] = {}

    def get(self, weight: torch.Tensor, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
        entry = self.by_weight.get(id(weight))
        if entry is None or entry[0]() is not weight:
            key, table = id(weight), self.by_weight
            entry = table[key] = (weakref.ref(weight, lambda _, key=key, table=table: table.pop(key, None)), {})
        held = entry[1]
        buf = held.get(dtype)
        if buf is None or buf.shape[0] < rows or buf.device != torch.device(device):
            buf = held[dtype] = torch.empty(rows, weight.shape[0], dtype=dtype, device=device)
        return buf[:rows]  # leading rows of a contiguous buffer: contiguous


_BUFFERS = _HeadBuffers()


# a float32 chunk's logits on a CPU are written a block of vocabulary columns at a time, each block about
# this many bytes of output (logits_into)
LOGIT_BLOCK_BYTES = 1 << 20


def logits_block_columns(rows: int, vocab: int) -> int:
    """Vocabulary columns per block of logits_into: ~LOGIT_BLOCK_BYTES of float32 output, 512-2048 columns,
    a multiple of 64 (the whole vocabulary when that is not more than one block)."""
    columns = min(2048, max(512, LOGIT_BLOCK_BYTES // (4 * max(rows, 1)) // 64 * 64))
    return vocab if vocab <= columns else columns


def logits_into(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[C, V] = h @ weight.T, float32. On a CPU the product runs as one GEMM per block of ~1 MB of output
    columns (out[:, block] = h @ weight[block].T, each written in place through the row stride), not one
    GEMM over the whole [C, V]: each block's output stays in the cache while the GEMM fills it. The values
    are the single product's bit for bit (each output still sums the same H terms in the same kernel), and
    the product ran 10-24 % faster: a [255, 576] x [576, 49k] chunk (SmolLM2's head, an SFT pass's two
    chunks) 142 -> 165 GFLOP/s, 384 rows 140 -> 174, 128 rows 119 -> 148, 510 rows 163 -> 179, faster in
    47 of 48 interleaved pairs (2-core AVX-512 AMD EPYC, fp32 peak 204 GFLOP/s;
    benchmarks/results/ab_head_blocks_20261206_211908.json); a whole SFT LoRA pass 1.7 % faster. Not for
    bf16: there the blocks were 7-10 % slower than the single product (305 against 339 GFLOP/s), and not on
    an accelerator, whose one large GEMM is the fast form. Each block's product runs with this machine's float32
    GEMM library (models/cpu_gemm.py): on the AVX-512 EPYC oneDNN's blocks, each copied into `out`, ran at
    170-182 GFLOP/s against MKL's 141-143 at 255-292 rows."""
    vocab = weight.shape[0]
    columns = logits_block_columns(h.shape[0], vocab) if h.device.type == "cpu" else vocab
    if columns >= vocab:
        return mm_into(h, weight.t(), out)
    for start in range(0, vocab, columns):
        mm_into(h, weight[start:start + columns].t(), out[:, start:start + columns])
    return out


class ChunkLogSoftmax:
    """float32 log_softmax(h @ W^T) of one chunk of rows at a time, written into one [chunk, V] buffer
    (in place: the matmul writes the logits there and the row-wise log_softmax overwrites them, bit for
    bit what the out-of-place ops give). The buffer is kept for the next call with the same weight
    (_HeadBuffers), so every chunk of every pass writes to the same memory.

    Why: a chunk's logits are 50 MB (256 rows x 49k x 4 B). As a fresh tensor every chunk, touching
    its new pages (12k page faults) cost ~25 ms of a ~135 ms chunk on a 2-core Xeon. As a buffer per
    call, the first chunk of each pass still ran slow on an AMD EPYC of this machine kind: its logits
    matmul at 95 GFLOP/s against 150 kept (fp32), 204 against 385 (bf16), ~2-3 % of an SFT step.
    The head's peak memory at the end of a forward (where every activation is still held) is one buffer.

    With bf16 weights the logits come out of the matmul in bf16 and the probabilities go back into one
    in bf16 (`low`): both in a second kept buffer of the weights' dtype, instead of two fresh 25 MB
    tensors a chunk."""

    def __init__(self, weight: torch.Tensor, acc: torch.dtype):
        self.weight, self.acc = weight, acc

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        rows = h.shape[0]
        out = _BUFFERS.get(self.weight, rows, self.acc, h.device)
        if h.dtype == self.acc and self.weight.dtype == self.acc:
            logits_into(h, self.weight, out)
        elif h.dtype == self.weight.dtype:  # bf16 logits, then float32 as log_softmax(..., dtype=float32) casts them
            out.copy_(torch.mm(h, self.weight.t(), out=_BUFFERS.get(self.weight, rows, h.dtype, h.device)))
        else:
            out.copy_(h @ self.weight.t())
        return torch.log_softmax(out, dim=-1, out=out)

    def low(self, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """probs (float32, this call's chunk) in `dtype`: a copy into the kept buffer, or probs itself."""
        if probs.dtype == dtype:
            return probs
        return _BUFFERS.get(self.weight, probs.shape[0], dtype, probs.device).copy_(probs)


def select_targets(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift for next-token prediction and keep only trained positions.

    hidden [B, T, H], labels [B, T] (IGNORE where untrained) -> (hidden_sel [N, H], targets [N]).
    """
    h = hidden[:, :-1, :]  # [B, T-1, H] position t predicts token t+1
    y = labels[:, 1:]  # [B, T-1]
    keep = y != IGNORE
    return h[keep], y[keep]


def even_chunk_rows(rows: int, chunk_rows: int) -> int:
    """The chunk size that splits `rows` into chunks of about `chunk_rows` rows, all of about one size: as many
    chunks as rows / chunk_rows rounded, so each holds 0.75-1.5x chunk_rows rows (fewer rows in all: one
    chunk). 288 rows in one chunk, not 256 + 32 nor 144 + 144; 1,024 rows in four of 256; 400 in two of 200.
    A thin chunk runs its [C, H] x [H, V] product below the matmul peak: 32 rows ~150 against ~260 GFLOP/s
    for 144 or 256 on a 2-core Xeon; on a 2-core AVX-512 EPYC the head's whole pipeline (logits,
    log-softmax, softmax - onehot, input gradient) took 0.83 ms a row in chunks of 146 rows, 0.77 in 200,
    0.72 in 292 and 0.69 in 400 (a DPO pass's 292 completion tokens: 242 against 210 ms in one chunk)."""
    if rows <= chunk_rows:
        return max(rows, 1)
    chunks = (2 * rows + chunk_rows) // (2 * chunk_rows)  # rows / chunk_rows rounded half up, >= 1 here
    return -(-rows // chunks)


def new_weight_gradient(weight: torch.Tensor, acc: torch.dtype, rows: int) -> torch.Tensor | None:
    """The [V, H] buffer a trained head's gradient is summed into chunk by chunk (None for a frozen head).
    Not zero-filled: the first chunk's product writes it (add_weight_gradient). For SmolLM2's 49k x 576
    head the fill was a 113 MB pass over fresh pages, ~21 ms a pass on a 2-core Xeon."""
    if not weight.requires_grad:
        return None
    return torch.zeros_like(weight, dtype=acc) if rows == 0 else torch.empty_like(weight, dtype=acc)


def add_weight_gradient(grad_w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """grad_w (+)= a @ b: the first chunk writes, the later ones add."""
    if first:
        torch.mm(a, b, out=grad_w)
    else:
        grad_w.addmm_(a, b)


def scaled_weight_gradient(grad_w: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The head's gradient times the loss's incoming gradient. In place when this backward frees the graph
    after it (the usual single backward): the buffer is then this node's alone and is never read again.
    The out-of-place product allocates another [V, H] tensor a pass (113 MB of fresh pages for SmolLM2's
    head, ~25 ms against ~8 in place on a 2-core Xeon). A backward that keeps the graph (retain_graph,
    gradcheck) gets the out-of-place product, so a second backward sees the unscaled buffer."""
    if _backward_frees_graph():
        return grad_w.mul_(grad_out.to(grad_w.dtype))
    return (grad_w * grad_out).to(grad_w.dtype)


def _backward_frees_graph() -> bool:
    """Whether the running backward frees its graph (retain_graph=False). Asks autograd's engine through a
    private binding; without it, answers False (the out-of-place product: slower, always correct)."""
    keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keeps_graph is not None and not keeps_graph()


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 softmax even for bf16 inputs
        loss = hidden.new_zeros((), dtype=acc)
        grad_h = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_w = new_weight_gradient(weight, acc, hidden.shape[0])
        log_softmax = ChunkLogSoftmax(weight, acc)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]  # [C, H]
            y = targets[start:start + chunk_size]  # [C]
            logp = log_softmax(h)  # [C, V] float32
            loss -= logp.gather(1, y[:, None]).sum()
            if grad_h is not None or grad_w is not None:
                # d(-log p_y)/d logits = softmax - onehot, computed in place on the log-probabilities
                probs = logp.exp_()
                probs[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                probs = log_softmax.low(probs, hidden.dtype)
                if grad_h is not None:
                    mm_into(probs, weight, grad_h[start:start + chunk_size])  # [C, H]
                if grad_w is not None:
                    add_weight_gradient(grad_w, probs.t().to(acc), h.to(acc), first=start == 0)  # [V, H]
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.has = (grad_h is not None, grad_w is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.has[0] else None
        gw = scaled_weight_gradient(grad_w, grad_out) if ctx.has[1] else None
        return gh, gw, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_size: int = 1024) -> torch.Tensor:
    """Sum over rows of -log softmax(hidden @ weight.T)[target]. hidden [N, H], weight [V, H],
    targets [N] -> scalar (float32). Divide by the number of trained tokens of the whole
    optimizer step (not of the micro-batch) to get the mean the optimizer should see."""
    chunk_size = even_chunk_rows(hidden.shape[0], chunk_size)
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0 + weight.sum() * 0.0
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():  # evaluation: no gradient work at all
            acc = torch.promote_types(hidden.dtype, torch.float32)
            total = torch.zeros((), dtype=acc, device=hidden.device)
            log_softmax = ChunkLogSoftmax(weight, acc)
            for s in range(0, hidden.shape[0], chunk_size):
                total -= log_softmax(hidden[s:s + chunk_size]).gather(1, targets[s:s + chunk_size, None]).sum()
            return total
    return _LinearCrossEntropySum.apply(hidden, weight, targets, chunk_size)


def cross_entropy_sum_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The textbook version on full logits [B, T, V] (what HF computes), summed, for tests and for
    models whose head is not a plain linear layer."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")


class _LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(h_n @ W^T)[t_n] per row; d/dh_n = W[t_n] - softmax_n @ W is computed in the
    forward (the softmax is at hand there) and scaled per row in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden)
        log_softmax = ChunkLogSoftmax(weight, acc)
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start:start + chunk_size], targets[start:start + chunk_size]
            logp = log_softmax(h)  # [C, V] float32
            out[start:start + chunk_size] = logp.gather(1, y[:, None]).squeeze(1)
            probs = logp.exp_()
            probs[torch.arange(y.shape[0], device=y.device), y] -= 1.0
            g = grad_h[start:start + chunk_size]
            mm_into(log_softmax.low(probs, hidden.dtype), weight, g).neg_()  # [C, H]
        ctx.save_for_backward(grad_h)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype)[:, None], None, None, None


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 1024) -> torch.Tensor:
    """Per-row log-probability of the target token: hidden [N, H], weight [V, H], targets [N] ->
    [N] (float32), without keeping [N, V] logits. A head that is itself trained (a full fine-tune)
    goes through autograd one chunk at a time, recomputing the chunk's logits in backward."""
    chunk_size = even_chunk_rows(hidden.shape[0], chunk_size)
    acc = torch.promote_types(hidden.dtype, torch.float32)

    def plain(h, y):
        return torch.log_softmax(h @ weight.t(), dim=-1, dtype=acc).gather(1, y[:, None]).squeeze(1)

    if hidden.shape[0] == 0:
        return hidden.sum(-1).to(acc) * 0.0
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():
            log_softmax = ChunkLogSoftmax(weight, acc)
            chunks = range(0, hidden.shape[0], chunk_size)
            return torch.cat([log_softmax(hidden[s:s + chunk_size]).gather(1, targets[s:s + chunk_size, None])[:, 0]
                              for s in chunks])
    if weight.requires_grad:
        from torch.utils.checkpoint import checkpoint
        return torch.cat([checkpoint(plain, hidden[s:s + chunk_size], targets[s:s + chunk_size], use_reentrant=False)
                          for s in range(0, hidden.shape[0], chunk_size)])
    return _LinearTokenLogprobs.apply(hidden, weight, targets, chunk_size)


# ---- offline distillation: forward KL to a teacher's top-k ----------------------------------------
# log(1 - sum of the top-k probabilities) is clamped below this, so that a top-k holding (nearly) all
# the mass gives a finite tail term (its weight, the teacher's tail probability, is ~0 there)
TAIL_LOG_MAX = -1e-6


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_bucket_kl(student_logp: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per position, KL(teacher || student) over k + 1 buckets: the teacher's top-k tokens and the tail
    (everything else). student_logp [C, V] log-softmax, ids [C, k], teacher_logp [C, k] -> [C]."""
    s_k = student_logp.gather(1, ids)  # [C, k]
    p_k = teacher_logp.exp()
    t_tail_log = log1mexp(torch.logsumexp(teacher_logp, -1).clamp(max=TAIL_LOG_MAX))
    s_tail_log = log1mexp(torch.logsumexp(s_k, -1).clamp(max=TAIL_LOG_MAX))
    return (p_k * (teacher_logp - s_k)).sum(-1) + t_tail_log.exp() * (t_tail_log - s_tail_log)


class _LinearTopkKlSum(torch.autograd.Function):
    """sum over positions of topk_bucket_kl; the gradient w.r.t. the logits z is computed in the forward,
    chunk by chunk: with q = softmax(z), K the teacher's top-k, p_K their teacher probabilities, P = sum p_K,
    S = sum q_K:  dL/dz_j = q_j - p_j for j in K, and q_j (P - (1 - P) S / (1 - S)) elsewhere."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, teacher_logp, chunk_size):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        loss = hidden.new_zeros((), dtype=acc)
        grad_h = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_w = new_weight_gradient(weight, acc, hidden.shape[0])
        log_softmax = ChunkLogSoftmax(weight, acc)
        for start in range(0, hidden.shape[0], chunk_size):
            h, k_ids = hidden[start:start + chunk_size], ids[start:start + chunk_size]
            t = teacher_logp[start:start + chunk_size].to(acc)
            logp = log_softmax(h)  # [C, V] float32
            loss += topk_bucket_kl(logp, k_ids, t).sum()
            q = logp.exp_()
            big_p = t.exp().sum(-1).clamp(max=1.0)
            q_k = q.gather(1, k_ids)
            s = q_k.sum(-1).clamp(max=1.0 - 1e-6)
            outside = big_p - (1.0 - big_p) * s / (1.0 - s)  # [C]
            g = q.mul_(outside[:, None]).scatter_(1, k_ids, q_k - t.exp()).to(hidden.dtype)
            if grad_h is not None:
                mm_into(g, weight, grad_h[start:start + chunk_size])
            if grad_w is not None:
                add_weight_gradient(grad_w, g.t().to(acc), h.to(acc), first=start == 0)
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.has = (grad_h is not None, grad_w is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.has[0] else None
        gw = scaled_weight_gradient(grad_w, grad_out) if ctx.has[1] else None
        return gh, gw, None, None, None


def linear_topk_kl_sum(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor,
                       chunk_size: int = 1024) -> torch.Tensor:
    """Summed forward KL from a teacher's top-k (with the tail mass as one more bucket) to
    softmax(hidden @ weight.T), never holding more than [chunk_size, V] logits. hidden [N, H],
    weight [V, H], ids [N, k] (long), teacher_logp [N, k] -> scalar float32."""
    chunk_size = even_chunk_rows(hidden.shape[0], chunk_size)
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0 + weight.sum() * 0.0
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with torch.no_grad():
            acc = torch.promote_types(hidden.dtype, torch.float32)
            return sum((topk_bucket_kl(torch.log_softmax(hidden[s:s + chunk_size] @ weight.t(), -1, dtype=acc),
                                       ids[s:s + chunk_size], teacher_logp[s:s + chunk_size].to(acc)).sum()
                        for s in range(0, hidden.shape[0], chunk_size)), torch.zeros((), dtype=acc))
    return _LinearTopkKlSum.apply(hidden, weight, ids, teacher_logp, chunk_size)
