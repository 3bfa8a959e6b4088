"""A Llama decoder's forward on the real tokens of a padded batch only: no layer computes a padding position.

transformers' forward runs every position of a [R, W] batch through every projection, MLP and norm,
padding included. In a scoring pass the padding is what the layout could not avoid: a GRPO update's
prompt-led rows are as wide as its longest group (on the benchmark's update, 584 positions for 511
tokens: 12.5 % of the pass's matmuls computed on nothing), and SFT passes of rows of different lengths
are right-padded to the longest row. Here the token-wise work (embedding, RMSNorms, q/k/v/o, the MLP,
the residual adds, the final norm) runs on the N real tokens as one [1, N, H] batch, and only attention
sees the padded grid: each layer scatters its queries, keys and values into [R, W] (zeros at padding),
attends with the caller's mask, and gathers the real positions back. The modules are
the model's own (PEFT's LoRA layers, the lean MLP, the RMSNorms' weights, the rotary embedding), called
on a different leading shape, so LoRA, its dropout and the gradients are unchanged; attention's maths is
transformers' (RoPE, each key/value head serving its group of query heads, the same scale), and a padded
key is always masked, so a real token's values are those of the plain forward up to float rounding
(tested, values and gradients, against transformers' forward). Rows without padding (SFT's) run here too: their grid is
a view of the tokens (nothing scattered or gathered), and the layers' RoPE and RMSNorms are
models/lean_ops.py's, with fewer kernels than transformers' op-by-op forward.

Attention is SDPA's kernel, or `matmul_attention` (two batched products and a softmax, each key/value
head serving its group of query heads without being copied per head) where that is the faster one:
always when the model is set to transformers' eager attention (device.attention_for_length does so for
short bf16 passes), and for bf16 on a CPU up to MATMUL_ATTENTION_MAX_KEYS keys. There SDPA's flash
kernel took twice as long, forward + backward (SmolLM2's 9 query / 3 key-value heads, D 64, a 2-core
AMD EPYC with native bf16): [2, 9, 256, 64] queries 12.0-12.4 ms against 5.2-6.3 ms a layer (in the
profile of a whole 1.4 s SFT LoRA pass, flash took 9.1 ms a layer, 19 % of the pass), 21.9 against
10.6 ms at 512 keys; but 47 against 54 ms at 1,024 keys and 148 against 220 at 2,048, where flash's
tiles win and the [H, W, K] probabilities that backward keeps grow. In float32 SDPA stays: the matmul
form was 0-15 % faster in isolation, not worth its probabilities' memory (~140 MB a 512-token pass of
SmolLM2, 8 % of SFT LoRA's peak; in bf16, 71 MB).

A causal pass without a past (SFT's rows) of at least CAUSAL_SPLIT_MIN_WIDTH queries attends in two halves
(`causal_halves_attention`): the first half of the queries against the first half of the keys only, the
second against all, skipping the product that the causal mask would zero entirely: a quarter less work in
the products and the softmax, and a quarter less of the probabilities kept for backward (bf16 [2, 256]
SFT pass of SmolLM2 on the AVX-512 EPYC: forward + backward of one layer's attention 4.3 against 5.5 ms in
isolation; the whole pass 2.5 % faster, median of 20 interleaved pairs). In float32 the halves against
SDPA's flash kernel were 1.4 % faster on that pass (16 pairs), for +106 MB of probabilities: SDPA stays.

`PackedForward(decoder).supported()` says whether it applies now: a plain Llama (`llama`), SDPA or eager
as the attention, no attention dropout, no gradient checkpointing. Otherwise the caller uses the model's
own forward. `matmul_attention_for(keys)` says which attention a pass over `keys` keys runs.
`compile_training_passes(decoder)` (`[training] compile`) makes the passes with autograd run the layers
through torch.compile; `compiled()` says whether this pass does.

  run(ids, positions, real, mask=None, past=None, keep_kv=False)
      ids / positions / real [R, W]: the padded grid, its positions and where a real token is; mask:
      the additive [R | 1, 1, W, P + W] mask over `past` keys and the grid's own (None: causal, for
      rows whose padding all follows their tokens, and no past); past: per layer (keys, values) [R | 1, KV, P, D]
      every row attends to before its own (a cached prefix or prompt). -> (final hidden states
      [N, H] of the real tokens, row by row, after the last norm; slots [N]: each one's flat index
      r * W + column in the grid; with keep_kv per layer the (keys, values) [R, KV, P + W, D] the
      rows attended to, past included, after RoPE, zeros at padding)
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from retrograd.models.lean_ops import rms_norm, rope

PACKED_MODELS = ("llama",)
MATMUL_ATTENTION_MAX_KEYS = 512
# causal matmul attention splits its queries in two halves from this many queries on (causal_halves_attention)
CAUSAL_SPLIT_MIN_WIDTH = 64
# SDPA's enable_gqa (torch >= 2.5) lets each key/value head serve its group of query heads inside the
# kernel; before, the keys and values are copied per query head (repeat_interleave) and backward sums the
# copies' gradients back
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
# decoder -> its compiled _layers ([training] compile; compile_training_passes)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_training_passes(decoder) -> None:
    """`[training] compile`: the packed forward of `decoder`'s training passes (autograd on) runs through
    torch.compile (inductor): the norms, RoPE, residual adds, the SiLU product and the LoRA additions fuse
    into kernels that read each tensor once, where eager PyTorch reads it once per op. Passes without
    autograd (reference scoring, evaluation, sampling) stay eager, so they compile nothing. The first
    training pass compiles (for SmolLM2 on a 2-core CPU 1.5-9 minutes cold; inductor and AOTAutograd keep
    what they built in inductor's on-disk cache, so a later run or a resume starts 2x faster,
    benchmarks/ab_compile_cache.py). The first pass's shape compiles static, the fastest graph for work
    of one shape (bench_sft.py's full rows); the first pass of another shape (rows, width or real tokens)
    compiles once more with all three symbolic, and that graph serves every later shape, padded or full
    (_symbolic_lengths; a single row still compiles its own, as dynamo specialises sizes of 1). The
    grid's slots (a data-dependent size) stay outside the compiled graph."""
    compiled = torch.compile(_layers, dynamic=None)
    first = []  # the first pass's (rows, width, real tokens): the static graph's shape

    def layers(decoder, ids, positions, slots, mask, past, keep_kv, matmul_attention_, full_grid):
        shape = (*ids.shape, slots.shape[0])
        if not first:
            first.append(shape)
        elif shape != first[0]:
            _symbolic_lengths(ids, positions, slots, mask, past)
            # in a symbolic graph, the grid's fullness would be a guard: a full pass after padded ones
            # would compile a third graph; the padded path is exact for a full grid too
            full_grid = False
        with _cache_our_autograd_functions():
            return compiled(decoder, ids, positions, slots, mask, past, keep_kv, matmul_attention_, full_grid)
    _COMPILED[decoder] = layers


def _symbolic_lengths(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
                      past: list | None) -> None:
    """Ask dynamo to compile the pass with every length in it symbolic at once: the rows, the width and the
    real-token count, the mask's rows, queries and keys, and the past's keys. Left to itself it makes
    symbolic only the sizes that changed since the last compile, and an unmarked tensor's static size
    pins the sizes it meets (a GRPO pass's mask pinned its width), so a run whose widths vary compiled
    again when its row count first changed, or at every new width. A size of 1 (a mask broadcast over the
    rows, a single row) stays static: dynamo specialises those. The marks only matter to a compile: a call
    that a compiled graph's guards accept runs that graph."""
    marks = [(ids, (0, 1)), (positions, (0, 1)), (slots, (0,))]
    if mask is not None and mask.dim() == 4:
        marks.append((mask, (0, 2, 3)))  # [R | 1, 1, W, K]
    for keys, values in past or ():
        marks += [(keys, (2,)), (values, (2,))]  # [1, KV, P, D]
    for t, dims in marks:
        for d in dims:
            if t.shape[d] > 1:
                torch._dynamo.maybe_mark_dynamic(t, d)


def _cache_our_autograd_functions():
    """AOTAutograd's on-disk cache, for graphs that hold our autograd Functions (the LoRA node, the SiLU
    product). By default it bypasses any graph with a custom Function, so every compiled run traced and
    partitioned the joint graph again: a 3-step SmolLM2 run with inductor's cache warm took 262.7 s
    against 118.6 s with this (benchmarks/ab_compile_cache.py). Safe for ours: dynamo traces each
    Function's forward and backward into subgraphs of the graph the cache key hashes, and they read no
    state outside their inputs and constants, so a changed Function is a changed key
    (tests/unit/test_compiled_passes.py). The compiled region runs only the packed Llama layers, so the
    Functions in it are ours (transformers' and PEFT's Llama code has none)."""
    from torch._functorch import config
    if not hasattr(config, "autograd_cache_allow_custom_autograd_functions"):  # an older torch: no such cache
        return contextlib.nullcontext()
    return config.patch(autograd_cache_allow_custom_autograd_functions=True)


class PackedForward:
    def __init__(self, decoder):
        self.decoder = decoder
        cfg = decoder.config
        self.config = cfg
        self.shaped = (getattr(cfg, "model_type", None) in PACKED_MODELS
                       and all(hasattr(decoder, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))
                       and not float(getattr(cfg, "attention_dropout", 0.0) or 0.0))

    def supported(self) -> bool:
        """Whether a pass can run packed now (the attention implementation and checkpointing can change
        between passes)."""
        return (self.shaped and getattr(self.config, "_attn_implementation", None) in ("sdpa", "eager")
                and not (self.decoder.training and getattr(self.decoder, "gradient_checkpointing", False)))

    def matmul_attention_for(self, keys: int) -> bool:
        """A pass whose queries see `keys` keys attends with matmul_attention (else SDPA): see the docstring."""
        if getattr(self.config, "_attn_implementation", None) == "eager":
            return True
        weight = self.decoder.embed_tokens.weight
        return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and keys <= MATMUL_ATTENTION_MAX_KEYS

    def compiled(self) -> bool:
        """A pass now runs the compiled layers (compile_training_passes, and autograd on)."""
        return torch.is_grad_enabled() and self.decoder in _COMPILED

    def run(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, mask: torch.Tensor | None = None,
            past: list | None = None, keep_kv: bool = False):
        slots = grid_slots(real)  # data-dependent size: always eager, outside any compiled graph
        layers = _COMPILED[self.decoder] if self.compiled() else _layers
        h, kept = layers(self.decoder, ids, positions, slots, mask, past, keep_kv,
                         self.matmul_attention_for(ids.shape[1] + (past[0][0].shape[2] if past else 0)),
                         slots.shape[0] == ids.numel())
        return h, slots, kept


def _layers(decoder, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
            past: list | None, keep_kv: bool, matmul_attention_: bool, full_grid: bool):
    """PackedForward.run after the slots: the embedding, every layer and the last norm (a function of the
    decoder, not of a PackedForward, so that one compiled copy serves every Scorer of the model).
    full_grid: every cell of the [rows, width] grid is a real token, so the grid is a view of the packed
    tokens (no scatter, no gather); False is exact for a full grid too."""
    cfg = decoder.config
    rows, width = ids.shape
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    n, groups = slots.shape[0], H // KV
    h = decoder.embed_tokens(ids.reshape(-1)[slots][None])  # [1, N, H]
    cos, sin = decoder.rotary_emb(h, positions.reshape(-1)[slots][None])  # [1, N, D]
    cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, D]: per token, broadcast over heads
    kept = []
    keys = width + (past[0][0].shape[2] if past else 0)
    # matmul attention's additive bias, once a pass: [G * W, K] causal, or the caller's mask per row
    # and key-value head [R * KV, G * W, K]; causal without past: one per half of the queries
    # (causal_halves_attention, which a tuple of biases selects)
    bias = None
    if matmul_attention_:
        split = causal_split(width) if mask is None and past is None else 0
        bias = (causal_half_biases(rows, width, split, KV, groups, h.dtype, h.device) if split
                else attention_bias(mask, rows, width, keys, KV, groups, h.dtype, h.device))
    for i, layer in enumerate(decoder.layers[:cfg.num_hidden_layers]):  # as transformers' loop
        attn = layer.self_attn
        x = rms_norm(layer.input_layernorm, h)
        q = rope(attn.q_proj(x).view(n, H, D), cos, sin)
        k = rope(attn.k_proj(x).view(n, KV, D), cos, sin)
        v = attn.v_proj(x).view(n, KV, D)
        q, k, v = (_to_grid(t, slots, rows, width, full_grid) for t in (q, k, v))  # [R, heads, W, D]
        if past is not None:
            pk, pv = past[i]
            k = torch.cat([pk.expand(rows, -1, -1, -1), k], 2)
            v = torch.cat([pv.expand(rows, -1, -1, -1), v], 2)
        if keep_kv:
            kept.append((k, v))
        if isinstance(bias, tuple):
            out = causal_halves_attention(q, k, v, bias, attn.scaling)
        elif bias is not None:
            out = matmul_attention(q, k, v, bias, attn.scaling)
        else:
            out = sdpa_grouped(q, k, v, mask, attn.scaling)
        out = out.transpose(1, 2).reshape(rows * width, H * D)
        if not full_grid:
            # index_select, not out[slots]: the same rows, but its backward is an index_add where advanced
            # indexing's is an accumulating index_put (it sorts the indices): 0.15 against 0.77 ms a layer
            # for a 390-token DPO pass on a 2-core Xeon
            out = out.index_select(0, slots)  # [N, H * D]
        h = h + attn.o_proj(out[None])
        h = h + layer.mlp(rms_norm(layer.post_attention_layernorm, h))
    return rms_norm(decoder.norm, h)[0], kept


def sdpa_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """SDPA over grouped-query heads: q [R, H, W, D], k / v [R | 1, KV, K, D], key-value head j serving query
    heads j * G ... j * G + G - 1 (transformers' repeat_kv); mask the additive [R | 1, 1, W, K] mask or None
    for causal. Where the kernel takes the groups itself (enable_gqa), the [R, H, K, D] copies of k and v
    and their gradients' sum are not made: forward + backward of a 390-token DPO pass's layer (SmolLM2,
    fp32, masked, 2-core Xeon) 3.5 against 4.0 ms, output bit for bit the same."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and _SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def attention_bias(mask: torch.Tensor | None, rows: int, width: int, keys: int, kv_heads: int, groups: int,
                   dtype: torch.dtype, device=None) -> torch.Tensor:
    """matmul_attention's additive bias: 0 where a query may attend, dtype's lowest value elsewhere (as
    transformers' masks: finite, so a query that may attend nothing gets uniform weights, not NaN).
    mask None -> causal [groups * width, keys] (query i sees keys up to keys - width + i); an additive
    [R | 1, 1, width, keys] mask -> [rows * kv_heads, groups * width, keys], one copy per key-value head
    and query head of its group (once a pass, not a layer)."""
    if mask is None:
        allowed = torch.ones(width, keys, dtype=torch.bool, device=device).tril_(keys - width)
        bias = torch.zeros(width, keys, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return bias.repeat(groups, 1)
    mask = mask.to(dtype).clamp(min=torch.finfo(dtype).min)  # a -inf would turn a fully masked query into NaN
    return mask[:, :, None].expand(rows, kv_heads, groups, width, keys).reshape(rows * kv_heads, groups * width, keys)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale * q k^T + bias) v with grouped-query heads: q [R, H, W, D]; k, v [R, KV, K, D], key-value
    head j serving query heads j * G ... j * G + G - 1 (G = H / KV), as transformers' repeat_kv pairs them,
    but never copied per query head: the G heads' queries of a group are stacked into one [G * W, D]
    operand of one batched product. bias [G * W, K] or [R * KV, G * W, K] (attention_bias). The
    softmax runs in the inputs' dtype (in bf16, CPU kernels compute it in float32 and round the
    probabilities, which the product with v would round anyway). -> [R, H, W, D]"""
    rows, heads, width, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scores = torch.baddbmm(bias, q.reshape(rows * kv_heads, groups * width, dim),
                           k.reshape(rows * kv_heads, keys, dim).transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, -1), v.reshape(rows * kv_heads, keys, dim))
    return out.view(rows, heads, width, dim)


def causal_split(width: int) -> int:
    """Where causal_halves_attention splits `width` queries (0: not worth splitting, one product)."""
    return width // 2 if width >= CAUSAL_SPLIT_MIN_WIDTH else 0


def causal_half_biases(rows: int, width: int, split: int, kv_heads: int, groups: int, dtype: torch.dtype,
                       device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_halves_attention's two causal biases: queries [0, split) over keys [0, split), queries [split,
    width) over every key."""
    return (attention_bias(None, rows, split, split, kv_heads, groups, dtype, device),
            attention_bias(None, rows, width - split, width, kv_heads, groups, dtype, device))


def causal_halves_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            biases: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """matmul_attention under a causal mask without a past, with the first half of the queries against the
    first half of the keys only: a query never sees a later key, so the product of the first half of the
    queries with the second half of the keys is all masked. Skipping it saves a quarter of the products'
    work, of the softmax's and of the probabilities backward keeps. Same values as one causal product (a
    masked score's weight is exactly 0 either way; tested). q [R, H, W, D], k / v [R, KV, W, D] ->
    [R, H, W, D]. biases: causal_half_biases."""
    split = biases[0].shape[-1]
    first = matmul_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], biases[0], scale)
    second = matmul_attention(q[:, :, split:], k, v, biases[1], scale)
    return torch.cat([first, second], 2)


def _to_grid(t: torch.Tensor, slots: torch.Tensor, rows: int, width: int, full_grid: bool) -> torch.Tensor:
    """[N, heads, D] real tokens -> [rows, heads, width, D], zeros at padding (differentiable). A full grid
    (SFT's full rows; see _layers) is a view of t: no zeros, no scatter, no gather in backward."""
    if full_grid:
        return t.view(rows, width, t.shape[1], t.shape[2]).transpose(1, 2)
    grid = t.new_zeros(rows * width, t.shape[1], t.shape[2]).index_copy(0, slots, t)
    return grid.view(rows, width, t.shape[1], t.shape[2]).transpose(1, 2)


def grid_slots(real: torch.Tensor) -> torch.Tensor:
    """[R, W] bool (where a real token is) -> [N] flat indices r * W + column, row by row."""
    return torch.nonzero(real.reshape(-1)).flatten()


def packed_index(slots: torch.Tensor, cells: int) -> torch.Tensor:
    """[cells] each grid cell's index among the N real tokens: grid index -> packed index. A padding cell
    maps to N, one past the last real token, so that reading the state of a padding cell through it is an
    IndexError (a layout bug made loud) instead of a silent read of the last token, as -1 would be."""
    n = slots.shape[0]
    index = torch.full((cells,), n, dtype=torch.long, device=slots.device)
    return index.index_copy_(0, slots, torch.arange(n, device=slots.device))


def scatter_rows(hidden: torch.Tensor, slots: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[N, H] -> [rows, width, H], zeros at padding: the shape the model's own forward returns."""
    return hidden.new_zeros(rows * width, hidden.shape[-1]).index_copy(0, slots, hidden).view(rows, width, -1)
