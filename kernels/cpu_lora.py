"""Multi-LoRA on CPU at the cost of its FLOPs and bytes: shrink and expand in one C++ pass (kernels/csrc/lora.cpp).

Tiles of up to 32 tokens of one adapter group are the work items, in parallel: each reads its adapter's rank rows
of A and B in place in the pools once, and keeps the rank-space products in scratch (no [tokens, rank] buffer
through memory, no gathered copy of x, no [tokens, out] delta). A decode step with one token per adapter and a
prefill chunk of 2,048 tokens on one adapter take the same path. Same result as lora_shrink_ref followed by
lora_expand_ref; anything the C++ kernel does not take runs those references.
"""
from __future__ import annotations

import functools

import torch

from loom.kernels import cpu_ext
from loom.kernels.lora import lora_expand_ref, lora_shrink_ref


@functools.lru_cache(maxsize=64)
def _offsets(slice_offsets: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(slice_offsets, dtype=torch.int64)


def lora_apply_cpu(x, y, lora_a, lora_b, slice_offsets, meta):
    """y[tokens of group g] += scaling_g * (x @ A_g^T) @ B_g per output slice, in place; returns y."""
    lib = cpu_ext.load()
    if lib is None or not cpu_ext.usable(x, y, lora_a, lora_b) or x.stride(-1) != 1 or y.stride(-1) != 1 \
            or not lora_a.is_contiguous() or not lora_b.is_contiguous():
        return lora_expand_ref(lora_shrink_ref(x, lora_a, meta), lora_b, slice_offsets, meta, y)
    if meta.num_groups == 0 or meta.token_indices.numel() == 0:
        return y
    offs = _offsets(tuple(int(o) for o in slice_offsets))
    tok = cpu_ext.contiguous(meta.token_indices, torch.int64)
    seg, rows, ranks = (cpu_ext.contiguous(t, torch.int32) for t in (meta.seg_starts, meta.row_start, meta.ranks))
    scal = cpu_ext.contiguous(meta.scalings, torch.float32)
    S, R, K = lora_a.shape
    lib.loom_lora_apply(x.data_ptr(), x.stride(0), lora_a.data_ptr(), S, R, K, lora_b.data_ptr(), lora_b.shape[1],
                        offs.data_ptr(), y.data_ptr(), y.stride(0), tok.data_ptr(), seg.data_ptr(), rows.data_ptr(),
                        ranks.data_ptr(), scal.data_ptr(), meta.num_groups, cpu_ext.nthreads())
    return y
