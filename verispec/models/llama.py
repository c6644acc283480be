"""A native decoder for the Llama family: Llama, Qwen2/Qwen2.5 and SmolLM2.

RMSNorm, rotary embeddings (rotate-half form, as the Hugging Face checkpoints store q/k),
grouped-query attention through ``scaled_dot_product_attention`` and a SwiGLU MLP. The
q/k/v and gate/up projections are fused into one matmul each: fewer, larger kernels per
token, which matters when a decode step is a few hundred small launches.

One entry point serves prefill (m = prompt length), decode (m = 1) and verification
(m = k + 1): ``forward(tokens, positions, cache)`` writes the new K/V at the given
positions and attends over everything up to them.

On CPUs that run :mod:`verispec.kernels` (models built with ``kernels="auto"``), decode and
verification steps (m <= SMALL_M, eager, fp32/bf16) run fused ops instead of the modules' Python
forwards: RMSNorm, residual add + next RMSNorm, RoPE + K/V cache write + attention and silu * up
are one call each (a step of a small model is otherwise a few hundred tiny aten ops). Longer
forwards (prefill) keep the modules' projections (whose large-M path expands the weights for
oneDNN) and run the same fused norms, residual adds, silu * up and attention between them (the
fused attention is 4-5x faster than SDPA's CPU flash kernel on a causal prefill here). The Python
path below stays the reference and the fallback (torch.compile, other devices, models built with
kernels="stock", head sizes the fused attention does not take).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels as fast_kernels
from verispec.models.args import ModelArgs
from verispec.models.kv_cache import KVCache
from verispec.models.linear import (
    DenseLinear,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    QuantizedTensor,
    WeightScratch,
    make_linear,
    small_m_call,
)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do, then return to x's dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, theta: float, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# Up to this many new tokens per row, attention runs as two batched matmuls (decode and
# verification); longer blocks (prefill) go to scaled_dot_product_attention. On a CPU the fused
# kernel is slow for a handful of queries (one query over 2000 keys: ~8x the matmul form).
SMALL_M = 32


def tree_depths(ancestors: torch.Tensor) -> torch.Tensor:
    """Each token tree node's depth below its row's first new token: the bits set in its ancestor mask, less one."""
    bits = torch.arange(SMALL_M + 1, device=ancestors.device)
    return ((ancestors[..., None] >> bits) & 1).sum(-1) - 1


def small_m_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of a few queries: ``q`` [B, H, m, D], ``k``/``v`` [B, KV, L, D].

    The query heads sharing a KV head are stacked along the query axis, so K and V are read once
    per KV head and never repeated. ``mask_bias`` [B, 1, m, L] is 0 where attending is allowed
    and -inf elsewhere; softmax runs in fp32.
    """
    b, h, m, d = q.shape
    kv = k.shape[1]
    scores = torch.matmul(q.reshape(b, kv, h // kv * m, d), k.transpose(-1, -2)).float()
    scores = scores.view(b, kv, h // kv, m, -1).mul_(d ** -0.5).add_(mask_bias[:, :, None])
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kv, h // kv * m, -1)
    return torch.matmul(probs, v).view(b, h, m, d)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, wqkv: nn.Module, wo: nn.Module) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv, self.wo = wqkv, wo

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write: tuple[torch.Tensor, torch.Tensor], kv_len: int,
                mask: torch.Tensor) -> torch.Tensor:
        b, m, _ = x.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.wqkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = apply_rope(q.view(b, m, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, m, nkv, hd).transpose(1, 2), cos, sin)
        # Advanced indexing puts the (row, position) axes first: [B, m, KV, D] on both sides.
        k_cache[write[0], :, write[1]] = k.transpose(1, 2)
        v_cache[write[0], :, write[1]] = v.view(b, m, nkv, hd)
        keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
        if m <= SMALL_M:
            out = small_m_attention(q, keys, values, mask)
        elif mask.dtype == torch.bool:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=nkv != nh)
        else:  # an empty mask: a prefill from position 0, causal in SDPA's own (faster) form
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=nkv != nh)
        return self.wo(out.transpose(1, 2).reshape(b, m, nh * hd))


class MLP(nn.Module):
    def __init__(self, w_gate_up: nn.Module, w_down: nn.Module) -> None:
        super().__init__()
        self.w_gate_up, self.w_down = w_gate_up, w_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attn_norm: RMSNorm, attn: Attention, mlp_norm: RMSNorm, mlp: MLP) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), *attn_args)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """The decoder. Build it with :meth:`from_state_dict` (Hugging Face parameter names)."""

    def __init__(self, args: ModelArgs, embed: torch.Tensor, layers: list[Block], norm: RMSNorm,
                 lm_head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.args, self.dtype = args, dtype
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(layers)
        self.norm, self.lm_head = norm, lm_head
        cos, sin = rope_tables(args.head_dim, args.rope_theta, args.max_position_embeddings, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Decode/verification steps through verispec.kernels' fused small ops (see _use_fused);
        # from_state_dict sets it when built with kernels="auto" on a CPU that runs them.
        self.fused_ops = False
        # Why its int4/int8 layers multiply the activations they do (verispec.engine.kernel_choice; set at load).
        self.activation_reason = ""

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A KV cache sized for this model (``max_len`` positions per row)."""
        a = self.args
        return KVCache(a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                rows: slice = slice(None), last_only: bool = False, n_layers: int | None = None,
                head: nn.Module | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``tokens`` ``[B, m]`` at ``positions`` ``[B, m]``; return fp32 logits ``[B, m, vocab]``.

        ``rows`` selects the cache rows these B sequences occupy; ``kv_len`` bounds the keys
        attended to (at least ``positions.max() + 1``; computed when omitted). ``last_only``
        returns logits for the last position only (prefill). ``n_layers`` exits early after
        that many layers (self-speculative drafting). ``head`` replaces ``lm_head`` for this call
        (a drafter's reduced vocabulary head; the model itself, maybe shared, is left as it is).

        ``tree`` (int64 ``[B, m]``, m <= SMALL_M) makes each row's tokens a token tree: token i's bit
        mask of the tokens on its root path, itself included (bit i and only bits below it; token 0
        is the root). The tokens take the consecutive cache slots ``positions[b, 0] + i``, sit at
        rotary position ``positions[b, 0] + depth`` and attend to the keys before their row's first
        slot and to their own root path. Without it, token i is at position and slot
        ``positions[b, i]`` and attends causally by position.
        """
        b, m = tokens.shape
        if positions.shape != tokens.shape:  # else the rope tables and the K/V writes disagree with the tokens
            raise ValueError(f"positions {tuple(positions.shape)} must have the tokens' shape {(b, m)}")
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        rope_pos = positions
        if tree is not None:
            if tree.shape != tokens.shape or m > SMALL_M:
                raise ValueError(f"a token tree needs ancestors of the tokens' shape {(b, m)} and at most "
                                 f"{SMALL_M} tokens per row")
            rope_pos = positions[:, :1] + tree_depths(tree)
        x = self.embed(tokens)
        if self._use_fused(x, cache):
            return self._forward_fused(x, positions, rope_pos, tree, cache, kv_len, rows, last_only, n_layers, head)
        if self._use_fused_elementwise(x):
            return self._forward_prefill(x, positions, cache, kv_len, rows, last_only, n_layers, head)
        cos = self.rope_cos[rope_pos].unsqueeze(1)
        sin = self.rope_sin[rope_pos].unsqueeze(1)
        a = self.args
        write = (torch.arange(b, device=tokens.device)[:, None].expand(b, m), positions)
        mask = self._mask(positions, kv_len, tree)
        whole = rows == slice(None)  # no view of the cache: a compiled forward writes into it in place
        for i, layer in enumerate(self.layers[: n_layers or a.n_layers]):
            k, v = (cache.k[i], cache.v[i]) if whole else (cache.k[i][rows], cache.v[i][rows])
            x = layer(x, cos, sin, k, v, write, kv_len, mask)
        if last_only:
            x = x[:, -1:]
        return (head or self.lm_head)(self.norm(x)).float()

    def _use_fused(self, x: torch.Tensor, cache: KVCache) -> bool:
        """Whether this forward runs :mod:`verispec.kernels`' fused small ops (decode/verification on a CPU)."""
        return x.shape[1] <= SMALL_M and self._fused_attention(x, cache)

    def _fused_attention(self, x: torch.Tensor, cache: KVCache) -> bool:
        """Whether :func:`verispec.kernels.attend` takes this forward's attention (any number of tokens)."""
        return (self.fused_ops and not torch.compiler.is_compiling() and x.device.type == "cpu"
                and fast_kernels.attend_applies(self.args.head_dim, x.dtype)
                and cache.k[0].dtype == x.dtype and cache.k[0].device.type == "cpu")

    def _use_fused_elementwise(self, x: torch.Tensor) -> bool:
        """Whether a forward of more than SMALL_M tokens per row (a prefill) runs :meth:`_forward_prefill`:
        its RMSNorms, residual adds and silu * up through the fused row-wise ops. Those are
        parallel over rows and replace ~8 aten ops per norm (~0.25 s of a 900-token prefill of a 1.5B
        model). Only above SMALL_M: a decode or verification step that falls back to the Python path
        (e.g. a head size the fused attention does not take) keeps exactly the ops it has always run."""
        return (self.fused_ops and not torch.compiler.is_compiling() and x.shape[1] > SMALL_M
                and x.device.type == "cpu" and x.dtype in fast_kernels.small_ops_dtypes())

    def _forward_prefill(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int, rows: slice,
                         last_only: bool, n_layers: int | None, head: nn.Module | None) -> torch.Tensor:
        """:meth:`forward` for more than SMALL_M tokens per row (a prefill) with the fused ops, chained as in
        :meth:`_forward_fused`: norm -> attention -> add + norm -> gate/up -> silu * up -> down -> add + the
        next norm (the final norm after the last layer). The projections get [B, m, .] inputs, so they see
        the tokens per row (see verispec.models.linear.large_m). Attention is :func:`verispec.kernels.attend`
        where it applies (4-5x faster than SDPA's CPU flash kernel on a causal prefill of a few hundred
        tokens here, see docs/quantization.md); else the modules' own attention (SDPA)."""
        b, m, dim = x.shape
        res = x.reshape(b * m, dim)  # the residual stream (a fresh embedding lookup), updated in place
        layers = self.layers[: n_layers or self.args.n_layers]
        whole = rows == slice(None)
        kv_len = int(kv_len)
        if self._fused_attention(x, cache):
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]

            def attention(attn: Attention, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                o = fast_kernels.attend(attn.wqkv(h), cos, sin, positions, k, v, kv_len, attn.n_heads, attn.n_kv_heads)
                return attn.wo(o)
        else:
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
            write = (torch.arange(b, device=x.device)[:, None].expand(b, m), positions)
            mask = self._mask(positions, kv_len)

            def attention(attn: Attention, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return attn(h, cos, sin, k, v, write, kv_len, mask)
        first = layers[0].attn_norm if len(layers) else self.norm
        h = fast_kernels.rms_norm(res, first.weight, first.eps)
        for i, layer in enumerate(layers):
            k, v = (cache.k[i], cache.v[i]) if whole else (cache.k[i][rows], cache.v[i][rows])
            a = attention(layer.attn, h.view(b, m, dim), k, v)
            h = fast_kernels.add_rms_norm(res, a.reshape(b * m, dim), layer.mlp_norm.weight, layer.mlp_norm.eps)
            mlp = layer.mlp
            act = fast_kernels.silu_mul(mlp.w_gate_up(h.view(b, m, dim)).reshape(b * m, -1))
            norm = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
            h = fast_kernels.add_rms_norm(res, mlp.w_down(act.view(b, m, -1)).reshape(b * m, dim), norm.weight,
                                          norm.eps)
        h = h.view(b, m, dim)
        if last_only:
            h = h[:, -1:]
        return (head or self.lm_head)(h).float()

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, rope_pos: torch.Tensor,
                       tree: torch.Tensor | None, cache: KVCache, kv_len: int, rows: slice, last_only: bool,
                       n_layers: int | None, head: nn.Module | None = None) -> torch.Tensor:
        """:meth:`forward` for a few tokens per row through the fused ops: no mask is built (attention
        masks by position itself), and each layer is norm -> wqkv -> attend -> wo -> add + norm ->
        gate/up -> silu * up -> down -> add + the next norm (the final norm after the last layer)."""
        b, m, dim = x.shape
        x = x.reshape(b * m, dim)  # the residual stream, updated in place by add_rms_norm
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]
        layers = self.layers[: n_layers or self.args.n_layers]
        whole = rows == slice(None)
        kv_len = int(kv_len)
        first = layers[0].attn_norm if len(layers) else self.norm
        h = fast_kernels.rms_norm(x, first.weight, first.eps)
        for i, layer in enumerate(layers):
            attn, mlp = layer.attn, layer.mlp
            k, v = (cache.k[i], cache.v[i]) if whole else (cache.k[i][rows], cache.v[i][rows])
            o = fast_kernels.attend(small_m_call(attn.wqkv, h).view(b, m, -1), cos, sin, positions, k, v, kv_len,
                                    attn.n_heads, attn.n_kv_heads, tree)
            h = fast_kernels.add_rms_norm(x, small_m_call(attn.wo, o.view(b * m, -1)), layer.mlp_norm.weight,
                                          layer.mlp_norm.eps)
            norm = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
            act = fast_kernels.silu_mul(small_m_call(mlp.w_gate_up, h))
            h = fast_kernels.add_rms_norm(x, small_m_call(mlp.w_down, act), norm.weight, norm.eps)
        h = h.view(b, m, dim)
        if last_only:
            h = h[:, -1:]
        return (head or self.lm_head)(h).float()

    @staticmethod
    def _mask(positions: torch.Tensor, kv_len: int, tree: torch.Tensor | None = None) -> torch.Tensor:
        """Causal by position, which also hides stale entries left past a row's length; with a token
        ``tree`` (see :meth:`forward`) a row's new tokens also hide those off their root path.

        A few queries get an additive fp32 bias [B, 1, m, L] (see :func:`small_m_attention`);
        longer blocks a boolean mask for SDPA, or an empty tensor when one row fills positions
        0..m-1 from scratch, where SDPA's own causal mode is exact and about twice as fast.
        """
        b, m = positions.shape
        if m > SMALL_M and b == 1 and kv_len == m:
            return torch.empty(0, device=positions.device)
        keys = torch.arange(kv_len, device=positions.device)
        allowed = keys[None, None, None, :] <= positions[:, None, :, None]
        if tree is not None:  # key slot j = first + t is new token t: seen where bit t of the query's mask is set
            t = keys[None, :] - positions[:, :1]  # [B, L]
            new = (t >= 0) & (t < m)
            bit = (tree[:, :, None] >> t.clamp(0, m - 1)[:, None, :]) & 1  # [B, m, L]
            allowed &= (~new[:, None, :] | bit.bool())[:, None]
        if m > SMALL_M:
            return allowed
        return torch.zeros(allowed.shape, device=positions.device).masked_fill_(~allowed, float("-inf"))

    @classmethod
    def from_state_dict(cls, args: ModelArgs, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                        weight_format: str = "dense", kernels: str = "auto") -> Transformer:
        """Build from tensors named as in Hugging Face checkpoints.

        ``get(name)`` returns a float tensor or None when absent; taking a getter rather
        than a dict lets loaders materialise one tensor at a time and keep peak memory low.
        For projection weights it may also return an already quantized weight
        (:class:`QuantizedTensor`, :class:`Int4Weight`, :class:`Int8Weight`, see linear.py).
        ``kernels`` ("auto" or "stock") picks the int4/int8 matmul kernels (see :func:`make_linear`) and
        whether decode/verification steps use the fused small ops (``fused_ops``, "auto" where they run).
        """

        def req(name: str) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise KeyError(f"checkpoint lacks {name}")
            return t

        def linear(names: list[str], with_bias: bool) -> nn.Module:
            w = fuse([req(n + ".weight") for n in names])
            b = torch.cat([req(n + ".bias") for n in names]) if with_bias else None
            return make_linear(w, b, weight_format, dtype, kernels)

        def fuse(parts: list) -> torch.Tensor | QuantizedTensor | Int4Weight | Int8Weight:
            # Rows are output channels, so every format concatenates along them; mixed parts
            # (e.g. a Q6_K v_proj next to Q4_K q/k) meet in float, in the more precise format.
            kinds = {torch.Tensor if isinstance(p, torch.Tensor) else type(p) for p in parts}
            if len(parts) == 1 or kinds == {torch.Tensor}:
                return parts[0] if len(parts) == 1 else torch.cat(parts)
            if len(kinds) == 1 and kinds <= {QuantizedTensor, Int4Weight, Int8Weight}:
                return parts[0].cat(parts)
            w = torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
            return Int8Weight.quantize(w, dtype) if Int8Weight in kinds else w

        def norm(name: str) -> RMSNorm:
            return RMSNorm(req(name).to(dtype), args.norm_eps)

        layers = []
        for i in range(args.n_layers):
            p = f"model.layers.{i}."
            attn = Attention(args, linear([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
                                          args.qkv_bias),
                             linear([p + "self_attn.o_proj"], False))
            mlp = MLP(linear([p + "mlp.gate_proj", p + "mlp.up_proj"], False), linear([p + "mlp.down_proj"], False))
            layers.append(Block(norm(p + "input_layernorm.weight"), attn,
                                norm(p + "post_attention_layernorm.weight"), mlp))
        embed = req("model.embed_tokens.weight")
        head_w = get("lm_head.weight")
        if head_w is None or args.tie_word_embeddings:
            head_w = embed
        lm_head = make_linear(head_w, None, weight_format, dtype, kernels)
        model = cls(args, embed.to(dtype), layers, norm("model.norm.weight"), lm_head, dtype)
        model.fused_ops = fast_kernels.use_small_ops(kernels)
        scratch = WeightScratch()  # the prefill's expanded weights, one layer at a time
        for module in model.modules():
            if isinstance(module, (DenseLinear, Int8Linear, Int4Linear)):
                module.scratch = scratch
        return model


def span_forward(model: Transformer, cache: KVCache, feeds: dict[int, list[int]], starts: dict[int, int],
                 kv_len: int, full_span: bool = False, parents: dict[int, list[int]] | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, int]:
    """One forward over the cache rows spanned by ``feeds`` (slot -> tokens at positions ``starts[slot]``...).

    Each fed row is right-padded with its last token to the widest feed; every other slot in the span
    (all of them with ``full_span``: a compiled model's static shapes) gets dummies from its own cache
    length on. Attention masks by position, so such entries are never read before they are
    overwritten. ``parents`` makes a row's feed a token tree (its first token the root; node i's
    parent index per :class:`~verispec.drafters.base.Proposal`). Returns the logits, one row per slot
    of the span, and the span's first slot.
    """
    lo, hi = (0, cache.batch) if full_span else (min(feeds), max(feeds) + 1)
    width = max(len(f) for f in feeds.values())
    begin = list(cache.lengths[lo:hi])
    tokens = torch.zeros(hi - lo, width, dtype=torch.long)
    for slot, feed in feeds.items():
        tokens[slot - lo] = torch.tensor(feed + [feed[-1]] * (width - len(feed)))
        begin[slot - lo] = starts[slot]
    pos = torch.tensor(begin).unsqueeze(1) + torch.arange(width)
    if parents:  # every other row (and padding) a chain: token t sees tokens 0..t
        tree = ((1 << (torch.arange(width) + 1)) - 1).repeat(hi - lo, 1)
        for slot, ps in parents.items():
            masks = tree[slot - lo]
            for node, parent in enumerate(ps):
                masks[node + 1] = masks[parent + 1] | (1 << (node + 1))
        kwargs["tree"] = tree.to(model.device)  # named only when present: compiled forwards take no trees
    logits = model(tokens.to(model.device), pos.to(model.device), cache, kv_len=kv_len,
                   rows=slice(None) if full_span else slice(lo, hi), **kwargs)
    return logits, lo
