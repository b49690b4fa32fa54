"""Megatron-style tensor-parallel layers: column-parallel (each rank its output rows: its q/k/v heads, its slice of
gate|up), row-parallel (its input columns; one all-reduce of the partial outputs), vocab-parallel embedding (its
vocabulary rows; the other rows' lookups are zeros, one all-reduce) and lm_head (its vocabulary rows; the logits
gathered on rank 0 only).

`tp` is the rank's loom.distributed.parallel_state.ParallelGroup, or None: then the factories below return the
single-device layers (LoRALinear, nn.Embedding, nn.Linear) exactly as without tensor parallelism.

Each layer says which part of a checkpoint tensor it holds (`checkpoint_pieces`: pairs of an index into its own
parameter and an index into the checkpoint tensor, None for rows to zero), so the loader reads only this rank's
slices (loom.models.loader).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loom.errors import ConfigError
from loom.layers.linear import ALL, LoRALinear, LoraShard, Piece


@dataclass(frozen=True)
class Shard:
    """Indices [start, start + size) of a dimension of length `full` (a slice of heads, features or vocabulary)."""

    full: int
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def scaled(self, k: int) -> "Shard":
        return Shard(self.full * k, self.start * k, self.size * k)

    def src(self) -> slice:
        return slice(self.start, self.stop)


def full(n: int) -> Shard:
    return Shard(n, 0, n)


def split(total: int, tp, what: str) -> Shard:
    """This rank's equal share of `total`; `what` names the config field and the architecture for the refusal."""
    if tp is None:
        return full(total)
    n = tp.world_size
    if total % n:
        raise ConfigError("tensor_parallel_size", f"{n} does not divide {what} ({total})")
    size = total // n
    return Shard(total, tp.rank * size, size)


def head_shards(num_heads: int, num_kv_heads: int, tp, arch: str) -> tuple[Shard, Shard]:
    """(query heads, KV heads) of this rank. With at least as many KV heads as ranks each rank takes whole KV groups
    (its KV heads and the query heads that read them), as evenly as the KV heads allow (3 on 2 ranks: 1 and 2);
    with fewer, each KV head is replicated on the ranks whose query heads read it (vLLM's rule)."""
    if tp is None:
        return full(num_heads), full(num_kv_heads)
    n, r = tp.world_size, tp.rank
    if num_kv_heads >= n:
        a, b = r * num_kv_heads // n, (r + 1) * num_kv_heads // n
        g = num_heads // num_kv_heads
        return Shard(num_heads, a * g, (b - a) * g), Shard(num_kv_heads, a, b - a)
    if n % num_kv_heads:
        raise ConfigError("tensor_parallel_size", f"{n} ranks cannot share the {num_kv_heads} KV heads of {arch} "
                          "(a KV head is replicated on a whole number of ranks)")
    return split(num_heads, tp, f"num_attention_heads of {arch}"), Shard(num_kv_heads, r * num_kv_heads // n, 1)


class ColumnParallelLinear(LoRALinear):
    """Output rows split across ranks, per fused slice: slice i holds rows shards[i] of the full projection i."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool = False):
        super().__init__(in_features, [s.size for s in shards], bias=bias)
        self.shards = list(shards)
        self.full_offsets = [0]
        for s in shards:
            self.full_offsets.append(self.full_offsets[-1] + s.full)
        # LoRA: A whole, B's columns of this rank's part of each slice (replicated KV heads: the head it holds)
        self.lora_shard = LoraShard(in_features, tuple(s.full for s in shards), None,
                                    tuple((o + s.start, o + s.stop) for o, s in zip(self.full_offsets, shards)))

    def checkpoint_pieces(self, kind: str, slice_index: int | None) -> list[Piece]:
        """A slice's own tensor (q_proj, gate_proj, ...) or the fused one (Phi-3's qkv_proj, gate_up_proj)."""
        slices = range(len(self.shards)) if slice_index is None else [slice_index]
        pieces = []
        for i in slices:
            s, base = self.shards[i], self.full_offsets[i] if slice_index is None else 0
            pieces.append(((slice(self.slice_offsets[i], self.slice_offsets[i + 1]),),
                           (slice(base + s.start, base + s.stop),)))
        return pieces


class RowParallelLinear(LoRALinear):
    """Input columns split across ranks; the partial outputs summed by one all-reduce. The bias is rank 0's only
    (zeros elsewhere), so the sum adds it once."""

    def __init__(self, shard: Shard, out_features: int, bias: bool, tp):
        super().__init__(shard.size, [out_features], bias=bias)
        self.shard, self.tp = shard, tp
        # LoRA: A's columns of this rank's input, B whole; the delta joins the partial output before the all-reduce
        self.lora_shard = LoraShard(shard.full, (out_features,), (shard.start, shard.stop), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))

    def checkpoint_pieces(self, kind: str, slice_index: int | None) -> list[Piece]:
        if kind == "bias":
            return [(ALL, ALL if self.tp.rank == 0 else None)]
        return [(ALL, (slice(None), self.shard.src()))]


def vocab_shard(vocab: int, tp) -> tuple[Shard, int]:
    """(this rank's real vocabulary rows, rows per rank): the vocabulary padded to a multiple of the ranks."""
    per = -(-vocab // tp.world_size)
    start = min(vocab, tp.rank * per)
    return Shard(vocab, start, min(vocab, start + per) - start), per


def _vocab_pieces(shard: Shard, per_rank: int) -> list[Piece]:
    pieces = [((slice(0, shard.size),), (shard.src(),))]
    if shard.size < per_rank:
        pieces.append(((slice(shard.size, per_rank),), None))  # padding rows: zeros
    return pieces


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp):
        super().__init__()
        self.tp = tp
        self.shard, self.per_rank = vocab_shard(vocab, tp)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        mine = (local >= 0) & (local < self.shard.size)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        x.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def checkpoint_pieces(self, kind: str, slice_index: int | None) -> list[Piece]:
        return _vocab_pieces(self.shard, self.per_rank)


class ParallelLMHead(LoRALinear):
    """This rank's vocabulary rows of lm_head (a LoRALinear so the CPU path packs its weight; no LoRA); returns the
    full logits on rank 0, this rank's columns elsewhere."""

    def __init__(self, hidden: int, vocab: int, tp):
        shard, per_rank = vocab_shard(vocab, tp)
        super().__init__(hidden, [per_rank])
        self.tp, self.shard, self.per_rank, self.vocab = tp, shard, per_rank, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_columns(self._base(x), self.vocab)

    def checkpoint_pieces(self, kind: str, slice_index: int | None) -> list[Piece]:
        return _vocab_pieces(self.shard, self.per_rank)


def column_linear(in_features: int, shards: list[Shard], bias: bool, tp) -> LoRALinear:
    if tp is None:
        return LoRALinear(in_features, [s.full for s in shards], bias=bias)
    return ColumnParallelLinear(in_features, shards, bias=bias)


def row_linear(shard: Shard, out_features: int, bias: bool, tp) -> LoRALinear:
    if tp is None:
        return LoRALinear(shard.full, [out_features], bias=bias)
    return RowParallelLinear(shard, out_features, bias, tp)


def embedding(vocab: int, hidden: int, tp) -> nn.Module:
    if tp is None:
        emb = nn.Embedding(vocab, hidden)
        emb.weight.requires_grad_(False)
        return emb
    return VocabParallelEmbedding(vocab, hidden, tp)


def lm_head(hidden: int, vocab: int, tp) -> nn.Module:
    if tp is None:
        head = nn.Linear(hidden, vocab, bias=False)
        head.weight.requires_grad_(False)
        return head
    return ParallelLMHead(hidden, vocab, tp)
