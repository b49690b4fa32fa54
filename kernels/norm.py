"""fused_add_rms_norm: residual_out = x + residual (or x); out = rmsnorm(residual_out) * weight.

The sum is rounded to the input dtype first (it is the residual stream the next layer adds to, as in HF),
then normalised in float32; both results come back in the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + t * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    r = x.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + t * stride_ro + cols, r, mask=mask)
    r = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (r * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm_triton(x, residual, weight, eps):
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    if T == 0:
        return out, res_out
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    block = triton.next_power_of_2(N)
    _fused_add_rms_norm_kernel[(T,)](
        x, residual if residual is not None else x, weight, out, res_out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        N, eps, HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, res_out


def fused_add_rms_norm_ref(x, residual, weight, eps):
    res_out = x if residual is None else x + residual
    r = res_out.float()
    out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), res_out
