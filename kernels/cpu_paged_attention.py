"""Paged attention on CPU that reads K/V in place through the block table (C++, kernels/cpu_ext.py), and the
store of a step's K/V into the cache.

The references (paged_decode_attention_ref / paged_prefill_attention_ref) gather every sequence's K/V
into a padded copy and run SDPA; these walk the block table instead (float32 or bfloat16 q / caches / out: a bfloat16
cache is read in place, widened; the math is float32 and each output rounded once): per (sequence, kv head) for decode,
the kv group's query heads share each key row read; per (sequence, query tile of 16, head) for prefill.
Same signatures and options as the references (docs/CONTRACTS.md): `sliding_window` W - a query at
position p sees keys k with p - W < k <= p; `softcap` c - scores become c * tanh(s / c) before softmax.
kernels/dispatch.py runs them where kernels/policy.py chose the C++ kernels and takes_attention / takes_store_kv say
they take the call's tensors; the references otherwise.
"""
from __future__ import annotations

import torch

from loom.kernels import cpu_ext
from loom.kernels.kv_layout import block_size_of, kv_heads_of

PREFILL_TILE = 16  # query rows sharing each key row read


def attention_options(sliding_window, softcap) -> tuple[int, float]:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    return int(sliding_window or 0), float(softcap or 0.0)


def _cache_ok(k_cache, v_cache) -> bool:
    return k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape


def takes_attention(q, k_cache, v_cache, out, sliding_window, softcap) -> bool:
    """Whether the C++ attention takes these tensors (CPU, one dtype: float32 or bfloat16, contiguous caches and out
    rows); raises ValueError for options no implementation takes, whichever then runs on CPU."""
    attention_options(sliding_window, softcap)
    return (cpu_ext.act_dtype(q, k_cache, v_cache) is not None and _cache_ok(k_cache, v_cache)
            and (out is None or (out.dtype == q.dtype and out.is_cpu and out.stride(-1) == 1)))


def takes_store_kv(k, v, k_cache, v_cache, slot_mapping) -> bool:
    return (cpu_ext.act_dtype(k, v, k_cache, v_cache) is not None and _cache_ok(k_cache, v_cache) and k.shape == v.shape
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.shape[0] == k.shape[0] and _rows(k) and _rows(v))


def store_kv_cpu(k, v, k_cache, v_cache, slot_mapping):
    """k/v [T, KVH, D] into the caches at slot_mapping [T] (block * block_size + offset; -1 = skip), as
    store_kv_ref; one row copy per token."""
    T = k.shape[0]
    if T:
        getattr(cpu_ext.built(), "loom_store_kv" + cpu_ext.ACT_SUFFIX[k.dtype])(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), T, block_size_of(k_cache), kv_heads_of(k_cache), k_cache.shape[3])


def _rows(t: torch.Tensor) -> bool:
    # each token's [KVH, D] contiguous (tokens may be strided, e.g. views into a fused qkv output)
    return t.stride(-1) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


def paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, sliding_window=None,
                               softcap=None):
    """q [B, H, D], caches [blocks, KVH, block_size, D], block_tables [B, M] int32, seq_lens [B] int32."""
    window, cap = attention_options(sliding_window, softcap)
    lib = cpu_ext.built()
    if out is None:
        out = torch.empty_like(q)
    B, H, D = q.shape
    if B == 0:
        return out
    block_size, KVH = block_size_of(k_cache), kv_heads_of(k_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    bt, sl = cpu_ext.contiguous(block_tables, torch.int32), cpu_ext.contiguous(seq_lens, torch.int32)
    fn = getattr(lib, "loom_paged_decode" + cpu_ext.ACT_SUFFIX[q.dtype])
    fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), block_size, KVH, D,
       bt.data_ptr(), bt.shape[1], sl.data_ptr(), B, H, out.data_ptr(), out.stride(0), out.stride(1), scale, window,
       cap, cpu_ext.nthreads())
    return out


def paged_prefill_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale,
                                out=None, sliding_window=None, softcap=None):
    """q [T, H, D]; sequence s owns rows [cu[s], cu[s+1]) at positions seq_lens[s] - q_len_s + i."""
    window, cap = attention_options(sliding_window, softcap)
    lib = cpu_ext.built()
    if out is None:
        out = torch.empty_like(q)
    T, H, D = q.shape
    if T == 0:
        return out
    block_size, KVH = block_size_of(k_cache), kv_heads_of(k_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    cu, sl, bt = (cpu_ext.contiguous(a, torch.int32) for a in (cu_seqlens_q, seq_lens, block_tables))
    fn = getattr(lib, "loom_paged_prefill" + cpu_ext.ACT_SUFFIX[q.dtype])
    fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), block_size, KVH, D,
       cu.data_ptr(), sl.data_ptr(), sl.shape[0], bt.data_ptr(), bt.shape[1], H, out.data_ptr(), out.stride(0),
       out.stride(1), scale, window, cap, PREFILL_TILE, cpu_ext.nthreads())
    return out
