"""Multi-LoRA on CPU at the cost of its FLOPs and bytes: shrink and expand in one C++ pass (kernels/csrc/lora.cpp).

Tiles of up to 32 tokens of one adapter group are the work items, in parallel: each reads its adapter's rank rows
of A and B in place in the pools once, and keeps the rank-space products in scratch (no [tokens, rank] buffer
through memory, no gathered copy of x, no [tokens, out] delta). A decode step with one token per adapter and a
prefill chunk of 2,048 tokens on one adapter take the same path. Same result as lora_shrink_ref followed by
lora_expand_ref, which kernels/dispatch.py runs for what `takes` refuses.

A layer whose weight is packed for the C++ GEMM (kernels/cpu_linear.py) calls linear_lora_cpu instead: the GEMM
adds the deltas of groups of FUSE_MIN_TOKENS or more tokens to its output tiles while they are in cache (a
prefill chunk's output is not read back from memory for its LoRA); smaller groups (decode) take the pass above,
interleaved with the GEMM's panels (the GEMM's tiles fetch the next work item's adapter rows while their FMAs run:
the pass's bytes stream while the GEMM is bound by its FMAs). Bitwise the same as the GEMM followed by
lora_apply_cpu.
"""
from __future__ import annotations

import functools

import torch

from loom.kernels import cpu_ext
from loom.kernels.cpu_linear import gemm, row_block

# groups of at least this many tokens get their deltas in the GEMM's output tiles (fewer: their own pass)
FUSE_MIN_TOKENS = 16


def pool_row(n: int, dtype: torch.dtype) -> int:
    """Elements a CPU adapter pool keeps per row of n: n, and one cache line more where n's bytes are a multiple
    of 8 lines. Rows a multiple of 4 KiB apart (hidden sizes of 1,024, 2,048, 4,096; the default model's gate|up
    of 3,072) put the same column of every rank row in one L1 set, and the kernels read a tile's rank rows together.
    Zen 5 core, rank 16: a decode token's pass item, rows in L2, 3,072 columns 6.45 -> 2.95 us and 4,096 x 4,096
    11.40 -> 5.88 us; a decode step of 4,096-wide q|k|v and o, 32 tokens on 32 adapters, LoRA's added time 6.64 ->
    6.46 ms (one thread) and 3.95 -> 3.48 (two); the default model's decode step: no change."""
    line = 64 // torch.empty((), dtype=dtype).element_size()
    return n + line if n % (8 * line) == 0 else n


_ARG_DTYPES = (torch.int64, torch.int32, torch.int32, torch.int32, torch.float32)


@functools.lru_cache(maxsize=64)
def offsets_tensor(slice_offsets: tuple[int, ...]) -> torch.Tensor:
    """A layer's slice column offsets as the kernels read them (int64), one tensor per distinct tuple."""
    return torch.tensor(slice_offsets, dtype=torch.int64)


def takes(x, lora_a, lora_b, y=None) -> bool:
    """Whether the C++ LoRA kernels take these tensors (x and y float32 CPU with contiguous rows, pools in rows of
    an element type cpu_ext.ADAPTER_TYPES lists: cpu_ext.adapter_type)."""
    return (cpu_ext.usable(x) and x.stride(-1) == 1
            and (y is None or (cpu_ext.usable(y) and y.stride(-1) == 1))
            and cpu_ext.adapter_type(lora_a, lora_b) is not None)


def takes_bf16(x, lora_a, lora_b, y) -> bool:
    """Whether lora_apply_cpu_bf16 takes these: bfloat16 x and y on CPU in contiguous rows, pools as takes says."""
    return (x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16 and x.is_cpu and y.is_cpu and x.dim() == 2
            and y.dim() == 2 and x.stride(-1) == 1 and y.stride(-1) == 1
            and cpu_ext.adapter_type(lora_a, lora_b) is not None)


def lora_apply_cpu_bf16(x, y, lora_a, lora_b, slice_offsets, meta):
    """lora_apply_cpu on bfloat16 rows, in place in y: bitwise what widening x and y to float32 (exact), the float32
    pass and rounding y back to bfloat16 give (rows without an adapter come back as they were), but only the adapter
    tokens' rows are widened, in C++ (kernels/csrc/lora.cpp run_pass_bf16, which the bfloat16 C++ layer runs too).
    The bfloat16 reference's per-group torch ops cost ~32 small matmuls a linear at 32 adapters (bench_lora's setting
    did not finish in 10 minutes)."""
    if meta.num_groups == 0 or meta.token_indices.numel() == 0:
        return y
    offs, tok, seg, rows, ranks, scal = _groups(meta, slice_offsets)
    S, R, K = lora_a.shape
    cpu_ext.built().loom_lora_apply_bf16(
        x.data_ptr(), x.stride(0), lora_a.data_ptr(), cpu_ext.ADAPTER_TYPES[lora_a.dtype], S, R, K, lora_a.stride(1),
        lora_b.data_ptr(), lora_b.shape[1], lora_b.stride(0), offs.data_ptr(), y.data_ptr(), y.stride(0),
        tok.data_ptr(), seg.data_ptr(), rows.data_ptr(), ranks.data_ptr(), scal.data_ptr(), meta.num_groups,
        cpu_ext.nthreads())
    return y


def group_arrays(meta) -> tuple:
    """The index arrays the kernels read: token indices, segments, rows, ranks, scalings. Every layer of a step
    reads the same meta: the arrays are kept on it when they are its own tensors (no copy made), so they stay valid
    even where the meta's buffers are rewritten in place (the CUDA-graph path's static meta)."""
    args = meta.kernel_args
    if args is None:
        own = (meta.token_indices, meta.seg_starts, meta.row_start, meta.ranks, meta.scalings)
        args = tuple(cpu_ext.contiguous(t, dt) for t, dt in zip(own, _ARG_DTYPES))
        if all(a is t for a, t in zip(args, own)):
            meta.kernel_args = args
    return args


def _groups(meta, slice_offsets):
    """group_arrays, after the slice offsets."""
    return (offsets_tensor(tuple(slice_offsets)), *group_arrays(meta))


def lora_apply_cpu(x, y, lora_a, lora_b, slice_offsets, meta):
    """y[tokens of group g] += scaling_g * (x @ A_g^T) @ B_g per output slice, in place; returns y."""
    if meta.num_groups == 0 or meta.token_indices.numel() == 0:
        return y
    offs, tok, seg, rows, ranks, scal = _groups(meta, slice_offsets)
    S, R, K = lora_a.shape
    lib = cpu_ext.built()
    lib.loom_lora_apply(x.data_ptr(), x.stride(0), lora_a.data_ptr(), cpu_ext.ADAPTER_TYPES[lora_a.dtype], S, R, K,
                        lora_a.stride(1), lora_b.data_ptr(), lora_b.shape[1], lora_b.stride(0), offs.data_ptr(),
                        y.data_ptr(), y.stride(0), tok.data_ptr(), seg.data_ptr(), rows.data_ptr(), ranks.data_ptr(),
                        scal.data_ptr(), meta.num_groups, cpu_ext.nthreads())
    return y


def linear_lora_cpu(x, panels, bias, out_features, lora_a, lora_b, slice_offsets, meta, lib):
    """The packed GEMM (kernels/cpu_linear.py; `lib` the library that packed the panels) plus the LoRA deltas of
    meta's groups: bitwise what lora_apply_cpu adds to its output, but a group of at least FUSE_MIN_TOKENS tokens
    (a prefill chunk) has its deltas added to each GEMM output tile while the tile is in cache, so y (2,048 tokens
    x 3,072 columns is 25 MB) is not read back from memory and written again for them. The caller checked
    takes(x, lora_a, lora_b) (layers/linear.py)."""
    shape = x.shape
    flat = len(shape) == 2
    x2 = x if flat else x.reshape(-1, shape[-1])
    if meta.num_groups == 0 or meta.token_indices.numel() == 0:
        return gemm(lib, x, panels, bias, out_features)
    offs, tok, seg, rows, ranks, scal = _groups(meta, slice_offsets)
    S, R, K = lora_a.shape
    T = x2.shape[0]
    y = torch.empty((T, out_features), dtype=torch.float32)
    lib.loom_gemm_lora(x2.data_ptr(), x2.stride(0), T, K, panels.data_ptr(), out_features,
                       None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), lora_a.data_ptr(),
                       cpu_ext.ADAPTER_TYPES[lora_a.dtype], R, lora_a.stride(1), lora_b.data_ptr(), lora_b.stride(0),
                       offs.data_ptr(), S, tok.data_ptr(),
                       seg.data_ptr(), rows.data_ptr(), ranks.data_ptr(), scal.data_ptr(), meta.num_groups,
                       FUSE_MIN_TOKENS, row_block(T, K), cpu_ext.nthreads())
    return y if flat else y.view(*shape[:-1], out_features)
