"""Paged prefill attention over a varlen batch (chunked prefill, prefix-cache hits, mixed decode).

Query i of sequence s sits at absolute position seq_lens[s] - q_len_s + i and attends to every cached
key at a position <= its own (and > its own - sliding_window with a window; softcap as in the decode
kernel, docs/CONTRACTS.md); the new tokens' K/V are already in the cache. One program per (query tile,
sequence, q head); it walks the block table from the tile's first visible key to its last query position. An fp8 cache
is read as the decode kernel reads it (kernels/kv_fp8.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.kv_fp8 import from_cache, is_fp8, kv_decode
from loom.kernels.kv_layout import block_size_of, cache_strides, kv_heads_of
from loom.kernels.paged_decode_attention import (
    _LOG2E,
    _NEG,
    _dot_precision,
    gather_kv,
    pad_dim,
    paged_decode_attention_ref,
    sdpa_gqa,
    softcap_args,
)


# The decode/prefill split of a mixed step puts the prefill part's q, out and metadata at any row offset: their
# pointers are not specialised on alignment (an offset must never mean a new compile while serving).
@triton.jit(do_not_specialize_on_alignment=["q_ptr", "o_ptr", "cu_ptr", "sl_ptr", "bt_ptr"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, sl_ptr, bt_ptr, o_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_btb,
    scale_log2e, window, cap_in, cap_out, k_scale, v_scale,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    mb = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + s)
    q_len = tl.load(cu_ptr + s + 1) - q_start
    if mb * BLOCK_M >= q_len:  # grid is sized by the longest query of the batch
        return
    seq_len = tl.load(sl_ptr + s)
    ctx0 = seq_len - q_len  # absolute position of this sequence's first query
    kvh = h // GROUP

    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    imask = i < q_len
    qpos = ctx0 + i
    tok = (q_start + i).to(tl.int64)
    qd_mask = imask[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=qd_mask, other=0.0)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    end = tl.minimum(seq_len, ctx0 + (mb + 1) * BLOCK_M)  # keys past the tile's last query are unused
    lo = 0
    if HAS_WINDOW:  # keys before the window of the tile's first query are unused
        lo = tl.maximum(ctx0 + mb * BLOCK_M - window + 1, 0)
    bt_row = bt_ptr + s.to(tl.int64) * stride_btb
    for start in range(lo, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
        off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_co + kvh * stride_ch
        kv_mask = pmask[:, None] & (d < D)[None, :]
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0)
        k = kv_decode(k, k_scale, KV_FP8, q_ptr.dtype.element_ty)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if HAS_SOFTCAP:  # c * tanh(scale * qk / c) in the log2 domain, with tanh(x) = 2 * sigmoid(2x) - 1
            qk = cap_out * (2.0 * tl.sigmoid(qk * cap_in) - 1.0)
        else:
            qk = qk * scale_log2e
        visible = pmask[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0)
        v = kv_decode(v, v_scale, KV_FP8, q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qd_mask)


def prefill_tiles(max_seqlen_q, d_pad, block_m=None, kv_fp8=False):
    """(BLOCK_M, BLOCK_N, num_warps), chosen with scripts/kernel_resources.py for bf16/fp16 on sm_80 and sm_90 (no
    spills; >= 8 warps resident per SM). Short queries (decode-like rows) waste less of a 16-row tile, run as 4 warps
    with narrow key tiles (2-4 CTAs per SM); prompts take 32/64-row tiles on 8 warps (1 CTA of 8 warps at 192-255
    registers: compute-bound, as FlashAttention-2). A 64-row tile on 4 warps spills (sm_80 at head_dim 64), so does
    a 16 x 64 one at head_dim 128 (sm_90). Over an fp8 cache (kv_fp8: each K/V tile decoded in registers) the 64-row
    tile at head_dim 128 spills on both (24 bytes): 32 rows there."""
    if block_m is None:
        wide = d_pad > 128 or (kv_fp8 and d_pad == 128)
        block_m = 16 if max_seqlen_q <= 16 else (32 if max_seqlen_q <= 32 or wide else 64)
    if block_m <= 16:
        return block_m, 32 if d_pad <= 64 else 16, 4
    return block_m, 64 if d_pad <= 128 else 32, 8


def paged_prefill_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q,
                                   scale, out=None, sliding_window=None, softcap=None, block_m=None, block_n=None,
                                   k_scale=1.0, v_scale=1.0):
    T, H, D = q.shape
    block_size, KVH = block_size_of(k_cache), kv_heads_of(k_cache)
    assert H % KVH == 0 and q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    S = seq_lens.shape[0]
    if T == 0 or S == 0:
        return out
    d_pad = pad_dim(D)
    block_m, tile_n, num_warps = prefill_tiles(max_seqlen_q, d_pad, block_m, is_fp8(k_cache))
    block_n = block_n or tile_n
    grid = (triton.cdiv(max_seqlen_q, block_m), S, H)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *cache_strides(k_cache), block_tables.stride(0),
        scale * _LOG2E, *softcap_args(scale, sliding_window, softcap), k_scale, v_scale,
        KV_FP8=is_fp8(k_cache), HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        GROUP=H // KVH, D=D, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC=_dot_precision(q.dtype), num_warps=num_warps,
    )
    return out


def _padded_prefill(q, k_cache, v_cache, starts, q_lens, seq_lens, block_tables, scale, out, window, softcap,
                    k_scale, v_scale):
    """One SDPA call over sequences padded to their longest query, with a causal-by-position mask."""
    n = q_lens.shape[0]
    dev = q.device
    total = int(q_lens.sum())
    max_q = int(q_lens.max())
    seq_of = torch.repeat_interleave(torch.arange(n, device=dev), q_lens, output_size=total)
    offs = torch.arange(total, device=dev) - torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens,
                                                                     output_size=total)
    tok = starts[seq_of] + offs
    H, D = q.shape[1], q.shape[2]
    qp = q.new_zeros((n, max_q, H, D))
    qp[seq_of, offs] = q[tok]
    q0 = seq_lens - q_lens  # position of each sequence's first query
    k, v, kpos, _ = gather_kv(k_cache, v_cache, block_tables, seq_lens, None if window is None else q0 - window + 1)
    qpos = q0[:, None] + torch.arange(max_q, device=dev)[None, :]  # [n, max_q]
    # keys past seq_len are excluded for real rows since qpos <= seq_len - 1; padded rows keep key kpos <= qpos
    mask = kpos[:, None, :] <= qpos[:, :, None]
    if window is not None:
        # padded rows (qpos past the end) must keep one visible key: they see at least their sequence's last key
        mask &= (kpos[:, None, :] > qpos[:, :, None] - window) | (kpos[:, None, :] == (seq_lens - 1)[:, None, None])
    k, v = from_cache(k, k_scale, q.dtype), from_cache(v, v_scale, q.dtype)
    o = sdpa_gqa(qp.transpose(1, 2), k, v, mask[:, None], scale, softcap)  # [n, H, max_q, D]
    out[tok] = o.transpose(1, 2)[seq_of, offs]


def paged_prefill_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q,
                                scale, out=None, sliding_window=None, softcap=None, block_m=None, block_n=None,
                                k_scale=1.0, v_scale=1.0):
    T, H, D = q.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    cu = cu_seqlens_q.long()
    starts, q_lens = cu[:-1], cu[1:] - cu[:-1]
    seq_lens = seq_lens.long()
    # single-token sequences take the decode path so they are not padded to the longest prefill
    dec = q_lens == 1
    if bool(dec.any()):
        idx = dec.nonzero().squeeze(1)
        out[starts[idx]] = paged_decode_attention_ref(q[starts[idx]], k_cache, v_cache, block_tables[idx],
                                                      seq_lens[idx], scale, sliding_window=sliding_window,
                                                      softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    pre = (q_lens > 1).nonzero().squeeze(1)
    if pre.numel():
        _padded_prefill(q, k_cache, v_cache, starts[pre], q_lens[pre], seq_lens[pre], block_tables[pre], scale, out,
                        sliding_window, softcap, k_scale, v_scale)
    return out
