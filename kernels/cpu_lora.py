"""Multi-LoRA shrink/expand on CPU at the cost of its FLOPs and bytes.

Decode batches give adapter groups of one or a few tokens each: the C++ kernel (kernels/cpu_ext.py) reads
each group's rank rows of A and B once, in place in the pools, and does the few dot products / row updates
its tokens need, in parallel over groups (a group's tokens are its own, so no two threads write one row of
y). Groups with more than MAX_TOKENS_IN_PLACE tokens (prefill chunks, many requests on one adapter) are
GEMMs over the group's contiguous rank rows, as in the reference. Same signatures and results as
lora_shrink_ref / lora_expand_ref; anything the C++ kernel does not take runs the reference.
"""
from __future__ import annotations

import torch

from loom.kernels import cpu_ext
from loom.kernels.lora import groups, lora_expand_ref, lora_shrink_ref

MAX_TOKENS_IN_PLACE = 8


def _meta_tensors(meta):
    """seg_starts, row_start, ranks (int32) and scalings (float32) as contiguous CPU tensors."""
    def c(t, dt):
        return t if t.dtype == dt and t.is_contiguous() and t.device.type == "cpu" else t.to("cpu", dt).contiguous()
    return (c(meta.seg_starts, torch.int32), c(meta.row_start, torch.int32), c(meta.ranks, torch.int32),
            c(meta.scalings, torch.float32), c(meta.token_indices, torch.int64))


def _fits(lib, *tensors) -> bool:
    return lib is not None and cpu_ext.usable(*tensors) and all(t.stride(-1) == 1 for t in tensors)


def lora_shrink_cpu(x, lora_a, meta, out=None, split_k=None):
    lib = cpu_ext.load()
    if not _fits(lib, x, lora_a) or not lora_a.is_contiguous():
        return lora_shrink_ref(x, lora_a, meta, out=out)
    S, R, K = lora_a.shape
    T_lora = meta.token_indices.shape[0]
    if out is None or not out.is_contiguous():
        out = torch.zeros((S, T_lora, meta.max_rank), dtype=torch.float32, device=x.device)
    G = meta.num_groups
    if T_lora == 0 or G == 0:
        return out
    seg, rows, ranks, _, tok = _meta_tensors(meta)
    lib.loom_lora_shrink(x.data_ptr(), x.stride(0), lora_a.data_ptr(), S, R, K, tok.data_ptr(), out.data_ptr(),
                         out.shape[1], out.shape[2], seg.data_ptr(), rows.data_ptr(), ranks.data_ptr(), G,
                         MAX_TOKENS_IN_PLACE, cpu_ext.nthreads())
    for a, b, row, rank, _ in groups(meta, min_tokens=MAX_TOKENS_IN_PLACE + 1):
        xs = x[meta.token_indices[a:b]]
        out[:, a:b, :rank] = torch.matmul(xs, lora_a[:, row:row + rank].transpose(1, 2))
    return out


def lora_expand_cpu(buf, lora_b, slice_offsets, meta, y):
    lib = cpu_ext.load()
    if not _fits(lib, buf, lora_b, y) or not buf.is_contiguous() or not lora_b.is_contiguous():
        return lora_expand_ref(buf, lora_b, slice_offsets, meta, y)
    G = meta.num_groups
    if meta.token_indices.numel() == 0 or G == 0:
        return y
    offs = [int(o) for o in slice_offsets]
    offs_t = torch.tensor(offs, dtype=torch.int64)
    seg, rows, ranks, scal, tok = _meta_tensors(meta)
    lib.loom_lora_expand(buf.data_ptr(), buf.shape[1], buf.shape[2], lora_b.data_ptr(), lora_b.shape[1], y.data_ptr(),
                         y.stride(0), tok.data_ptr(), offs_t.data_ptr(), len(offs) - 1, seg.data_ptr(),
                         rows.data_ptr(), ranks.data_ptr(), scal.data_ptr(), G, MAX_TOKENS_IN_PLACE,
                         cpu_ext.nthreads())
    for a, b, row, rank, scaling in groups(meta, min_tokens=MAX_TOKENS_IN_PLACE + 1):
        w = lora_b[row:row + rank]
        delta = torch.empty((b - a, offs[-1]), dtype=w.dtype)
        for s in range(len(offs) - 1):
            delta[:, offs[s]:offs[s + 1]] = buf[s, a:b, :rank] @ w[:, offs[s]:offs[s + 1]]
        y.index_add_(0, meta.token_indices[a:b], delta, alpha=scaling)
    return y
