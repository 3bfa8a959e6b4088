"""A Llama decoder's forward on the real tokens of a padded batch only: no layer computes a padding position.

transformers' forward runs every position of a [R, W] batch through every projection, MLP and norm,
padding included. In a scoring pass the padding is what the layout could not avoid: a GRPO update's
prompt-led rows are as wide as its longest group (on the benchmark's update, 584 positions for 511
tokens: 12.5 % of the pass's matmuls computed on nothing), and SFT passes of rows of different lengths
are right-padded to the longest row. Here the token-wise work (embedding, RMSNorms, q/k/v/o, the MLP,
the residual adds, the final norm) runs on the N real tokens as one [1, N, H] batch, and only attention
sees the padded grid: each layer scatters its queries, keys and values into [R, W] (zeros at padding),
runs the same SDPA kernel with the caller's mask, and gathers the real positions back. The modules are
the model's own (PEFT's LoRA layers, the lean MLP, the RMSNorms, the rotary embedding), called on a
different leading shape, so LoRA, its dropout and the gradients are unchanged; attention's maths is
transformers' (RoPE, grouped-query keys repeated per head, the same scale), and a padded key is always
masked, so a real token's values are those of the plain forward up to float rounding (tested, values
and gradients, against transformers' forward).

`PackedForward(decoder).supported()` says whether it applies now: a plain Llama (`llama`), SDPA as
the attention (short bf16 passes switch to eager: device.attention_for_length), no attention dropout,
no gradient checkpointing. Otherwise the caller uses the model's own forward.

  run(ids, positions, real, mask=None, past=None, keep_kv=False)
      ids / positions / real [R, W]: the padded grid, its positions and where a real token is; mask:
      the additive [R | 1, 1, W, P + W] mask over `past` keys and the grid's own (None: causal, for
      rows whose padding all follows their tokens); past: per layer (keys, values) [R | 1, KV, P, D]
      every row attends to before its own (a cached prefix or prompt). -> (final hidden states
      [N, H] of the real tokens, row by row, after the last norm; slots [N]: each one's flat index
      r * W + column in the grid; with keep_kv per layer the (keys, values) [R, KV, P + W, D] the
      rows attended to, past included, after RoPE, zeros at padding)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_MODELS = ("llama",)


class PackedForward:
    def __init__(self, decoder):
        self.decoder = decoder
        cfg = decoder.config
        self.config = cfg
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shaped = (getattr(cfg, "model_type", None) in PACKED_MODELS
                       and all(hasattr(decoder, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))
                       and not float(getattr(cfg, "attention_dropout", 0.0) or 0.0))

    def supported(self) -> bool:
        """Whether a pass can run packed now (the attention implementation and checkpointing can change
        between passes)."""
        return (self.shaped and getattr(self.config, "_attn_implementation", None) == "sdpa"
                and not (self.decoder.training and getattr(self.decoder, "gradient_checkpointing", False)))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, mask: torch.Tensor | None = None,
            past: list | None = None, keep_kv: bool = False):
        rows, width = ids.shape
        slots = grid_slots(real)
        n, D, H, KV = slots.shape[0], self.head_dim, self.heads, self.kv_heads
        h = self.decoder.embed_tokens(ids.reshape(-1)[slots][None])  # [1, N, H]
        cos, sin = self.decoder.rotary_emb(h, positions.reshape(-1)[slots][None])  # [1, N, D]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, D]: per token, broadcast over heads
        kept = []
        for i, layer in enumerate(self.decoder.layers[:self.config.num_hidden_layers]):  # as transformers' loop
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = _rope(attn.q_proj(x).view(n, H, D), cos, sin)
            k = _rope(attn.k_proj(x).view(n, KV, D), cos, sin)
            v = attn.v_proj(x).view(n, KV, D)
            q, k, v = (_to_grid(t, slots, rows, width) for t in (q, k, v))  # [R, heads, W, D]
            if past is not None:
                pk, pv = past[i]
                k = torch.cat([pk.expand(rows, -1, -1, -1), k], 2)
                v = torch.cat([pv.expand(rows, -1, -1, -1), v], 2)
            if keep_kv:
                kept.append((k, v))
            groups = H // KV
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                 attn_mask=mask, is_causal=mask is None, scale=attn.scaling)
            out = out.transpose(1, 2).reshape(rows * width, H * D)[slots]  # [N, H * D]
            h = h + attn.o_proj(out[None])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.decoder.norm(h)[0], slots, kept


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on token-major x [N, heads, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _to_grid(t: torch.Tensor, slots: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[N, heads, D] real tokens -> [rows, heads, width, D], zeros at padding (differentiable)."""
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
