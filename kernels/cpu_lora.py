"""Multi-LoRA on CPU at the cost of its FLOPs and bytes: shrink and expand in one C++ pass (kernels/csrc/lora.cpp).

Tiles of up to 8 tokens of one adapter group are the work items, in parallel: each reads its adapter's rank rows
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


def _contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu" else t.to("cpu", dtype).contiguous()


def _group_tensors(meta) -> tuple[torch.Tensor, ...]:
    """token_indices (int64), seg_starts, row_start, ranks (int32), scalings (float32), contiguous: checked once per
    step (the meta is built once per step and read by every LoRA layer). Only the meta's own tensors are kept
    (a static meta updated in place stays current); a meta that needs converted copies gets them every call."""
    cached = meta.host_cache.get("cpu_lora")
    if cached is None:
        own = (meta.token_indices, meta.seg_starts, meta.row_start, meta.ranks, meta.scalings)
        cached = tuple(_contiguous(x, dt) for x, dt in zip(own, (torch.int64,) + (torch.int32,) * 3 + (torch.float32,)))
        if all(a is b for a, b in zip(cached, own)):
            meta.host_cache["cpu_lora"] = cached
    return cached


def lora_apply_cpu(x, y, lora_a, lora_b, slice_offsets, meta):
    """y[tokens of group g] += scaling_g * (x @ A_g^T) @ B_g per output slice, in place; returns y."""
    lib = cpu_ext.load()
    if lib is None or not cpu_ext.usable(x, y, lora_a, lora_b) or x.stride(-1) != 1 or y.stride(-1) != 1 \
            or not lora_a.is_contiguous() or not lora_b.is_contiguous():
        return lora_expand_ref(lora_shrink_ref(x, lora_a, meta), lora_b, slice_offsets, meta, y)
    if meta.num_groups == 0 or meta.token_indices.numel() == 0:
        return y
    offs = _offsets(tuple(int(o) for o in slice_offsets))
    tok, seg, rows, ranks, scal = _group_tensors(meta)
    S, R, K = lora_a.shape
    lib.loom_lora_apply(x.data_ptr(), x.stride(0), lora_a.data_ptr(), S, R, K, lora_b.data_ptr(), lora_b.shape[1],
                        offs.data_ptr(), y.data_ptr(), y.stride(0), tok.data_ptr(), seg.data_ptr(), rows.data_ptr(),
                        ranks.data_ptr(), scal.data_ptr(), meta.num_groups, cpu_ext.nthreads())
    return y
