"""Paged attention over the KV cache: rope on this step's q and k and their store into the cache, then the decode and
prefill parts separately; on Triton the decode rows' rope and store run inside their attention kernel, the prefill
rows' in one fused kernel before theirs.

sliding_window (keys at positions > p - window) and softcap (scores c * tanh(s / c)) are per layer, as the
kernels define them (docs/CONTRACTS.md). Under torch.compile the rope is traced (inductor fuses it into its loops)
and the rest of the layer is one opaque op (`loom::paged_attention`): it reads the per-step forward context, which
a compiled graph must not capture.

With kv_cache_dtype fp8 the caches hold e4m3 codes (kernels/kv_fp8.py) and k_scale / v_scale are the layer's
per-tensor scales (models/kv_scales.py), which every store and read of the caches applies.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from loom.kernels import paged_decode_attention, paged_prefill_attention, store_kv, torch_ops
from loom.kernels.dispatch import rope_store_decode_attention, rotary_store_kv
from loom.layers.forward_context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.softcap = sliding_window, softcap
        # Bound by the model runner once the cache is allocated: [num_blocks, kv_heads, block_size, head_dim]
        # (kernels/kv_layout.py).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Bound by the model runner too: flash-decoding's ticket counters, one buffer for every layer (zero between
        # launches; kernels/paged_decode_attention.py make_split_counters)
        self.split_counters: torch.Tensor | None = None
        self.k_scale, self.v_scale = 1.0, 1.0  # an fp8 cache's scales (set by the model runner)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D], each head's dims contiguous (the rows may be strided views into the q|k|v
        projection): rope (rotary, a layers.rotary.RotaryEmbedding) on q and k in place, this step's K/V into the
        caches, attention -> [T, H, D] (contiguous)."""
        if torch.compiler.is_compiling():
            rotary(positions, q, k)
            return torch.ops.loom.paged_attention(q, k, v, self.k_cache, self.v_cache, self.scale,
                                                  self.sliding_window, self.softcap, self.k_scale, self.v_scale)
        ctx = get_forward_context()
        d, cs, kc, vc = ctx.num_decode_seqs, rotary.cos_sin_cache, self.k_cache, self.v_cache
        ks, vs = self.k_scale, self.v_scale
        if not d:
            rotary_store_kv(positions, q, k, v, cs, kc, vc, ctx.slot_mapping, ks, vs)
            return attend(q, kc, vc, self.scale, self.sliding_window, self.softcap, ks, vs)
        # the decode rows' rope and K/V store run inside their attention (one launch on Triton), the rest's before
        # theirs: the two parts are different sequences
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dec = ctx.decode
        rope_store_decode_attention(positions[:d], q[:d], k[:d], v[:d], cs, kc, vc, ctx.slot_mapping[:d],
                                    dec.block_tables, dec.seq_lens, self.scale, out=out[:d],
                                    sliding_window=self.sliding_window, softcap=self.softcap, k_scale=ks, v_scale=vs,
                                    split_counters=self.split_counters)
        if q.shape[0] > d:
            rotary_store_kv(positions[d:], q[d:], k[d:], v[d:], cs, kc, vc, ctx.slot_mapping[d:], ks, vs)
        _attend_prefill(q, out, d, kc, vc, self.scale, self.sliding_window, self.softcap, ks, vs)
        return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """This step's K/V (rope applied) into the caches, then attention."""
    store_kv(k, v, k_cache, v_cache, get_forward_context().slot_mapping, k_scale, v_scale)
    return attend(q, k_cache, v_cache, scale, sliding_window, softcap, k_scale, v_scale)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
           sliding_window: Optional[int] = None, softcap: Optional[float] = None, k_scale: float = 1.0,
           v_scale: float = 1.0) -> torch.Tensor:
    """The step's queries over the caches (this step's K/V already stored): decodes, then prefills."""
    ctx = get_forward_context()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = ctx.num_decode_seqs
    if d:
        dec = ctx.decode
        paged_decode_attention(q[:d], k_cache, v_cache, dec.block_tables, dec.seq_lens, scale, out=out[:d],
                               sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    _attend_prefill(q, out, d, k_cache, v_cache, scale, sliding_window, softcap, k_scale, v_scale)
    return out


def _attend_prefill(q, out, d, k_cache, v_cache, scale, sliding_window, softcap, k_scale, v_scale) -> None:
    """out[d:] = the prefill part's attention (rows d on), when the step has one."""
    pre = get_forward_context().prefill
    if pre is not None:
        paged_prefill_attention(q[d:], k_cache, v_cache, pre.cu_seqlens_q, pre.seq_lens, pre.block_tables,
                                pre.max_seqlen_q, scale, out=out[d:], sliding_window=sliding_window, softcap=softcap,
                                k_scale=k_scale, v_scale=v_scale)


# It also writes this step's K/V into the caches; no op of a compiled graph reads them, so declaring it
# free of side effects keeps the graph functional (the caches are never copied).
torch_ops.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, float scale, "
                 "SymInt? sliding_window=None, float? softcap=None, float k_scale=1.0, float v_scale=1.0) -> Tensor",
                 paged_attention,
                 lambda q, *args, **kw: q.new_empty(q.shape))
