"""Neox-style rotary embedding (rotate halves) on the leading rotary_dim dims of each head, in place on q [T,H,D]
and k [T,KVH,D]; fused with the store of this step's K/V into the paged cache, one launch for both.

cos_sin_cache [max_pos, rotary_dim]: cos in [:, :rotary_dim/2], sin in [:, rotary_dim/2:]; rotary_dim <= D
(partial rotary: the dims past it are left as they are). Math in float32. q, k and v may be strided views into
the fused q|k|v projection's output: only each head's dims must be contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.kv_fp8 import inv_scale, is_fp8, kv_encode
from loom.kernels.kv_layout import block_size_of, cache_strides, kv_heads_of
from loom.kernels.kv_store import store_kv_ref


@triton.jit
def _rope_rows(ptr, stride_h, nheads, cos, sin, partner, d, D: tl.constexpr, H_PAD: tl.constexpr):
    """The rotated heads of one token [H_PAD, D_PAD], in float32: x * cos + x[partner] * sin per dim (cos 1 and
    sin 0 past the rotary dims, sin negated on the first half)."""
    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < nheads) & (d < D)
    x = tl.load(ptr + h * stride_h + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptr + h * stride_h + partner, mask=mask, other=0.0).to(tl.float32)
    return x * cos + xp * sin, mask


@triton.jit
def _cos_sin(cs_ptr, pos, stride_cs, D_PAD: tl.constexpr, HALF: tl.constexpr):
    """(cos, sin, partner, d) of position `pos`, each [1, D_PAD]: x * cos + x[partner] * sin rotates a row (cos 1 and
    sin 0 past the rotary dims, sin negated on the first half)."""
    d = tl.arange(0, D_PAD)[None, :]
    first = d < HALF
    rot = d < 2 * HALF
    partner = tl.where(first, d + HALF, tl.where(rot, d - HALF, d))
    i = tl.where(first, d, d - HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=rot, other=0.0).to(tl.float32)
    return cos, tl.where(first, -sin, sin), partner, d


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_co, stride_ch,  # shared by k_cache and v_cache (same shape, both contiguous in D)
    block_size, H, KVH, k_inv, v_inv,
    D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    STORE_KV: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    cos, sin, partner, d = _cos_sin(cs_ptr, pos, stride_cs, D_PAD, HALF)

    q_row = q_ptr + t * stride_qt
    q, qmask = _rope_rows(q_row, stride_qh, H, cos, sin, partner, d, D, HQ_PAD)
    tl.store(q_row + tl.arange(0, HQ_PAD)[:, None] * stride_qh + d, q.to(q_ptr.dtype.element_ty), mask=qmask)
    k_row = k_ptr + t * stride_kt
    k, kmask = _rope_rows(k_row, stride_kh, KVH, cos, sin, partner, d, D, HK_PAD)
    k = k.to(k_ptr.dtype.element_ty)  # rounded as the in-place result is, then stored from it
    h = tl.arange(0, HK_PAD)[:, None]
    tl.store(k_row + h * stride_kh + d, k, mask=kmask)
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # -1: padding / tokens whose KV must not be written
            dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h * stride_ch + d
            tl.store(kc_ptr + dst, kv_encode(k, k_inv, KV_FP8, kc_ptr.dtype.element_ty), mask=kmask)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=kmask)
            tl.store(vc_ptr + dst, kv_encode(v, v_inv, KV_FP8, vc_ptr.dtype.element_ty), mask=kmask)


def _launch(positions, q, k, cos_sin_cache, kv=None, k_scale=1.0, v_scale=1.0):
    """kv: (v, k_cache, v_cache, slot_mapping) to store this step's K/V as well (k_scale / v_scale: an fp8 cache's)."""
    T, H, D = q.shape
    KVH = k.shape[1]
    if T == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    rotary_dim = cos_sin_cache.shape[-1]
    assert rotary_dim <= D and rotary_dim % 2 == 0
    if kv is None:
        v, kc, vc, slots, strides, block_size = k, k, k, positions, (0, 0, 0), 1
    else:
        v, kc, vc, slots = kv
        assert v.shape == k.shape and v.stride(-1) == 1 and kc.is_contiguous() and vc.is_contiguous()
        assert kc.stride() == vc.stride() and kv_heads_of(kc) == KVH and kc.shape[-1] == D
        strides, block_size = cache_strides(kc), block_size_of(kc)
    _rotary_kernel[(T,)](
        positions, q, k, v, kc, vc, slots, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *strides, block_size, H, KVH, inv_scale(k_scale), inv_scale(v_scale),
        D=D, D_PAD=triton.next_power_of_2(D), HALF=rotary_dim // 2, HQ_PAD=triton.next_power_of_2(H),
        HK_PAD=triton.next_power_of_2(KVH), STORE_KV=kv is not None, KV_FP8=kv is not None and is_fp8(kc),
    )


def rotary_embedding_triton(positions, q, k, cos_sin_cache):
    _launch(positions, q, k, cos_sin_cache)


def rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0,
                           v_scale=1.0):
    """rotary_embedding, then k (rotated) and v into the caches at slot_mapping (-1 = skip): one launch."""
    _launch(positions, q, k, cos_sin_cache, (v, k_cache, v_cache, slot_mapping), k_scale, v_scale)


def _rotate_ref(x, cos, sin):
    half = cos.shape[-1]
    xf = x[..., :2 * half].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    x[..., :2 * half].copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rotary_embedding_ref(positions, q, k, cos_sin_cache):
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)


def rotary_store_kv_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0,
                        v_scale=1.0):
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
