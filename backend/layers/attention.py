"""Paged attention over the KV cache: store this step's K/V, then decode and prefill parts separately.

sliding_window (keys at positions > p - window) and softcap (scores c * tanh(s / c)) are per layer, as the
kernels define them (docs/CONTRACTS.md). Under torch.compile the whole layer is one opaque op
(`loom::paged_attention`): it reads the per-step forward context, which a compiled graph must not capture.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from loom.kernels import paged_decode_attention, paged_prefill_attention, store_kv, torch_ops
from loom.layers.forward_context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.softcap = sliding_window, softcap
        # Bound by the model runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        fn = torch.ops.loom.paged_attention if torch.compiler.is_compiling() else paged_attention
        return fn(q, k, v, self.k_cache, self.v_cache, self.scale, self.sliding_window, self.softcap)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    ctx = get_forward_context()
    store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    out = torch.empty_like(q)
    d = ctx.num_decode_seqs
    if d:
        dec = ctx.decode
        paged_decode_attention(q[:d], k_cache, v_cache, dec.block_tables, dec.seq_lens, scale, out=out[:d],
                               sliding_window=sliding_window, softcap=softcap)
    pre = ctx.prefill
    if pre is not None:
        paged_prefill_attention(q[d:], k_cache, v_cache, pre.cu_seqlens_q, pre.seq_lens, pre.block_tables,
                                pre.max_seqlen_q, scale, out=out[d:], sliding_window=sliding_window, softcap=softcap)
    return out


# It also writes this step's K/V into the caches; no op of a compiled graph reads them, so declaring it
# free of side effects keeps the graph functional (the caches are never copied).
torch_ops.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, float scale, "
                 "SymInt? sliding_window=None, float? softcap=None) -> Tensor", paged_attention,
                 lambda q, *args, **kw: torch.empty_like(q))
