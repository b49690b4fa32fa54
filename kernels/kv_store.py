"""Scatter this step's K/V into the paged cache (kernels/kv_layout.py): token t's kv head h goes to block slot // bs,
head h, row slot % bs (slot -1 = skip). An fp8 cache (kernels/kv_fp8.py) takes the e4m3 codes of k / k_scale and
v / v_scale."""
from __future__ import annotations

import triton
import triton.language as tl

from loom.kernels.kv_fp8 import inv_scale, is_fp8, kv_encode, to_cache
from loom.kernels.kv_layout import block_size_of, cache_strides, write_slots


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,  # shared by k_cache and v_cache (same shape, both contiguous in D)
    block_size, k_inv, v_inv,
    KVH: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding / tokens whose KV must not be written
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < KVH) & (d < D)
    dst = blk * stride_cb + off * stride_co + h * stride_ch + d
    kk = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    vv = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(kc_ptr + dst, kv_encode(kk, k_inv, KV_FP8, kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, kv_encode(vv, v_inv, KV_FP8, vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    T, KVH, D = k.shape
    if T == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_strides(k_cache), block_size_of(k_cache), inv_scale(k_scale), inv_scale(v_scale),
        KVH=KVH, D=D, H_PAD=triton.next_power_of_2(KVH), D_PAD=triton.next_power_of_2(D), KV_FP8=is_fp8(k_cache),
    )


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    write_slots(k_cache, slots, to_cache(k[keep], k_cache, k_scale))
    write_slots(v_cache, slots, to_cache(v[keep], v_cache, v_scale))
