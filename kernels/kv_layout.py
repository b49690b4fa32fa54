"""The paged KV cache's layout, decided here for every reader and writer (Triton, C++, the references, the engine).

Per layer, K and V are each `[num_blocks, num_kv_heads, block_size, head_dim]`: one kv head's rows of a block are one
contiguous block_size * head_dim run, so a decode program (one sequence, one kv head) reads a key tile as one run
instead of block_size strided head_dim rows. A slot is still block * block_size + offset in the block.
"""
from __future__ import annotations

import torch


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    return num_blocks, num_kv_heads, block_size, head_dim


def block_size_of(cache: torch.Tensor) -> int:
    return cache.shape[2]


def kv_heads_of(cache: torch.Tensor) -> int:
    return cache.shape[1]


def cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, position in the block, kv head) strides, in elements; head_dim is contiguous."""
    return cache.stride(0), cache.stride(2), cache.stride(1)


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at `slots` (int64, >= 0): [n, num_kv_heads, head_dim] (a copy)."""
    bs = block_size_of(cache)
    return cache[slots // bs, :, slots % bs]


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache at `slots` (int64, >= 0, distinct) = rows [n, num_kv_heads, head_dim], in place."""
    bs = block_size_of(cache)
    cache[slots // bs, :, slots % bs] = rows.to(cache.dtype)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks block_ids [N, nb] of each sequence, head-major: [N, num_kv_heads, nb * block_size, head_dim]."""
    N, nb = block_ids.shape
    _, kvh, bs, d = cache.shape
    # index_select copies whole blocks (about 2x faster than advanced indexing on CPU)
    blocks = cache.index_select(0, block_ids.flatten()).view(N, nb, kvh, bs, d)
    return blocks.transpose(1, 2).reshape(N, kvh, nb * bs, d)
