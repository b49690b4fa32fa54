"""Weight-only quantized GEMM (W4A16 / W8A16, and FP8 weights under 16-bit activations):
y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), for a `QuantizedWeight` exactly as the loader produces it
(loom.models.quant.weight: integers packed into int32 along the input dimension, unsigned, unpacked zero points;
scales per tensor / channel / group / block; optional GPTQ act-order g_idx; FP8 float8_e4m3fn with its scales).

Each program owns a BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps:
- the x tile [BLOCK_M, BLOCK_K] is loaded in its own dtype;
- the weight tile is read transposed, [BLOCK_K, BLOCK_N]: its BLOCK_K / (32 / bits) int32 words per output column
  (each loaded once) are unpacked in registers, q = (word >> bits * j) & (2**bits - 1) for j < 32 / bits, and
  reshaped so that k = word * (32 / bits) + j; FP8 bytes are read the same way, four to a word (as 8-bit ints),
  or one uint8 each when a row is no whole number of words;
- it is dequantised in float32, w = (q - zero) * scale (FP8: w = fp8 * scale, the e4m3 bytes decoded by integer
  arithmetic, exact, so the same kernel runs on sm_80, which has no float8 type), rounded to x's dtype (the weight
  dequantize(qw, x.dtype) would give, so the dot's inputs are the reference's), and accumulated by tl.dot in float32;
- the epilogue adds the bias in float32 and casts to the output dtype.

Scales: the scale row of output column n is n // row_block (row_block: block[0] for block-wise, 1 per channel; a
single row, per tensor, is read with row stride 0); the scale column of input column k is g_idx[k] (act-order),
else k // group (group: group_size, block[1], or K for one group per row). When no g_idx is given and the group is
a multiple of BLOCK_K (group 128, per channel, 128-wide blocks), every K tile lies in one group: the program loads
one scale (and zero point) per output column per tile. Otherwise (act-order, or groups narrower than the tile) it
gathers them per (k, n) element.

Act-order choice: a per-column group gather, not a permuted-K variant. Permuting K (sorting the input columns by
group, as exllama / Marlin do) needs the packed weight repacked in that order at load time and x's columns gathered
by the same permutation on every call; the gather keeps the checkpoint layout as it is (the point of
QuantizedWeight), costs one small int32 load of g_idx per K tile plus scale / zero loads per weight element, which
hit L1 / L2 (the scales of one row are a few hundred bytes), and is used only when the checkpoint has a g_idx that
is not the plain k // group_size (the GPTQ reader already drops a trivial one).

Tiles come from a small table by M (no autotune: a new M must never mean a new benchmark run while serving): decode
batches (M <= 16) use 16-row tiles, narrow in N, deep in K (memory bound: many programs, few K steps); prefill uses
64 x 128 tiles that reuse each dequantised weight tile across 64 rows. float32 activations use shallower tiles (an
ieee fp32 dot of 128-deep tiles spills).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loom.models.quant.weight import QuantizedWeight, dequantize


@triton.jit
def _e4m3_to_f32(b):
    """float8_e4m3fn bytes (int32, 0..255) -> float32, exactly, in integer arithmetic (sm_80 has no float8 type):
    exponent e (bias 7), mantissa m; normal (e > 0): (8 + m) * 2**(e - 10), subnormal: m * 2**-9. The power of two is
    built as a float32 bit pattern ((e + 117) << 23: always a normal float32), then the sign bit is set. NaN (0x7f,
    0xff) is not decoded (no quantized weight holds it)."""
    e = (b >> 3) & 0xF
    m = b & 0x7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)
    v = (mant * pow2).to(tl.int32, bitcast=True) | ((b & 0x80) << 24)  # the sign bit
    return v.to(tl.float32, bitcast=True)


# M follows the step's batch: not specialised on (a new batch size must never mean a new compile while serving)
@triton.jit(do_not_specialize=["M"])
def _quant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sr, stride_sc, stride_ym,
    group, row_block,
    BITS: tl.constexpr, IS_FP8: tl.constexpr, BYTES: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr,
    TILE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = m < M
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn  # [1, BN]: W read transposed
    s_row = (n // row_block) * stride_sr  # [BN] (scale tensors are small: int32 offsets)
    PER: tl.constexpr = 32 // BITS
    KW = (K + PER - 1) // PER  # words per row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        xt = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        if BYTES:  # one uint8 a weight (FP8 rows that are no whole number of int32 words)
            q = tl.load(w_cols + k[:, None], mask=wmask, other=0).to(tl.int32)
        else:  # the tile's BLOCK_K / PER words, each unpacked to PER consecutive k
            kw = k0 // PER + tl.arange(0, BLOCK_K // PER)
            word = tl.load(w_cols + kw[:, None], mask=(kw < KW)[:, None] & nmask[None, :], other=0)
            q = (word[:, None, :] >> (tl.arange(0, PER) * BITS)[None, :, None]) & ((1 << BITS) - 1)
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))  # [BK // PER, PER, BN] -> [BK, BN], k = word * PER + j
        if TILE_GROUP:  # one scale column for the whole K tile
            s_off = s_row + (k0 // group) * stride_sc  # [BN]
            scale = tl.load(s_ptr + s_off, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZERO:
                zero = tl.load(z_ptr + s_off, mask=nmask, other=0)[None, :]
        else:
            if HAS_GIDX:
                g = tl.load(g_ptr + k, mask=kmask, other=0)
            else:
                g = k // group
            s_off = s_row[None, :] + g[:, None] * stride_sc  # [BK, BN]
            scale = tl.load(s_ptr + s_off, mask=wmask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                zero = tl.load(z_ptr + s_off, mask=wmask, other=0)
        if IS_FP8:  # e4m3 bytes (no float8 type below sm_89)
            w = _e4m3_to_f32(q)
        else:
            if HAS_ZERO:
                w = (q - zero).to(tl.float32)
            else:
                w = (q - (1 << (BITS - 1))).to(tl.float32)
        w = (w * scale).to(x_ptr.dtype.element_ty)
        acc += tl.dot(xt, w, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


# (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the last row takes every larger M
TILES = {
    "half": ((16, 16, 32, 128, 4, 4), (None, 64, 128, 64, 8, 3)),
    "float32": ((16, 16, 32, 32, 4, 3), (None, 64, 64, 32, 4, 3)),
}


def gemm_tiles(M: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows of `dtype` activations."""
    for top, *tile in TILES["float32" if dtype == torch.float32 else "half"]:
        if top is None or M <= top:
            return tuple(tile)
    raise AssertionError("unreachable: the last row of each table takes every M")


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as tf32 on GPU; half types ignore this setting
    return "ieee" if dtype == torch.float32 else "tf32"


def scale_layout(qw: QuantizedWeight, K: int) -> tuple[torch.Tensor, int, int, int]:
    """(scale, row stride, row_block, group): qw's scale, contiguous (as the loader makes it; the zero points, of the
    same shape, are read at the same offsets), and how the kernels index it: scale row n // row_block (row stride 0
    for a single row), scale column k // group (or g_idx[k])."""
    scale = qw.scale.contiguous()
    rows, cols = scale.shape
    if qw.block is not None:
        return scale, scale.stride(0), qw.block[0], qw.block[1]
    group = qw.group_size if cols > 1 and qw.group_size else K
    return scale, (scale.stride(0) if rows > 1 else 0), 1, group


def rows_2d(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quant_gemm_triton(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (float32 / float16 / bfloat16) @ dequant(qw)^T (+ bias) -> [..., N] in out_dtype (default x's).
    qw: integer (4/8-bit) or FP8 weights, dequantised in registers (weight-only: x stays in its dtype).
    tiles: (BLOCK_M, BLOCK_N, BLOCK_K) in place of the table's (powers of two >= 16)."""
    N, K = qw.shape
    assert x.shape[-1] == K, (x.shape, qw.shape)
    assert qw.kind in ("int", "fp8") and (qw.kind == "fp8" or qw.bits in (4, 8)), (qw.kind, qw.bits)
    x2 = rows_2d(x, K)
    M = x2.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=out_dtype or x.dtype, device=x.device)
    y2 = y.view(-1, N)
    assert y2.stride(-1) == 1
    if M == 0:
        return y
    bm, bn, bk, warps, stages = gemm_tiles(M, x.dtype)
    if tiles is not None:
        bm, bn, bk = tiles
    w = qw.weight
    assert w.stride(-1) == 1
    fp8_bytes = False
    if qw.kind == "fp8":  # e4m3 bytes, four to an int32 word (little-endian: byte j at bit shift 8 * j) if they fit
        fp8_bytes = K % 4 != 0 or w.stride(0) % 4 != 0 or w.storage_offset() % 4 != 0
        w = w.view(torch.uint8) if fp8_bytes else w.view(torch.int32)
    scale, stride_sr, row_block, group = scale_layout(qw, K)
    zero = None if qw.zero is None else qw.zero.contiguous()
    g_idx = qw.g_idx
    tile_group = g_idx is None and group % bk == 0
    if not tile_group and tiles is None:
        bk //= 2  # per-element scale (and zero point) gathers: half the K tile keeps their pointers in registers
    dummy = scale  # never read: a pointer argument the flags switch off
    _quant_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x2, w, scale, zero if zero is not None else dummy, g_idx if g_idx is not None else dummy,
        bias if bias is not None else dummy, y2,
        M, N, K,
        x2.stride(0), w.stride(0), stride_sr, scale.stride(1), y2.stride(0),
        group, row_block,
        BITS=8 if qw.kind == "fp8" else qw.bits, IS_FP8=qw.kind == "fp8", BYTES=fp8_bytes, HAS_ZERO=zero is not None,
        HAS_GIDX=g_idx is not None, TILE_GROUP=tile_group, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )
    return y


def quant_gemm_ref(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(qw, x.dtype), bias) computed in float32 (the weight rounded to x's dtype, as the
    kernel's dot inputs are), cast to out_dtype (default x's). tiles: ignored (the kernel's signature)."""
    w = dequantize(qw, x.dtype).to(x.device).float()
    y = F.linear(x.float(), w, None if bias is None else bias.float()).to(out_dtype or x.dtype)
    return y if out is None else out.copy_(y)
