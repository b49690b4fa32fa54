"""Paged decode attention: one query token per sequence over its block table (GQA, any group size).

Two Triton paths:
- one program per (sequence, kv head) that walks the whole context, holding all q heads of the kv
  group as the rows of one tile (K/V are read once per group);
- flash-decoding for long contexts with few sequences: each sequence's visible context is split into
  (up to) `num_splits` partitions of its own length, each program writes its partition's (max, sum, normalised
  out) and takes a ticket from its (sequence, kv head)'s counter; the program with the last ticket merges the
  partitions, writes the output and sets the counter back to 0 - one launch, no reduction kernel. Partitions are
  sized on the device from each sequence's length, so a launch's integers do not depend on the step's contexts
  (what a CUDA graph captured for a batch size needs).

The ticket counters (make_split_counters) are int32, zero between launches (each launch leaves them as it found
them), so one buffer serves every layer and every step of a stream, graph replays included; an engine allocates it
once (ModelRunner), sized for max_num_seqs x kv heads. Launches sharing a buffer must not run concurrently (one
stream). Memory order: every thread's partial stores, then a CTA barrier, then the ticket (atom.acq_rel.gpu: a
release of what the CTA wrote); the last program's reads come after its ticket (the acquire) and a barrier.
The reference gathers K/V through the block table and runs SDPA with a length mask.

Options (docs/CONTRACTS.md): `sliding_window` W - the query at position p = seq_len - 1 sees keys at positions
> p - W (transformers' convention), and blocks wholly before that are never read; `softcap` c - scores become
c * tanh(scale * q.k / c) before the softmax (Gemma 2). An fp8 cache (kernels/kv_fp8.py: e4m3 codes) is read as
decode(code) * k_scale (v_scale) in q's dtype, and the decode rows' K/V are stored into it as codes of k / k_scale
(v / v_scale); the reference dequantises the gathered cache the same way.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loom.kernels.kv_fp8 import from_cache, inv_scale, is_fp8, kv_decode, kv_encode
from loom.kernels.kv_layout import block_size_of, cache_strides, gather_blocks, kv_heads_of
from loom.kernels.rotary import _cos_sin, _rope_rows, rotary_store_kv_ref

_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) NaN-free


@triton.jit
def _part_size(ctx, num_splits, min_part, BLOCK_N: tl.constexpr):
    """Tokens per partition of a sequence with `ctx` visible keys: an even share in whole tiles, >= min_part."""
    part = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(part, min_part)


# Integers that vary with the step (the split count, the partial buffers' strides) are not specialised on: a new
# value must never mean a new compile while serving.
@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_ps", "stride_mb", "stride_mh", "min_part"])
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, o_ptr, po_ptr, m_ptr, l_ptr, cnt_ptr,
    pos_ptr, k_ptr, v_ptr, slot_ptr, cs_ptr,  # ROPE_STORE: this step's positions, k and v rows, slots, rope cache
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cs,
    stride_cb, stride_co, stride_ch,
    stride_btb,
    stride_ob, stride_oh,  # out [B,H,D]
    stride_pb, stride_ph, stride_ps,  # SPLIT: partial out [B,H,NS,D]
    stride_mb, stride_mh,  # SPLIT: partial max / sum [B,H,NS]; ticket counters [B,KVH] at cnt_ptr
    scale_log2e, min_part, window, cap_in, cap_out, k_scale, v_scale, k_inv, v_inv,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    ROPE_STORE: tl.constexpr, HALF: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    lo = 0
    if HAS_WINDOW:  # the first key the query (at seq_len - 1) sees
        lo = tl.maximum(seq_len - window, 0)
    if SPLIT:  # this sequence's partitions tile [lo, seq_len)
        part = _part_size(seq_len - lo, tl.num_programs(2), min_part, BLOCK_N)
        start = lo + split * part
        end = tl.minimum(seq_len, start + part)  # <= start: an empty partition (it still takes its ticket)
    else:
        start = lo
        end = seq_len

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
    if ROPE_STORE:  # rope on this token's q rows (kept in registers) and k; k and v into the cache
        cos, sin, partner, dd = _cos_sin(cs_ptr, tl.load(pos_ptr + b), stride_cs, D_PAD, HALF)
        q_row = q_ptr + b.to(tl.int64) * stride_qb + (kvh * GROUP) * stride_qh
        q = _rope_rows(q_row, stride_qh, GROUP, cos, sin, partner, dd, D, G_PAD)[0].to(q_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        here = (end == seq_len) & (slot >= 0)  # the program whose keys hold this token (split: the last written
        if SPLIT:  # partition; the empty ones past it end at seq_len too)
            here = here & (start < end)
        if here:
            k, kmask = _rope_rows(k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh, stride_kh, 1, cos, sin, partner,
                                  dd, D, 1)
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + kvh * stride_ch + dd
            k = kv_encode(k.to(k_ptr.dtype.element_ty), k_inv, KV_FP8, kc_ptr.dtype.element_ty)
            tl.store(kc_ptr + dst, k, mask=kmask)
            v = tl.load(v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh + dd, mask=kmask)
            tl.store(vc_ptr + dst, kv_encode(v, v_inv, KV_FP8, vc_ptr.dtype.element_ty), mask=kmask)
            tl.debug_barrier()  # the stores above seen by this program's threads' loads below
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_mask,
                    other=0.0)

    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    first = start
    if TILE_IN_BLOCK:  # tiles aligned to BLOCK_N, so each lies in one block (the first may begin before `start`)
        first = start - start % BLOCK_N
    if SPLIT:
        if start >= end:  # an empty partition: no tile
            first = end
    for s in range(first, end, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        pmask = pos < end
        if TILE_IN_BLOCK:  # one block id per tile; the tile is one contiguous run of this kv head's rows
            pmask = pmask & (pos >= start)
            blk = tl.load(bt_row + s // BLOCK_SIZE).to(tl.int64)
            off = blk * stride_cb + kvh * stride_ch + (s % BLOCK_SIZE + tl.arange(0, BLOCK_N)) * stride_co
        else:  # tiles wider than a block: a block id per token
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
        qk = tl.where(pmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0)
        v = kv_decode(v, v_scale, KV_FP8, q_ptr.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 -> zeros
    if SPLIT:  # scalar bases of the group's first head: no pointer tile stays live across the ticket
        p_base = po_ptr + b.to(tl.int64) * stride_pb + (kvh * GROUP) * stride_ph
        ml_base = b * stride_mb + (kvh * GROUP) * stride_mh
        if start < end:
            tl.store(p_base + split * stride_ps + g[:, None] * stride_ph + d[None, :], out, mask=gd_mask)
            tl.store(m_ptr + ml_base + g * stride_mh + split, m_i, mask=g < GROUP)
            tl.store(l_ptr + ml_base + g * stride_mh + split, l_i, mask=g < GROUP)
        _merge_if_last(cnt_ptr + b * tl.num_programs(1) + kvh, tl.num_programs(2), tl.cdiv(seq_len - lo, part),
                       p_base, stride_ph, stride_ps, m_ptr + ml_base, l_ptr + ml_base, stride_mh,
                       o_ptr + b.to(tl.int64) * stride_ob + (kvh * GROUP) * stride_oh, stride_oh, GROUP, G_PAD, D,
                       D_PAD)
    else:
        o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _merge_if_last(cnt, n_programs, n_valid, p_base, stride_ph, stride_ps, m_base, l_base, stride_mh, o_base,
                   stride_oh, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """Takes this program's ticket; the program with the last one merges the n_valid written partitions of its
    GROUP heads (two passes: the common max, then the weighted sum), writes the output and zeroes the counter."""
    tl.debug_barrier()  # every thread's partial stores before the ticket (one thread takes it, releasing them)
    ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if ticket == n_programs - 1:  # every other program of the sequence's kv head has released its partial
        tl.debug_barrier()  # the ticket's acquire before any thread's reads
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < GROUP
        gd_mask = g_mask[:, None] & (d < D)[None, :]
        ml = g * stride_mh
        m_all = tl.full([G_PAD], _NEG, tl.float32)
        for s in range(0, n_valid):
            m_all = tl.maximum(m_all, tl.load(m_base + ml + s, mask=g_mask, other=_NEG, cache_modifier=".cg"))
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        for s in range(0, n_valid):
            m = tl.load(m_base + ml + s, mask=g_mask, other=_NEG, cache_modifier=".cg")
            w = tl.load(l_base + ml + s, mask=g_mask, other=0.0, cache_modifier=".cg") * tl.exp2(m - m_all)
            total += w
            po = tl.load(p_base + s * stride_ps + g[:, None] * stride_ph + d[None, :], mask=gd_mask, other=0.0,
                         cache_modifier=".cg")
            acc += po * w[:, None]
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # no partition written (seq_len 0) -> zeros
        tl.store(o_base + g[:, None] * stride_oh + d[None, :], out.to(o_base.dtype.element_ty), mask=gd_mask)
        tl.store(cnt, 0)  # every ticket is taken: zero for the next launch


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as tf32 on GPU; half types ignore this setting
    return "ieee" if dtype == torch.float32 else "tf32"


def softcap_args(scale, sliding_window, softcap):
    """Kernel scalars: (window or 0, 2 * scale / c, c * log2(e)) - the unused ones are ignored by the kernels."""
    if softcap is None:
        return int(sliding_window or 0), 0.0, 0.0
    return int(sliding_window or 0), 2.0 * scale / softcap, softcap * _LOG2E


def _auto_num_splits(q, B, KVH, max_ctx):
    if max_ctx < 1024:
        return 1
    n_sm = _num_sms(q.device.index or 0) if q.is_cuda else 132
    programs = B * KVH
    if programs >= n_sm:
        return 1
    # enough programs to fill the chip twice, partitions of at least MIN_PART tokens
    return max(1, min(triton.cdiv(2 * n_sm, programs), max_ctx // MIN_PART, 128))


# Key tile, warps and register cap per padded head dim: (BLOCK_N, num_warps, maxnreg), chosen with
# scripts/kernel_resources.py for bf16/fp16 on sm_80 and sm_90 (not autotuned: one variant per head dim). Designed
# for: no spills, and enough resident CTAs (>= 3 of 4 warps per SM; 4-5 at head_dim 128 in a single pass, where the
# grid is large; flash-decoding's grid has about 2 programs per SM, so 3 there) that their K/V tile loads
# (BLOCK_N * D * 2 bytes, K and V) keep >= 24 KB per SM in flight, about what covers the memory latency at full
# bandwidth. Wider key tiles push the registers to the 255 cap (2 CTAs per SM) and spill at head_dim 128 on sm_90
# (BLOCK_N 64). ROPE_STORE (the engine's decode rows) adds 5-35 registers for the rope of q in float32 before the loop.
# The third entry: a register cap (ptxas .maxnreg, None = ptxas's choice). At head_dim 256, 168 (3 CTAs of 4 warps,
# 65536 / 384 = 170 in the allocation's steps of 8): ptxas alone gives flash-decoding with rope_store 174 registers
# (2 CTAs), under the cap 157 and no spills, and the single pass 125 instead of 134 (4 CTAs, not 3). Not set for the
# other head dims: a cap makes ptxas use up to it (at 128 the split variant went from 113 registers to 157).
DECODE_TILES = {16: (32, 4, None), 32: (32, 4, None), 64: (32, 4, None), 128: (16, 4, None), 256: (16, 4, 168)}

MIN_PART = 256  # automatic splits: shorter contexts keep fewer partitions (the others only take their ticket)


def make_split_counters(max_num_seqs: int, num_kv_heads: int, device) -> torch.Tensor:
    """Flash-decoding's ticket counters for launches of up to max_num_seqs sequences over num_kv_heads kv heads:
    zeroed once here, and zero again after every launch (see the module docstring)."""
    return torch.zeros(max(1, max_num_seqs * num_kv_heads), dtype=torch.int32, device=device)


def pad_dim(d: int) -> int:
    """Head dims padded to a power of two, and to 16 at least: tl.dot needs K >= 16."""
    return max(16, triton.next_power_of_2(d))


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None,
                                  sliding_window=None, softcap=None, num_splits=None, block_n=None, rope_store=None,
                                  split_counters=None, k_scale=1.0, v_scale=1.0):
    """num_splits: None = automatic (from the batch size and the block table's width, never from the contexts:
    a CUDA graph replays the same choice for every step), 1 = single pass, >1 = flash-decoding with up to that
    many partitions per sequence. rope_store: (positions, k, v, cos_sin_cache, slot_mapping) of this step's tokens
    (one per sequence) - rope on q (not written back) and k, and k and v stored at the slots (-1 = skip) before the
    attention reads them, in the same launch: as rotary_store_kv then this (decode rows have seq_len > 0 or slot -1).
    split_counters: make_split_counters' buffer for >= B x kv heads (None: a zeroed one made for this call - one
    more launch, and a buffer a CUDA graph would keep)."""
    B, H, D = q.shape
    block_size, KVH = block_size_of(k_cache), kv_heads_of(k_cache)
    assert H % KVH == 0 and q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    group = H // KVH
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    d_pad = pad_dim(D)
    tile_n, num_warps, maxnreg = DECODE_TILES.get(d_pad, (16, 4, None))
    block_n = block_n or tile_n
    max_ctx = block_tables.shape[1] * block_size  # bound on seq_lens without a device sync
    if sliding_window is not None:
        max_ctx = min(max_ctx, sliding_window)  # keys one query can see
    min_part = block_n
    if num_splits is None:
        num_splits, min_part = _auto_num_splits(q, B, KVH, max_ctx), MIN_PART
    num_splits = max(1, min(num_splits, triton.cdiv(max_ctx, block_n)))
    common = dict(GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=D, D_PAD=d_pad,
                  BLOCK_SIZE=block_size, BLOCK_N=block_n, DOT_PREC=_dot_precision(q.dtype),
                  HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
                  TILE_IN_BLOCK=block_size % block_n == 0, num_warps=num_warps)
    if maxnreg:
        common.update(maxnreg=maxnreg)
    if rope_store is None:
        step, step_strides, half = (q, q, q, q, q), (0,) * 5, 1
    else:
        positions, k, v, cos_sin, slots = rope_store
        assert k.shape == v.shape == (B, KVH, D) and k.stride(-1) == v.stride(-1) == cos_sin.stride(-1) == 1
        assert k_cache.stride() == v_cache.stride() and cos_sin.shape[-1] <= D and cos_sin.shape[-1] % 2 == 0
        step, half = (positions, k, v, slots, cos_sin), cos_sin.shape[-1] // 2
        step_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0))
    common.update(ROPE_STORE=rope_store is not None, HALF=half, KV_FP8=is_fp8(k_cache))
    kv_scales = (k_scale, v_scale, inv_scale(k_scale), inv_scale(v_scale))
    scale_log2e = scale * _LOG2E
    window, cap_in, cap_out = softcap_args(scale, sliding_window, softcap)
    launch = (q, k_cache, v_cache, block_tables, seq_lens, out)
    if num_splits == 1:
        _decode_kernel[(B, KVH, 1)](
            *launch, out, out, out, seq_lens, *step,
            q.stride(0), q.stride(1), *step_strides, *cache_strides(k_cache),
            block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0, 0, 0,
            scale_log2e, min_part, window, cap_in, cap_out, *kv_scales, SPLIT=False, **common)
        return out
    if split_counters is None:
        split_counters = make_split_counters(B, KVH, q.device)
    elif split_counters.dtype != torch.int32 or split_counters.numel() < B * KVH:
        raise ValueError(f"split_counters: {split_counters.dtype} x {split_counters.numel()}, a launch of {B} "
                         f"sequences x {KVH} kv heads needs int32 x >= {B * KVH} (make_split_counters)")
    po = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
    m = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _decode_kernel[(B, KVH, num_splits)](
        *launch, po, m, l, split_counters, *step,
        q.stride(0), q.stride(1), *step_strides, *cache_strides(k_cache),
        block_tables.stride(0), out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2), m.stride(0),
        m.stride(1), scale_log2e, min_part, window, cap_in, cap_out, *kv_scales, SPLIT=True, **common)
    return out


# ----------------------------------------------------------------------------------------------
# Reference


def gather_kv(k_cache, v_cache, block_tables, seq_lens, first_pos=None):
    """K/V of each sequence, gathered through its block table from the block holding first_pos[s] (default 0) on:
    ([N, KVH, L, D] x2, key positions [N, L] int64, valid [N, L]: position < seq_len).

    Blocks before first_pos's are never read (a sliding window may have freed them). Slots past a sequence's
    length are zeroed: unused cache slots may hold anything (even NaN), and a masked score times a NaN value
    would still poison SDPA's output.
    """
    block_size = block_size_of(k_cache)
    seq_lens = seq_lens.long()
    N, M = block_tables.shape
    first_blk = torch.zeros_like(seq_lens) if first_pos is None else first_pos.long().clamp_min(0) // block_size
    end_blk = (seq_lens + block_size - 1) // block_size
    nb = max(1, int((end_blk - first_blk).max()) if N else 1)
    cols = (first_blk[:, None] + torch.arange(nb, device=seq_lens.device)[None, :]).clamp_max(M - 1)
    bt = block_tables.long().gather(1, cols)
    k, v = gather_blocks(k_cache, bt), gather_blocks(v_cache, bt)  # [N, KVH, nb*bs, D]
    kpos = first_blk[:, None] * block_size + torch.arange(k.shape[2], device=k.device)[None, :]
    valid = kpos < seq_lens[:, None]
    seq, at = (~valid).nonzero(as_tuple=True)  # zero only the (few) slots past each length
    k[seq, :, at] = 0
    v[seq, :, at] = 0
    return k, v, kpos, valid


def sdpa_gqa(q, k, v, mask, scale, softcap=None):
    """q [N,H,Lq,D], k/v [N,KVH,L,D], bool mask broadcastable to [N,1,Lq,L]; softcap: c * tanh(scores / c)."""
    H, KVH = q.shape[1], k.shape[1]
    if softcap is not None:  # SDPA has no score hook: the plain computation, in float32
        rep = H // KVH
        kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
        s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * softcap
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.matmul(p, vf).to(q.dtype)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != KVH)
    except TypeError:  # torch < 2.5: no enable_gqa
        rep = H // KVH
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=mask, scale=scale)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None,
                               sliding_window=None, softcap=None, num_splits=None, block_n=None, rope_store=None,
                               split_counters=None, k_scale=1.0, v_scale=1.0):
    if rope_store is not None:  # q and k rotated in copies, as the Triton kernel leaves them
        positions, k, v, cos_sin, slots = rope_store
        q = q.clone()
        rotary_store_kv_ref(positions, q, k.clone(), v, cos_sin, k_cache, v_cache, slots, k_scale, v_scale)
    B, H, D = q.shape
    res = torch.zeros((B, H, D), dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return res
    first = None if sliding_window is None else seq_lens.long() - sliding_window  # first visible key
    k, v, kpos, valid = gather_kv(k_cache, v_cache, block_tables, seq_lens, first)
    if first is not None:
        valid &= kpos >= first[:, None]
    empty = seq_lens == 0
    valid[:, 0] |= empty  # a fully masked row would be NaN; such rows are zeroed below
    # With one query token, the G query heads sharing a KV head act as G query rows of one head:
    # plain SDPA over [B, KVH, G, D] needs no GQA expansion (measured ~15% faster than enable_gqa on CPU).
    KVH = k.shape[1]
    k, v = from_cache(k, k_scale, q.dtype), from_cache(v, v_scale, q.dtype)
    o = sdpa_gqa(q.view(B, KVH, H // KVH, D), k, v, valid[:, None, None, :], scale, softcap)
    res.copy_(o.reshape(B, H, D).masked_fill(empty[:, None, None], 0))
    return res
