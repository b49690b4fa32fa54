"""The fp8 KV cache's number format (kv_cache_dtype fp8 / fp8_e4m3): float8 e4m3fn codes, one byte per element.

A cache of this format is a torch.uint8 tensor of the usual layout (kernels/kv_layout.py) holding e4m3fn bit patterns
(sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f / 0xff NaN, no infinities, largest finite 448). Bytes rather
than torch.float8_e4m3fn because Triton converts to and from float8e4nv only on sm_89+; the kernels here encode and
decode with bit operations (and a float16 convert), so the same cache runs on sm_80. Each layer has a per-tensor
scale for K and one for V (models/kv_scales.py: the checkpoint's, else 1.0): a stored code is e4m3(x * (1 / scale)),
rounded to nearest even, saturated to +-448, NaN kept as NaN; a read value is decode(code) * scale, then the
activations' dtype.

encode_ref / decode_ref are the references (torch's float8_e4m3fn conversion, which rounds to nearest even and
saturates); e4m3_encode / e4m3_decode are the Triton functions the KV store and attention kernels inline, tested
against them over every code and the rounding midpoints (tests/kernels/test_kv_fp8.py).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite e4m3fn
KV_FP8_STORAGE = torch.uint8  # the cache tensor's dtype under kv_cache_dtype fp8
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8_STORAGE


def inv_scale(scale: float) -> float:
    """1 / scale as float32: encoding multiplies by it (a multiply is exactly rounded on every device; Triton's
    default float division is not)."""
    return float(np.float32(1.0 / scale))


def encode_ref(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x (any float dtype) -> uint8 e4m3fn codes of x * (1 / scale), computed in float32."""
    y = (x.float() * inv_scale(scale)).clamp(-FP8_MAX, FP8_MAX)  # clamp keeps NaN
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def decode_ref(codes: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 e4m3fn codes -> decode(code) * scale (float32), then `dtype`."""
    return (codes.view(torch.float8_e4m3fn).float() * np.float32(scale)).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """K/V rows as `cache` holds them: e4m3 codes of x / scale in an fp8 cache, else x in the cache's dtype."""
    return encode_ref(x, scale) if is_fp8(cache) else x.to(cache.dtype)


def from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K/V read from a cache (x: its elements), in `dtype`: decoded and scaled where x holds e4m3 codes."""
    return decode_ref(x, scale, dtype) if is_fp8(x) else x.to(dtype)


@triton.jit
def e4m3_encode(x):
    """float32 -> uint8 e4m3fn code: round to nearest even, saturate to +-448, NaN -> 0x7f with x's sign."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    nan = x != x
    a = tl.abs(x)
    a = tl.where(nan, 0.0, tl.where(a > 448.0, 448.0, a))
    ab = a.to(tl.uint32, bitcast=True)
    # normal results (|x| >= 2^-6): round the float32 mantissa to 3 bits, nearest even (a carry bumps the exponent;
    # 448 is exact, so the saturated range never rounds past it), rebias the exponent 127 -> 7
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal results: m * 2^-9, m = |x| * 512 rounded to nearest even by the float32 add of 2^23 (|x| * 512 < 8,
    # so the sum's ulp is 1); m = 8 is code 8, the smallest normal
    m = (a * 512.0 + 8388608.0) - 8388608.0
    code = tl.where(a < 0.015625, m.to(tl.uint32), normal)
    code = tl.where(nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_decode(c, scale):
    """uint8 e4m3fn code -> decode(code) * scale in float32. The code's bits placed in a float16 (sign on sign,
    exponent and mantissa at the top of float16's) are the value times 2^-8, subnormals included (float16's exponent
    bias is 8 more than e4m3's and its subnormals reach below e4m3's): a shift, a mask and a convert per element,
    the inner loop's whole decode cost; the 2^8 goes into the scale. NaN codes (0x7f, 0xff) stay NaN."""
    c = c.to(tl.uint16)
    em = c & 0x7F
    v = (((c & 0x80) << 8) | (em << 7)).to(tl.float16, bitcast=True).to(tl.float32) * (scale * 256.0)
    return tl.where(em == 0x7F, float("nan"), v)


@triton.jit
def kv_encode(x, inv_scale, FP8: tl.constexpr, dst_ty: tl.constexpr):
    """A K/V value as the cache holds it: the e4m3 code of x * inv_scale, or x in the cache's dtype."""
    if FP8:
        return e4m3_encode(x.to(tl.float32) * inv_scale)
    return x.to(dst_ty)


@triton.jit
def kv_decode(x, scale, FP8: tl.constexpr, ty: tl.constexpr):
    """A K/V value read from the cache, in `ty` (the activations' dtype)."""
    if FP8:
        return e4m3_decode(x, scale).to(ty)
    return x.to(ty)


@triton.jit
def _codec_kernel(x_ptr, codes_ptr, c_ptr, v_ptr, n, inv_scale, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(codes_ptr + i, e4m3_encode(tl.load(x_ptr + i, mask=mask, other=0.0) * inv_scale), mask=mask)
    tl.store(v_ptr + i, e4m3_decode(tl.load(c_ptr + i, mask=mask, other=0), scale), mask=mask)


def codec_triton(x: torch.Tensor, codes: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tests) The kernels' own functions on flat tensors of one length: (e4m3 codes of x * (1 / scale), as
    encode_ref; decode(codes) * scale in float32, as decode_ref)."""
    assert x.dtype == torch.float32 and codes.dtype == torch.uint8 and x.numel() == codes.numel()
    enc, dec = torch.empty_like(codes), torch.empty_like(x)
    n = x.numel()
    _codec_kernel[(triton.cdiv(n, 1024),)](x, enc, codes, dec, n, inv_scale(scale), scale, BLOCK=1024)
    return enc, dec
