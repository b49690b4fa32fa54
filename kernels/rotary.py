"""Neox-style rotary embedding (rotate halves), in place on q [T,H,D] and k [T,KVH,D].

cos_sin_cache [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]. Math in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(ptr, stride_h, nheads, cos, sin, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < nheads) & (d < HALF)
    p1 = ptr + h * stride_h + d
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, H, KVH,
    HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF_PAD)[None, :]
    cmask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=cmask, other=0.0).to(tl.float32)
    _rotate(q_ptr + t * stride_qt, stride_qh, H, cos, sin, HQ_PAD, HALF, HALF_PAD)
    _rotate(k_ptr + t * stride_kt, stride_kh, KVH, cos, sin, HK_PAD, HALF, HALF_PAD)


def rotary_embedding_triton(positions, q, k, cos_sin_cache):
    T, H, D = q.shape
    KVH = k.shape[1]
    if T == 0:
        return
    # q/k may be strided views into the fused qkv output; only the head_dim must be contiguous
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    half = D // 2
    _rotary_kernel[(T,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), H, KVH,
        HQ_PAD=triton.next_power_of_2(H), HK_PAD=triton.next_power_of_2(KVH),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )


def _rotate_ref(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rotary_embedding_ref(positions, q, k, cos_sin_cache):
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)
