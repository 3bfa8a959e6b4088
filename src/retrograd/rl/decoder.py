"""The sampler's decode engines: how a batch of prompts is prefilled and stepped one token at a time.

`LlamaDecoder` is the fast path for Llama-family models (llama, mistral, qwen2 without sliding
windows) on CPU. It reads the live model's tensors and runs the same arithmetic as transformers'
forward (tested to 1e-5 against it), without the generic machinery around it:

  * the frozen base projections are prepared once into matmul-ready copies: q/k/v stacked into one
    matrix and gate/up into another, the RMSNorm weight before them and attention's 1/sqrt(D) folded
    in, cast to the sampling dtype and reordered into oneDNN's blocked layout (at batch 16 a decode
    step's matmuls run 1.6-2.8x faster from it than from a row-major weight). A copy is remade only
    when a source tensor changes (a full fine-tune's optimizer step), and models that share a frozen
    base share it; the copies of an FSDP2 model's gathered weights are dropped after each use
    (`forget`, called by sampler.whole_weights: the next gathering refills the same tensor objects and
    keeps their version, and their storage may come back at the same address, so a kept copy could not
    be told stale);
  * LoRA runs beside the base matmul on the live adapter tensors, in float32 (all adapters of a
    projection as one down- and one block-diagonal up-projection), so nothing is folded per update
    and, with bf16 weights, a small adapter update is not lost in the weights' rounding;
  * the residual stream, norms, attention and the KV cache stay float32; the cache is preallocated
    (the generic one concatenates every step) and grouped-query attention reads it without expanding
    keys and values; rows that finished leave the batch.

`HFDecoder` is the generic path for every other model or device: transformers' own forward and cache.

Both expose `prefill(ids, attention, positions, group_size, max_new_tokens, prefix=None) -> logits`
(one row per completion; a group shares its prompt's prefill, and all prompts the `prefix` tokens they
start with, run once: `ids` are then what follows it, at positions counted after it),
`step(tokens) -> logits` and `keep(rows)` (drop finished rows from the batch). Logits are float32.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from retrograd.models.packed import sdpa_grouped

SUPPORTED = {"llama", "mistral", "qwen2"}
_PREPARED: dict[int, dict] = {}  # id(first source tensor) -> {slot: (versions, kind, tensor)}; see _prepared


class Unsupported(Exception):
    """The fast path cannot run this model exactly; the generic one is used."""


class _Proj:
    """One or several projections of the same input (q/k/v, gate/up, or one alone) as one matmul:
    x [..., in] -> [..., sum of outs] in float32 (or `dtype` with raw=True). Folded into the prepared
    weight: the RMSNorm weight in front of it (`norm`) and a scalar per part (attention's 1/sqrt(D)
    on q). Biases and LoRA terms are added in float32 from the live tensors: all adapters of all parts
    as one [R, in] down-projection and one block-diagonal [R, out] up-projection."""

    def __init__(self, parts: list[tuple], dtype: torch.dtype, norm: torch.Tensor | None = None,
                 scales: list[float] | None = None):
        scales = scales or [1.0] * len(parts)
        self.kind, self.weight = _prepared([w for w, _, _ in parts], scales, norm, dtype)
        self.out = sum(w.shape[0] for w, _, _ in parts)
        biases = [b for _, b, _ in parts]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([(b.detach().float() if b is not None else torch.zeros(w.shape[0], device=w.device)) * sc
                                   for (w, b, _), sc in zip(parts, scales)])
        downs, ups, offset = [], [], 0
        for (w, _, loras), sc in zip(parts, scales):
            for a, b, s in loras:
                downs.append(a.detach().float() * norm.float() if norm is not None else a.detach().float())
                ups.append((offset, b.detach().float() * (s * sc)))
            offset += w.shape[0]
        self.lora = None
        if downs:
            down = torch.cat(downs)
            up = torch.zeros(down.shape[0], self.out, device=down.device)
            r = 0
            for (start, b), a in zip(ups, downs):
                up[r:r + a.shape[0], start:start + b.shape[0]] = b.t()
                r += a.shape[0]
            self.lora = (down, up)

    def __call__(self, x: torch.Tensor, raw: bool = False) -> torch.Tensor:
        xin = x.to(self.weight.dtype)
        if self.kind == "packed":
            y = torch.ops.mkldnn._linear_pointwise(xin, self.weight, None, "none", [], "")
        else:
            y = F.linear(xin, self.weight)
        if raw and self.bias is None and self.lora is None:
            return y
        y = y.float()
        if self.bias is not None:
            y += self.bias
        if self.lora is not None:
            down, up = self.lora
            x2 = x.float().reshape(-1, x.shape[-1])
            y.view(-1, self.out).addmm_(F.linear(x2, down), up)
        return y


def _prepared(weights: list[torch.Tensor], scales: list[float], norm: torch.Tensor | None,
              dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    """The base weight as the decoder multiplies it: the parts stacked, each times its scale, times the
    norm weight along the input, cast to `dtype`, and on CPU reordered into oneDNN's blocked layout,
    which a decode step's skinny matmuls read 1.6-2.8x faster than a plain row-major weight
    (SmolLM2's shapes at batch 16). Made once and reused while every source tensor is unchanged
    (same object, storage and version: a full fine-tune's optimizer step bumps the version and the copy is
    remade). Keyed by the first tensor, so models sharing a frozen base (the service's runs) share it."""
    first = weights[0]
    sources = weights + ([norm] if norm is not None else [])
    slot = (dtype, tuple(id(w) for w in sources), tuple(scales))
    versions = tuple((w.data_ptr(), w._version) for w in sources)
    entries = _PREPARED.get(id(first))
    if entries is None:  # dropped with the tensor it belongs to (a WeakKeyDictionary would compare tensors)
        entries = _PREPARED[id(first)] = {}
        weakref.finalize(first, _PREPARED.pop, id(first), None)
    hit = entries.get(slot)
    if hit is not None and hit[0] == versions:
        return hit[1], hit[2]
    entries.pop(slot, None)  # free the stale copy before making the new one
    with torch.no_grad():
        fused = torch.cat([w.detach().float() * sc for w, sc in zip(weights, scales)])
        if norm is not None:
            fused = fused * norm.detach().float()
        fused = fused.to(dtype).contiguous()
        kind, tensor = "fused", fused
        if fused.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                kind, tensor = "packed", torch.ops.mkldnn._reorder_linear_weight(fused, 16)
            except (RuntimeError, AttributeError):  # a build without this oneDNN op: plain matmuls
                pass
    entries[slot] = (versions, kind, tensor)
    return kind, tensor


def forget(tensors) -> None:
    """Drop the prepared copies made from `tensors` (the next _prepared remakes them). For tensors whose
    contents change without a new version: an FSDP2 model's gathered weights, the same objects refilled
    by the next all-gather (sampler.whole_weights). Each tensor's table stays, emptied, so its finalizer
    is not registered once more per use."""
    for t in tensors:
        entries = _PREPARED.get(id(t))
        if entries:
            entries.clear()


def _linear_parts(module) -> tuple:
    """(weight, bias, [(lora_A, lora_B, scale), ...]) of a plain or PEFT-LoRA linear layer."""
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias, []
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "lora_A") or getattr(module, "merged", False):
        raise Unsupported(f"{type(module).__name__} layer")
    loras = []
    if not module.disable_adapters:
        for name in module.active_adapters:
            if name not in module.lora_A:
                continue
            if module.use_dora.get(name) or module.lora_B[name].bias is not None:
                raise Unsupported("DoRA or LoRA bias")
            loras.append((module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])))
    return base.weight, base.bias, loras


def _check_config(cfg) -> None:
    if getattr(cfg, "model_type", None) not in SUPPORTED:
        raise Unsupported(f"model type {getattr(cfg, 'model_type', None)}")
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        raise Unsupported("activation or tensor-parallel layout")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise Unsupported("sliding-window attention")
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        raise Unsupported("sliding-window attention")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        raise Unsupported("dynamic RoPE")


def _base_model(model):
    """The transformers *ForCausalLM under an optional PEFT wrapper."""
    inner = model
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    if not hasattr(inner, "model") or not hasattr(inner.model, "layers"):
        raise Unsupported(type(inner).__name__)
    return inner


class LlamaDecoder:
    def __init__(self, model, dtype: torch.dtype = torch.float32):
        lm = _base_model(model)
        if lm.model.embed_tokens.weight.device.type != "cpu":
            raise Unsupported("not on CPU")  # its gains are CPU matmul layouts; GPUs take the generic path
        cfg = lm.config
        _check_config(cfg)
        core = lm.model
        if type(core.embed_tokens) is not torch.nn.Embedding:
            raise Unsupported("adapted embeddings")
        self.embed = core.embed_tokens.weight
        self.rotary = core.rotary_emb
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.intermediate = cfg.intermediate_size
        q_scale = [self.head_dim ** -0.5, 1.0, 1.0]  # attention's scale, folded into q (RoPE is linear)
        self.layers = []
        for layer in core.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                _Proj([_linear_parts(a.q_proj), _linear_parts(a.k_proj), _linear_parts(a.v_proj)], dtype,
                      layer.input_layernorm.weight, q_scale),
                _Proj([_linear_parts(a.o_proj)], dtype),
                _Proj([_linear_parts(m.gate_proj), _linear_parts(m.up_proj)], dtype, layer.post_attention_layernorm.weight),
                _Proj([_linear_parts(m.down_proj)], dtype)))
        self.head = _Proj([_linear_parts(lm.get_output_embeddings())], dtype, core.norm.weight)

    # ---- pieces shared by prefill and step ---------------------------------------------------------
    def _normed(self, h):  # RMSNorm without its weight (folded into the next projection)
        return F.rms_norm(h, (h.shape[-1],), eps=self.eps)

    def _rope(self, x, cos, sin_signed):
        """x [..., D] rotated: x cos + rotate_half(x) sin, rotate_half(x) = roll(x, D/2) * [-1.., +1..]."""
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, -1), sin_signed)

    def _mlp(self, h, gu, down):
        y = gu(self._normed(h), raw=True)
        return h + down(F.silu(y[..., :self.intermediate]) * y[..., self.intermediate:])

    def _attend_pass(self, ids, positions, mask, past: list | None) -> tuple[torch.Tensor, list]:
        """Run tokens ids [n, W] (at `positions`) through every layer with boolean `mask` [n|1, 1, W, P + W]
        over the P `past` keys/values (per layer, [1, KV, P, D]) and their own. -> (hidden [n, W, H],
        per layer the (keys, values) [n, KV, W, D] of these tokens, after RoPE)."""
        n, width = ids.shape
        D, H, KV = self.head_dim, self.heads, self.kv_heads
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [n, W, 1, D]
        h = self.embed[ids].float()
        kv = []
        for i, (qkv, o, gu, down) in enumerate(self.layers):
            y = qkv(self._normed(h)).view(n, width, H + 2 * KV, D)
            qk = self._rope(y[:, :, :H + KV], cos, sin)
            q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), y[:, :, H + KV:].transpose(1, 2)
            kv.append((k, v))
            if past:
                k = torch.cat([past[i][0].expand(n, -1, -1, -1), k], 2)
                v = torch.cat([past[i][1].expand(n, -1, -1, -1), v], 2)
            att = sdpa_grouped(q, k, v, mask, 1.0)
            h = h + o(att.transpose(1, 2).reshape(n, width, H * D))
            h = self._mlp(h, gu, down)
        return h, kv

    # ---- the decoder interface -------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids, attention, positions, group_size: int, max_new_tokens: int,
                prefix: torch.Tensor | None = None) -> torch.Tensor:
        n, width = ids.shape
        c = 0 if prefix is None else prefix.shape[0]
        dev, D, KV = ids.device, self.head_dim, self.kv_heads
        self.capacity = c + width + max_new_tokens
        table = torch.arange(int(positions.max()) + max_new_tokens + 1, device=dev)[None]
        cos, sin = (t[0].float() for t in self.rotary(self.embed[:1].float(), table))  # [positions, D]
        sign = torch.cat([-torch.ones(D // 2, device=dev), torch.ones(D - D // 2, device=dev)])
        self.cos, self.sin = cos, sin * sign
        batch = n * group_size
        self.k_cache = [torch.empty(batch, KV, self.capacity, D, device=dev) for _ in self.layers]
        self.v_cache = [torch.empty(batch, KV, self.capacity, D, device=dev) for _ in self.layers]
        past = None
        if c:  # the prompts' common prefix, once, causal; every row's cache starts with it
            causal = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
            _, past = self._attend_pass(prefix[None], torch.arange(c, device=dev)[None], causal, None)
            for i, (k, v) in enumerate(past):
                self.k_cache[i][:, :, :c] = k
                self.v_cache[i][:, :, :c] = v
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        # a pad query sees itself only, so no row is fully masked (NaN) and pads never reach a real token
        mask = (causal & attention.bool()[:, None, None, :]) | torch.eye(width, dtype=torch.bool, device=dev)
        if c:
            mask = torch.cat([torch.ones(n, 1, width, c, dtype=torch.bool, device=dev), mask], -1)
        h, kv = self._attend_pass(ids, positions, mask, past)
        for i, (k, v) in enumerate(kv):
            self.k_cache[i][:, :, c:c + width] = k.repeat_interleave(group_size, 0)
            self.v_cache[i][:, :, c:c + width] = v.repeat_interleave(group_size, 0)
        self.length = c + width
        # additive key mask, one row per (completion, kv head): -inf on left padding
        pad = torch.where(attention.bool(), 0.0, float("-inf")).repeat_interleave(group_size, 0)
        self.key_bias = torch.zeros(batch, KV, 1, self.capacity, device=dev)
        self.key_bias[:, :, 0, c:c + width] = pad[:, None]
        self.next_pos = positions[:, -1].repeat_interleave(group_size, 0) + 1
        return self.head(self._normed(h[:, -1])).repeat_interleave(group_size, 0)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        b, D, H, KV, t = tokens.shape[0], self.head_dim, self.heads, self.kv_heads, self.length
        g = H // KV
        cos, sin = self.cos[self.next_pos][:, None], self.sin[self.next_pos][:, None]  # [B, 1, D]
        bias = self.key_bias[:, :, :, :t + 1].reshape(b * KV, 1, t + 1)
        h = self.embed[tokens].float()
        for i, (qkv, o, gu, down) in enumerate(self.layers):
            y = qkv(self._normed(h)).view(b, H + 2 * KV, D)
            qk = self._rope(y[:, :H + KV], cos, sin)
            self.k_cache[i][:, :, t] = qk[:, H:]
            self.v_cache[i][:, :, t] = y[:, H + KV:]
            keys = self.k_cache[i][:, :, :t + 1].reshape(b * KV, t + 1, D)
            values = self.v_cache[i][:, :, :t + 1].reshape(b * KV, t + 1, D)
            q = qk[:, :H].reshape(b * KV, g, D)  # grouped by the kv head it reads
            att = torch.softmax(torch.baddbmm(bias, q, keys.transpose(1, 2)), -1) @ values  # [B*KV, g, D]
            h = h + o(att.view(b, H * D))
            h = self._mlp(h, gu, down)
        self.length, self.next_pos = t + 1, self.next_pos + 1
        return self.head(self._normed(h))

    def keep(self, rows: torch.Tensor) -> None:
        self.k_cache = [c[rows] for c in self.k_cache]
        self.v_cache = [c[rows] for c in self.v_cache]
        self.key_bias, self.next_pos = self.key_bias[rows], self.next_pos[rows]


class HFDecoder:
    """Any causal LM through transformers' forward and cache."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def prefill(self, ids, attention, positions, group_size: int, max_new_tokens: int,
                prefix: torch.Tensor | None = None) -> torch.Tensor:
        cache = None
        if prefix is not None:  # the common prefix once, its cache repeated per prompt
            c = prefix.shape[0]
            cache = self.model(input_ids=prefix[None], position_ids=torch.arange(c, device=prefix.device)[None],
                               use_cache=True, logits_to_keep=1).past_key_values
            cache.batch_repeat_interleave(ids.shape[0])
            attention = torch.cat([torch.ones(ids.shape[0], c, dtype=attention.dtype, device=attention.device),
                                   attention], 1)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.cache.batch_repeat_interleave(group_size)
        self.attention = attention.repeat_interleave(group_size, 0)
        self.next_pos = positions[:, -1:].repeat_interleave(group_size, 0) + 1
        return out.logits[:, -1].float().repeat_interleave(group_size, 0)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        ones = torch.ones((tokens.shape[0], 1), dtype=self.attention.dtype, device=self.attention.device)
        self.attention = torch.cat([self.attention, ones], 1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attention, position_ids=self.next_pos,
                         past_key_values=self.cache, use_cache=True)
        self.cache, self.next_pos = out.past_key_values, self.next_pos + 1
        return out.logits[:, -1].float()

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attention, self.next_pos = self.attention[rows], self.next_pos[rows]
