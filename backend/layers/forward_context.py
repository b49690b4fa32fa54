"""The one piece of per-step global state: attention and LoRA metadata for the current forward.

The model runner sets it before the forward and clears it after; layers read it instead of
threading metadata through every signature.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class LoraBatchMeta:
    """Which tokens of the step use which resident adapter (built once per step by the model runner).

    Tokens are gathered per adapter by index: group g owns token_indices[seg_starts[g]:seg_starts[g+1]];
    its adapter's rank rows in every LoRA pool are [row_start[g], row_start[g] + ranks[g]).
    Tokens without an adapter appear in no group. The step's meta groups the adapters with rows in the dense pools
    (attention, dense MLP; it may have no group at all); `experts` is the same for the MoE expert pools, a separate
    row space: only the tokens of adapters that target experts, with their expert rows.
    """

    token_indices: torch.Tensor  # [T_lora] int64
    seg_starts: torch.Tensor  # [G+1] int32 (on device)
    row_start: torch.Tensor  # [G] int32
    ranks: torch.Tensor  # [G] int32
    scalings: torch.Tensor  # [G] float32
    max_rank: int
    max_seg_len: int
    seg_starts_cpu: list[int] | None = None  # host copies, so CPU references need no device sync
    row_start_cpu: list[int] | None = None
    ranks_cpu: list[int] | None = None
    scalings_cpu: list[float] | None = None
    versions_cpu: list[int] | None = None  # the groups' adapter versions (tensor parallelism: every rank checks them)
    # Module groups (qkv_proj, o_proj, gate_up_proj, down_proj; experts_* in `experts`) that some adapter of the
    # step targets; the others skip LoRA entirely (PEFT's default adapters touch only q and v). None = all.
    module_groups: frozenset[str] | None = None
    experts: "LoraBatchMeta | None" = None  # the expert-row grouping; None = no adapter of the step targets experts
    # the index tensors as the C++ kernels take them, kept by the step's first CPU LoRA call for the layers after it
    # (kernels/cpu_lora.py: ~10 us a call, 120 calls a step for a 30-layer model); they alias the fields above, so
    # those are rewritten in place, never reassigned, once a meta is in use
    kernel_args: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return int(self.row_start.numel())


@dataclass
class AttentionMeta:
    """Paged-attention metadata for one part of the batch (the decodes, or the prefills/extends)."""

    cu_seqlens_q: torch.Tensor  # [S+1] int32, relative to the part's first token
    seq_lens: torch.Tensor  # [S] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class ForwardContext:
    """Flattened, padding-free batch of T tokens from S sequences.

    Decode sequences come first: sequences [0, num_decode_seqs) have exactly one query token each,
    which are tokens [0, num_decode_seqs). The remaining sequences are prefills/extends (any q length).
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 (block * block_size + offset; -1 = do not store)
    num_decode_seqs: int
    decode: AttentionMeta | None
    prefill: AttentionMeta | None
    logits_indices: torch.Tensor  # [S_sampled] int64: rows of the hidden states that get sampled
    lora: LoraBatchMeta | None = None


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context is set: model layers must run inside ModelRunner.forward")
    return _CONTEXT


@contextmanager
def forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
