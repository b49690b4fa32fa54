"""Tensor parallelism: every rank's LoRA pools hold the same adapter rows as rank 0's, each its own part of them.

Rank 0's residency (loom.lora.residency) decides which rows an adapter version takes; it writes its own part and
notes each write (with the adapter's full host weights) and each move (compaction) in its PeerLog. The next step's
broadcast (loom.distributed.step_broadcast) carries what the log holds; each other rank repeats the writes and moves,
in order, on its PeerPools before that step's forward - slicing its own part of the full weights as rank 0 does
(LoraPool.write, LoraGroupSpec.shard). So a step never reads a row on one rank that holds another adapter version
than rank 0's: load / reload / unload / eviction change rows only through writes rank 0 sends with the next step,
and workers never read adapter files (nothing can differ from what rank 0 read, a remote source included). Each
worker also keeps which version each row holds, and checks the rows a step reads against the versions rank 0's step
names (LoraBatchMeta.versions_cpu) before its forward: a mismatch stops the worker (and so the engine, naming the
rank) rather than letting a request run with rows of another version.

The wire: `desc`, 6 integers an operation, (WRITE, space, first row, rank, mask of the space's groups sent, adapter
version) or (MOVE, space, from, to, rows, 0); `weights`, the bytes of the written groups' A [.., rank, in] then
B^T [.., rank, out] in the full model's shapes, in operation and group order.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from loom.layers.forward_context import LoraBatchMeta
from loom.lora.lora_pool import LoraPool, make_pools
from loom.lora.model_spec import LoraGroupSpec, LoraModelSpec
from loom.lora.peft_loader import AdapterWeights

WRITE, MOVE = 0, 1
OP_LEN = 6


def _lead(spec: LoraModelSpec, g: LoraGroupSpec) -> tuple[int, ...]:
    return (len(spec.layers_of(g)),) + ((g.num_experts,) if g.num_experts else ())


class PeerLog:
    """Rank 0: the rows its pools had written and moved since the last step, for the other ranks."""

    def __init__(self, pools: tuple[LoraPool, LoraPool]):
        self.pools = pools
        self._ops: list[tuple] = []
        self._lock = threading.Lock()

    def write(self, space: int, start: int, rank: int, w: AdapterWeights, version: int) -> None:
        with self._lock:
            self._ops.append((WRITE, space, start, rank, w, version))

    def move(self, space: int, src: int, dst: int, n: int) -> None:
        with self._lock:
            self._ops.append((MOVE, space, src, dst, n, 0))

    def take(self) -> tuple[list[int], torch.Tensor | None] | None:
        """(desc, weights as bytes or None) of what happened since the last take; None: nothing."""
        with self._lock:
            ops, self._ops = self._ops, []
        if not ops:
            return None
        desc: list[int] = []
        parts: list[torch.Tensor] = []
        for kind, space, x, y, z, version in ops:
            if kind == MOVE:
                desc += [MOVE, space, x, y, z, 0]
                continue
            r, w, mask = y, z, 0
            for i, g in enumerate(self.pools[space].spec.groups):
                if g.name in w.a:
                    mask |= 1 << i
                    parts += [w.a[g.name][..., :r, :].reshape(-1), w.b[g.name][..., :r, :].reshape(-1)]
            desc += [WRITE, space, x, r, mask, version]
        return desc, torch.cat(parts).view(torch.uint8) if parts else None


class PeerPools:
    """Ranks 1..N-1: this rank's pools, attached to its model, made as rank 0's residency makes its own (the capacity
    agreed: `agree` is the group's minimum, the same collectives in the same order)."""

    def __init__(self, config, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, agree):
        self.dtype = dtype
        self.pools = make_pools(config, LoraModelSpec.from_model(model), device, dtype, agree)
        for pool in self.pools:
            pool.attach(model)
        self.owner = [np.zeros(pool.capacity, np.int64) for pool in self.pools]  # per row: the version it holds

    def apply(self, desc: list[int], weights: torch.Tensor | None) -> None:
        """Repeat rank 0's writes and moves, in order."""
        flat = weights.view(self.dtype) if weights is not None else None
        at = 0
        for i in range(0, len(desc), OP_LEN):
            kind, space, x, y, z, version = desc[i:i + OP_LEN]
            pool, owner = self.pools[space], self.owner[space]
            if kind == MOVE:
                pool.move(x, y, z)
                owner[y:y + z] = owner[x:x + z].copy()
                continue
            r, a, b = y, {}, {}
            for gi, g in enumerate(pool.spec.groups):
                if not z >> gi & 1:
                    continue
                lead = _lead(pool.spec, g)
                for out, shape in ((a, (*lead, g.num_slices, r, g.in_features)), (b, (*lead, r, g.out_features))):
                    n = math.prod(shape)
                    out[g.name] = flat[at:at + n].view(shape)
                    at += n
            pool.write(x, AdapterWeights("", "", r, 1.0, a, b, ranks={name: r for name in a}))
            owner[x:x + r] = version
        sent = 0 if flat is None else flat.numel()
        if at != sent:
            raise RuntimeError(f"LoRA rows from rank 0: {at} weights read of {sent} sent")

    def check(self, meta: LoraBatchMeta | None) -> None:
        """Raise unless the rows the step reads hold, here, the adapter versions rank 0's step names."""
        for space, m in enumerate((meta, meta.experts) if meta is not None else ()):
            if m is None or not m.versions_cpu:
                continue
            owner = self.owner[space]
            for start, r, version in zip(m.row_start_cpu, m.ranks_cpu, m.versions_cpu):
                held = owner[start:start + r]
                if version and (held.shape[0] != r or (held != version).any()):
                    raise RuntimeError(f"LoRA rows [{start}, {start + r}) of row space {space} hold adapter versions "
                                       f"{sorted(set(held.tolist()))}, the step reads version {version}")
