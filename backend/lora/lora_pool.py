"""Device pools of LoRA rank rows and their row allocator.

A LoraPool covers the module groups of one row space (`LoraModelSpec.space`: the dense groups, or the MoE expert
groups), one pool pair per group, stacked over the layers that have the group (and experts, for expert groups):
  a[group]: [group layers, (num_experts,) num_slices, capacity, in_features]
  b[group]: [group layers, (num_experts,) capacity, sum(output_sizes)]
On the CPU each row of K or N elements is stored in kernels/cpu_lora.py's pool_row(K) (a cache line longer where K
is a multiple of 8 lines, so rank rows do not share L1 sets): the pools are views of the first K / N columns.
Module `layers.{i}.<group>` gets the views a[group][j] ([(E,) S, R, in]) and b[group][j] ([(E,) R, sum_out]) as
its `lora_a` / `lora_b`, j = the position of layer i among the group's layers.
An adapter version owns the same contiguous rows [row_start, row_start + rank) in every pool of a space (all its
groups, all layers), rank = its largest module rank among them (`rank_of`); groups or slices it does not target are
written as zeros, so rows need no clearing when freed.
Tensor parallelism: a rank's pools hold its part of each group (`LoraGroupSpec.shard`: all of A and its columns of
B for column-parallel groups, its input columns of A and all of B for row-parallel ones), `write` slices the
adapter's full weights to it, and every rank has the same rows (`make_pools`: the capacity all ranks agree on).
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

from loom.kernels.cpu_lora import pool_row
from loom.kernels.cpu_memory import large_zeros
from loom.lora.adapter_version import EXPERT, SPACE_FIELDS
from loom.lora.load_pace import PIECE_BYTES
from loom.lora.peft_loader import AdapterWeights, LoraModelSpec


class RowAllocator:
    """Contiguous row ranges, first fit, free ranges kept sorted and coalesced."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._starts: list[int] = [0] if capacity > 0 else []
        self._lens: list[int] = [capacity] if capacity > 0 else []
        self.num_free = self.capacity

    def alloc(self, n: int) -> int | None:
        if n <= 0:
            raise ValueError(f"cannot allocate {n} rows")
        for i, ln in enumerate(self._lens):
            if ln >= n:
                start = self._starts[i]
                if ln == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self.num_free -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        if n <= 0 or start < 0 or start + n > self.capacity:
            raise ValueError(f"bad free of rows [{start}, {start + n})")
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > start:
            raise ValueError(f"double free of rows [{start}, {start + n})")
        if i < len(self._starts) and start + n > self._starts[i]:
            raise ValueError(f"double free of rows [{start}, {start + n})")
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == start
        merge_next = i < len(self._starts) and start + n == self._starts[i]
        if merge_prev and merge_next:
            self._lens[i - 1] += n + self._lens[i]
            del self._starts[i], self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += n
        elif merge_next:
            self._starts[i] = start
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)
        self.num_free += n

    def take(self, start: int, n: int) -> None:
        """Allocate exactly rows [start, start + n), which must be free."""
        i = bisect.bisect_right(self._starts, start) - 1
        if n <= 0 or i < 0 or start + n > self._starts[i] + self._lens[i]:
            raise ValueError(f"rows [{start}, {start + n}) are not free")
        s0, ln = self._starts[i], self._lens[i]
        rest = [(fs, fl) for fs, fl in ((s0, start - s0), (start + n, s0 + ln - start - n)) if fl > 0]
        self._starts[i:i + 1] = [fs for fs, _ in rest]
        self._lens[i:i + 1] = [fl for _, fl in rest]
        self.num_free -= n

    @property
    def largest_free(self) -> int:
        return max(self._lens, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lens))


def stored_row(device: torch.device, dtype: torch.dtype) -> Callable[[int], int]:
    """Elements a pool on `device` keeps per row of n: pool_row's padding on the CPU, n elsewhere."""
    if torch.device(device).type == "cpu":
        return lambda n: pool_row(n, dtype)
    return lambda n: n


class LoraPool:
    def __init__(self, spec: LoraModelSpec, capacity: int, device: torch.device, dtype: torch.dtype,
                 row_bytes: int | None = None):
        """row_bytes (tensor parallelism): the largest part of a row any rank's pools hold, what `row_bytes` says
        (a row's cost on the rank where it costs most); None: this pool's."""
        self.spec = spec
        self._row_bytes = row_bytes
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.dtype = dtype
        self.allocator = RowAllocator(self.capacity)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        if self.capacity > 0:
            row = stored_row(self.device, dtype)
            for g in spec.groups:
                lead = (len(spec.layers_of(g)),) + ((g.num_experts,) if g.num_experts else ())
                k, n = g.held_in_features, g.held_out_features
                # on the CPU on huge pages (a decode step with many adapters reads rows all over them), mapped as
                # rows are written: a pool costs memory and start-up time for what is loaded, not for its capacity
                self.a[g.name] = large_zeros((*lead, g.num_slices, self.capacity, row(k)), dtype, self.device,
                                             touch=False)[..., :k]
                self.b[g.name] = large_zeros((*lead, self.capacity, row(n)), dtype, self.device, touch=False)[..., :n]

    @staticmethod
    def row_bytes_for(spec: LoraModelSpec, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes one rank row takes across the pools of `spec` on `device` (with a CPU pool's padding)."""
        return spec.bytes_per_row(dtype, stored_row(device, dtype))

    @staticmethod
    def capacity_for(spec: LoraModelSpec, memory_bytes: int, dtype: torch.dtype, device: torch.device) -> int:
        """Rank rows that fit memory_bytes (0 for a space without groups, e.g. the expert space of a dense model)."""
        per_row = LoraPool.row_bytes_for(spec, dtype, device)
        return int(memory_bytes) // per_row if per_row else 0

    @property
    def row_bytes(self) -> int:
        return self._row_bytes or LoraPool.row_bytes_for(self.spec, self.dtype, self.device)

    def rank_of(self, w: AdapterWeights) -> int:
        """Rows the adapter takes in this pool: its largest module rank among the pool's groups; 0 = none targeted."""
        return max((w.ranks.get(g.name, w.rank) for g in self.spec.groups if g.name in w.a), default=0)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_bytes

    def attach(self, model: torch.nn.Module) -> None:
        """Point the LoRA-capable modules of this pool's groups at their layer's view of the pools."""
        if self.capacity == 0:
            return
        pos = {g.name: {layer: j for j, layer in enumerate(self.spec.layers_of(g))} for g in self.spec.groups}
        for (layer, group), mod in model.lora_modules().items():
            if group in pos:
                mod.lora_a = self.a[group][pos[group][layer]]
                mod.lora_b = self.b[group][pos[group][layer]]
                mod.lora_group = group

    def write(self, row_start: int, w: AdapterWeights, pace: Callable[[], None] | None = None) -> None:
        """Copy an adapter's host weights into rows [row_start, row_start + rank_of(w)) of every pool. pace: called
        between pieces of about PIECE_BYTES (loom.lora.load_pace: the CPU copier's share of the cores)."""
        r = self.rank_of(w)
        if r == 0:
            raise ValueError(f"adapter {w.name!r} targets none of the groups {[g.name for g in self.spec.groups]}")
        if row_start < 0 or row_start + r > self.capacity:
            raise ValueError(f"rows [{row_start}, {row_start + r}) outside the pool of {self.capacity}")
        nb = self.device.type == "cuda"
        for g in self.spec.groups:
            dst_a = self.a[g.name][..., row_start:row_start + r, :]
            dst_b = self.b[g.name][..., row_start:row_start + r, :]
            src_a = w.a.get(g.name)
            if src_a is None:
                dst_a.zero_()
                dst_b.zero_()
            else:  # rows past r of a padded group are zeros: the pool takes only the first r
                src_b = w.b[g.name][..., :r, :]
                if g.shard is not None:  # this rank's part of the full weights
                    src_a, src_b = g.shard.take_a(src_a), g.shard.take_b(src_b)
                src_a = src_a[..., :r, :]
                if pace is None:
                    dst_a.copy_(src_a, non_blocking=nb)
                    dst_b.copy_(src_b, non_blocking=nb)
                    continue
                per_layer = (dst_a[0].numel() + dst_b[0].numel()) * dst_a.element_size()
                step = max(1, PIECE_BYTES // max(1, per_layer))
                for i in range(0, dst_a.shape[0], step):  # a layer range at a time
                    dst_a[i:i + step].copy_(src_a[i:i + step])
                    dst_b[i:i + step].copy_(src_b[i:i + step])
                    pace()

    def read(self, row_start: int, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Host copies of rows (tests / debugging)."""
        a = {k: v[..., row_start:row_start + rank, :].to("cpu", copy=True) for k, v in self.a.items()}
        b = {k: v[..., row_start:row_start + rank, :].to("cpu", copy=True) for k, v in self.b.items()}
        return a, b

    def move(self, src: int, dst: int, n: int) -> None:
        """Move rows [src, src+n) to [dst, dst+n) (ranges may overlap)."""
        if src == dst or n == 0:
            return
        for g in self.spec.groups:
            a, b = self.a[g.name], self.b[g.name]
            a[..., dst:dst + n, :] = a[..., src:src + n, :].clone()
            b[..., dst:dst + n, :] = b[..., src:src + n, :].clone()


def make_pools(config, spec: LoraModelSpec, device: torch.device, dtype: torch.dtype,
               agree: Callable[[int], int] | None = None) -> tuple[LoraPool, LoraPool]:
    """The pools of both row spaces (dense, expert), sized by lora_memory_bytes / lora_expert_memory_bytes.
    agree (tensor parallelism: the minimum over the ranks, a collective every rank makes in this order): the rows
    every rank's pools hold, so that a row number means the same rows on every rank, and the largest part of a row
    a rank holds (uneven shards: 3 KV heads on 2 ranks), which the pools' sizes and refusals quote."""
    pools = []
    for space, field_name in enumerate(SPACE_FIELDS):
        sub = spec.space(expert=space == EXPERT)
        capacity = LoraPool.capacity_for(sub, getattr(config, field_name), dtype, device)
        row = None
        if agree is not None:
            capacity, row = agree(capacity), -agree(-LoraPool.row_bytes_for(sub, dtype, device))
        pools.append(LoraPool(sub, capacity, device, dtype, row))
    return pools[0], pools[1]
