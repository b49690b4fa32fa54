"""FP8 GEMMs for float8_e4m3fn weights (a `QuantizedWeight` of kind "fp8": per-tensor, per-channel or block scales):
y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).

W8A8 (sm_89 and newer: FP8 tensor cores), two launches:
1. dynamic activation quantisation: each program takes one row's group of columns (the whole row, per token; 128
   columns under 128 x 128 block weights, as DeepSeek-V3 / HF fine-grained FP8 quantise activations), finds
   amax = max |x| in float32, scale = max(amax, EPS) / 448 and writes q = clamp(x / scale, +-448) as e4m3 (round to
   nearest even; both divisions IEEE-rounded, div_rn, so the torch reference gives the same bits) and the scale.
   A separate small kernel, not the GEMM's prologue: the scale of a row needs the whole row (or group) before any
   of it can be quantised, so a fused prologue would have every N tile re-read and re-reduce its rows of x (N /
   BLOCK_N times over, a two-pass walk over K before the main loop); the separate kernel reads x once and writes a
   quarter of its bytes again (one byte per element), small next to the weight read.
2. fp8 x fp8 tl.dot with float32 accumulation; the product is scaled by the activation scale (per row) times the
   weight scale (per tensor / output channel), once in the epilogue. With block (or grouped) weight scales the
   K tile lies in one scale group (BLOCK_K divides the block's width), and each tile's partial product is scaled
   by its row's group scale times the block's scale before it is added.
Asked for W8A8 below sm_89, `check_w8a8(capability)` refuses with a ValueError naming the reason; the weight-only
path (w8a8=False) serves there instead.

Weight-only (A16, any GPU and the CPU interpreter): quant_gemm.quant_gemm_triton dequantises the fp8 weight tile in
registers (fp8 -> float32 * scale -> x's dtype) and multiplies in x's dtype.

Under the CPU interpreter (TRITON_INTERPRET=1) the W8A8 path runs as well: the interpreter stores fp8 and computes
the fp8 dot exactly in float32, so the tests check the quantisation bits, the indexing and the scaling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loom.kernels.quant_gemm import quant_gemm_ref, quant_gemm_triton, rows_2d, scale_layout
from loom.models.quant.weight import QuantizedWeight, dequantize

FP8_MAX = 448.0  # largest finite float8_e4m3fn
EPS = 1e-10  # floor of a group's amax: an all-zero row gets a tiny scale, not a division by zero
MIN_W8A8_CAPABILITY = (8, 9)


def check_w8a8(capability: tuple[int, int]) -> None:
    """Raise ValueError unless a GPU of this compute capability has FP8 tensor cores (sm_89: Ada; sm_90: Hopper)."""
    major, minor = capability
    if (major, minor) < MIN_W8A8_CAPABILITY:
        raise ValueError(
            f"FP8 W8A8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); this GPU is sm_{major}"
            f"{minor} (capability {major}.{minor}), where Triton has no float8 dot. Use the weight-only FP8 path "
            "(w8a8=False), which dequantises the weights to the activations' dtype in registers")


@triton.jit
def _quant_act_fp8_kernel(x_ptr, q_ptr, s_ptr, K, group, stride_xm, stride_qm, stride_sm, EPS_: tl.constexpr,
                          FP8_MAX_: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(lo, hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < hi, other=0.0).to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), EPS_), FP8_MAX_)
    tl.store(s_ptr + row * stride_sm + g, scale)
    q_row = q_ptr + row * stride_qm
    for k0 in range(lo, hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < hi, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_), FP8_MAX_)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < hi)


# M follows the step's batch: not specialised on (a new batch size must never mean a new compile while serving)
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsr, stride_wsc, stride_ym,
    group, row_block,
    PER_K_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = m < M
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn  # [1, BN]: W read transposed (K-major, as the MMA wants)
    as_rows = as_ptr + m.to(tl.int64) * stride_asm  # [BM]
    ws_rows = ws_ptr + (n // row_block).to(tl.int64) * stride_wsr  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        a = tl.load(a_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if PER_K_SCALE:  # the tile lies in one scale group: scale its partial product
            g = k0 // group
            sa = tl.load(as_rows + g, mask=mmask, other=0.0)
            sw = tl.load(ws_rows + g * stride_wsc, mask=nmask, other=0.0).to(tl.float32)
            acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
        else:
            acc = tl.dot(a, w, acc)
    if not PER_K_SCALE:
        sa = tl.load(as_rows, mask=mmask, other=0.0)
        sw = tl.load(ws_rows, mask=nmask, other=0.0).to(tl.float32)
        acc = acc * (sa[:, None] * sw[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


# (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the last row takes every larger M
TILES = ((16, 16, 64, 128, 4, 3), (None, 64, 128, 128, 8, 3))


def gemm_tiles(M: int) -> tuple[int, int, int, int, int]:
    for top, *tile in TILES:
        if top is None or M <= top:
            return tuple(tile)
    raise AssertionError("unreachable: the last row takes every M")


def activation_group(qw: QuantizedWeight, K: int) -> int:
    """Input columns per activation scale: K (one per token) unless the weight's scales vary along K (blocks,
    groups), then the weight's scale group, so each K tile has one activation and one weight scale."""
    return K if qw.scale.shape[1] == 1 else scale_layout(qw, K)[3]


def quantize_activation_fp8_triton(x: torch.Tensor, group: int | None = None):
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group)]): x ~= q * scale per (row, group of
    `group` columns; default K, one per token)."""
    M, K = x.shape
    group = group or K
    ng = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, ng), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    x = x if x.stride(-1) == 1 else x.contiguous()
    block = min(triton.next_power_of_2(group), 1024)
    _quant_act_fp8_kernel[(M, ng)](x, q, s, K, group, x.stride(0), q.stride(0), s.stride(0), EPS_=EPS,
                                   FP8_MAX_=FP8_MAX, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return q, s


def quantize_activation_fp8_ref(x: torch.Tensor, group: int | None = None):
    """The same quantisation in torch, bit for bit: scale = max(amax, EPS) / 448, q = e4m3(clamp(x / scale))."""
    M, K = x.shape
    group = group or K
    pad = -K % group
    xg = F.pad(x.float(), (0, pad)).view(M, -1, group)
    s = xg.abs().amax(-1).clamp_min(EPS) / FP8_MAX
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, -1)[:, :K].contiguous(), s


def _w8a8_tiles(M: int, group: int, K: int, tiles):
    bm, bn, bk, warps, stages = gemm_tiles(M)
    if tiles is not None:
        bm, bn, bk = tiles
    if group != K:
        while bk > 32 and group % bk:
            bk //= 2
        if group % bk:
            raise ValueError(f"FP8 W8A8: weight scale groups of {group} input columns are not a multiple of 32 "
                             "(the narrowest fp8 dot tile); use the weight-only FP8 path (w8a8=False)")
    return bm, bn, bk, warps, stages


def fp8_gemm_triton(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, w8a8: bool = True,
                    capability: tuple[int, int] | None = None,
                    tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(qw)^T (+ bias) -> [..., N] in out_dtype (default x's), qw an FP8 QuantizedWeight.
    w8a8: quantise x per token (per 128-column group under block scales) to e4m3 and use the FP8 tensor cores;
    refused below sm_89 (capability: the GPU's, default x's device's; none under the CPU interpreter).
    w8a8=False: weight-only, the fp8 weight dequantised in registers (any GPU, the interpreter).
    tiles: (BLOCK_M, BLOCK_N, BLOCK_K) in place of the table's."""
    if qw.kind != "fp8":
        raise ValueError(f"fp8_gemm takes FP8 weights, got kind {qw.kind!r}")
    if not w8a8:
        return quant_gemm_triton(x, qw, bias, out=out, out_dtype=out_dtype, tiles=tiles)
    if capability is None and x.is_cuda:
        capability = torch.cuda.get_device_capability(x.device)
    if capability is not None:
        check_w8a8(capability)
    if qw.g_idx is not None:
        raise ValueError("FP8 W8A8 does not take an act-order g_idx; use the weight-only FP8 path (w8a8=False)")
    N, K = qw.shape
    assert x.shape[-1] == K, (x.shape, qw.shape)
    x2 = rows_2d(x, K)
    M = x2.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=out_dtype or x.dtype, device=x.device)
    y2 = y.view(-1, N)
    assert y2.stride(-1) == 1
    if M == 0:
        return y
    group = activation_group(qw, K)
    bm, bn, bk, warps, stages = _w8a8_tiles(M, group, K, tiles)
    xq, xs = quantize_activation_fp8_triton(x2, group)
    w = qw.weight
    assert w.stride(-1) == 1
    ws, stride_wsr, row_block, _ = scale_layout(qw, K)
    _fp8_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        xq, xs, w, ws, bias if bias is not None else ws, y2,
        M, N, K,
        xq.stride(0), xs.stride(0), w.stride(0), stride_wsr, ws.stride(1), y2.stride(0),
        group, row_block,
        PER_K_SCALE=group != K, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    return y


def fp8_gemm_ref(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, w8a8: bool = True,
                 capability: tuple[int, int] | None = None,
                 tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """w8a8: x quantised as quantize_activation_fp8_ref does, then a float32 matmul of the dequantised operands
    (q * scale each); else quant_gemm_ref. capability and tiles: ignored (the kernel's signature)."""
    if not w8a8:
        return quant_gemm_ref(x, qw, bias, out=out, out_dtype=out_dtype)
    N, K = qw.shape
    x2 = x.reshape(-1, K)
    group = activation_group(qw, K)
    xq, xs = quantize_activation_fp8_ref(x2, group)
    a = xq.float() * xs.repeat_interleave(group, 1)[:, :K]
    y = F.linear(a, dequantize(qw, torch.float32).to(x.device), None if bias is None else bias.float())
    y = y.view(*x.shape[:-1], N).to(out_dtype or x.dtype)
    return y if out is None else out.copy_(y)
