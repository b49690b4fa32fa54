"""Row residency: which adapter versions hold rows in the device LoRA pools, and which keep a host copy.

The registry (loom.lora.adapter_registry) owns names and requests; this module owns the memory they take.
Row spaces: the dense groups (attention, dense MLP; pools sized by lora_memory_bytes) and the MoE expert groups
(sized by lora_expert_memory_bytes) have separate pools and allocators. A version holds rows in a space only if it
targets a group there, as many as its largest module rank in that space (known from its config before loading);
allocation (first fit, else compaction, else eviction of the least recently used unpinned holder) runs per space,
so making room in one space never drops the other's rows. A version is device-resident when it has rows in every
space it targets. Host tier: at most max_host_adapters versions that are not device-resident, of at most
max_host_adapter_bytes of weights together (when set), keep their weights in host memory; the least recently used
ones no request holds are dropped (read from disk again on next use). Device-resident versions keep their host copy
too, outside these bounds: the device pools bound them.
Stale versions (unloaded or replaced) are freed here once no request holds them.

Eviction takes the least recently used unpinned holder, those no request holds first (an adapter a queued request
holds is needed again soon). Placing ahead of use (the registry's prefetch) evicts only holders no request holds.
Rows are written off the step's path (loom.lora.row_copies), so that a placement ahead of use overlaps the steps: on
CUDA on a copy stream (after the work already queued, which may still read rows just freed) with an event the step
waits on, on the CPU by a helper thread; `sync` makes a version's copy complete before a step reads its rows (the
registry calls it at activation), and rows are never moved (compaction) while a copy is in flight.

Not thread-safe by itself: the registry calls every method under its lock, on the engine's loop thread or (to
publish a load) on the loader thread.
"""
from __future__ import annotations

from typing import Callable

import torch

from loom.lora.adapter_version import DENSE, EXPERT, SPACE_FIELDS, AdapterVersion
from loom.lora.lora_pool import LoraPool, make_pools
from loom.lora.model_spec import LoraModelSpec
from loom.lora.row_copies import RowCopies
from loom.lora.tp_pools import PeerLog


class RowResidency:
    """The pools of both row spaces and the set of live versions (the registry adds them; they are freed here)."""

    def __init__(self, config, spec: LoraModelSpec, model: torch.nn.Module | None, device: torch.device,
                 dtype: torch.dtype, tp=None, share: Callable[[], float] | None = None):
        """tp: rank 0's tensor-parallel group (loom.distributed.parallel_state.ParallelGroup), or None. share: the CPU
        share of a core loads may take, which paces the CPU copier (loom.lora.load_pace; None: unpaced)."""
        self.config = config
        self.max_host_adapters = int(config.max_host_adapters)
        self.max_host_bytes = int(config.max_host_adapter_bytes)  # 0: the count alone
        self.pools: tuple[LoraPool, LoraPool] = make_pools(config, spec, device, dtype,
                                                           tp.min_int if tp is not None else None)
        if model is not None:
            for pool in self.pools:
                pool.attach(model)
        # tensor parallelism: the rows written and moved here, for the other ranks to repeat before the next step
        self.peer_log = PeerLog(self.pools) if tp is not None else None
        self.versions: set[AdapterVersion] = set()
        self.evictions = [0, 0]  # per space
        self.compactions = [0, 0]
        self.moved_rows = [0, 0]  # rows compactions moved, per space
        self.host_evictions = 0  # host copies dropped by trim_host
        self.device = torch.device(device)
        self.copies = RowCopies(self.device, share=share)  # copies in flight, their order against the steps

    def close(self) -> None:
        self.copies.close()

    def room_error(self, name: str, ranks: list[int]) -> str | None:
        """Why rows of these ranks can never fit their spaces, naming the config field to raise; None if they can."""
        for space, (pool, r) in enumerate(zip(self.pools, ranks)):
            if r <= pool.capacity:
                continue
            field_name, row = SPACE_FIELDS[space], pool.row_bytes
            what = "MoE expert LoRA" if space == EXPERT else "LoRA on attention / dense MLP layers"
            if pool.capacity == 0:
                return (f"adapter {name!r} needs {r} rank rows of {what}, which is disabled: {field_name}="
                        f"{getattr(self.config, field_name)} holds no rank row of this model ({row} bytes each); set "
                        f"{field_name} to at least {r * row} ({r} x {row}) to serve it")
            return (f"adapter {name!r}: rank {r} does not fit the device LoRA pool for {what} ({pool.capacity} rank "
                    f"rows of {row} bytes); raise {field_name} to at least {r * row}")
        return None

    def place(self, v: AdapterVersion, evict_held: bool = True) -> bool:
        """Give v rows in every space it targets and lacks them, written from its host weights (the copy may still be
        in flight: `sync` before a step reads them). evict_held=False: take only free rows or rows of holders no
        request holds. False if a space has no room now: rows taken in the other space stay cached (evictable, not
        pinned)."""
        for space in (DENSE, EXPERT):
            if v.ranks[space] and v.rows[space] < 0:
                start = self._alloc_rows(space, v.ranks[space], evict_held)
                if start is None:
                    return False
                self._write(v, space, start)
                v.rows[space] = start
        return True

    def copying(self, v: AdapterVersion) -> bool:
        """v's rows are still being written by the CPU copier (not ready for a step; RowCopies.busy)."""
        return self.copies.busy(v)

    def sync(self, v: AdapterVersion) -> None:
        """v's rows written before the next step reads them (CUDA: that step's work waits on the device, the host does
        not; CPU: the copier is done with them)."""
        self.copies.sync(v)

    def _write(self, v: AdapterVersion, space: int, start: int) -> None:
        pool, host = self.pools[space], v.host
        if self.peer_log is not None:
            self.peer_log.write(space, start, v.ranks[space], host, v.version)
        self.copies.write(v, lambda: pool.write(start, host, self.copies.pace))

    def maybe_free(self, v: AdapterVersion) -> None:
        """Free a stale version nobody holds (rows + host weights)."""
        if v.stale and v.refcount == 0 and not v.loading and v in self.versions:
            for space, pool in enumerate(self.pools):
                if v.rows[space] >= 0:
                    pool.allocator.free(v.rows[space], v.ranks[space])
                    v.rows[space] = -1
            v.host = None
            self.copies.forget(v)
            self.versions.discard(v)

    def host_tier(self) -> list[AdapterVersion]:
        """The versions in host memory only (what the host bounds apply to)."""
        return [v for v in self.versions if v.host is not None and not v.resident]

    def trim_host(self) -> None:
        """Keep at most max_host_adapters versions, of at most max_host_adapter_bytes (if set), in host memory that
        are not device-resident; drop the least recently used ones no request holds (they are read from disk again
        on next use). Held ones stay even beyond the bounds."""
        held = self.host_tier()
        over = len(held) - self.max_host_adapters
        over_bytes = sum(v.host.nbytes for v in held) - self.max_host_bytes if self.max_host_bytes else 0
        if over <= 0 and over_bytes <= 0:
            return
        for v in sorted((v for v in held if v.refcount == 0 and not v.loading), key=lambda x: x.last_used):
            if over <= 0 and over_bytes <= 0:
                break
            over -= 1
            over_bytes -= v.host.nbytes
            v.host = None
            self.host_evictions += 1
            self.maybe_free(v)

    def info(self) -> dict:
        """Per space: the row keys without a prefix are the dense space's, those with `expert_` the expert space's."""
        out = {}
        for space, pool in enumerate(self.pools):
            pre = "expert_" if space == EXPERT else ""
            out.update({
                f"{pre}capacity_rows": pool.capacity,
                f"{pre}free_rows": pool.allocator.num_free,
                f"{pre}pool_bytes": pool.nbytes,
                f"{pre}row_bytes": pool.row_bytes,
                f"{pre}holders": sum(1 for v in self.versions if v.rows[space] >= 0),  # versions with rows here
                f"{pre}evictions": self.evictions[space],
                f"{pre}compactions": self.compactions[space],
            })
        return out

    def _evict(self, v: AdapterVersion, space: int) -> None:
        """Drop v's rows in one space (its rows in the other space stay)."""
        self.pools[space].allocator.free(v.rows[space], v.ranks[space])
        v.rows[space] = -1
        self.evictions[space] += 1
        self.maybe_free(v)

    def _alloc_rows(self, space: int, n: int, evict_held: bool = True) -> int | None:
        """n contiguous rows in one space: first fit, else a compaction if enough rows are free and one window of n
        rows can be emptied (`_make_room`), else evict the least recently used unpinned holder of rows in this space
        (holders no request holds first; only those unless evict_held) and retry."""
        alloc = self.pools[space].allocator
        start = alloc.alloc(n)
        while start is None:
            if alloc.num_free >= n:
                start = self._make_room(space, n)
                if start is not None:
                    break
            victims = [x for x in self.versions if x.rows[space] >= 0 and x.active == 0
                       and (evict_held or x.refcount == 0)]
            if not victims:
                return None
            self._evict(min(victims, key=lambda x: (x.refcount > 0, x.last_used)), space)
            start = alloc.alloc(n)
        return start

    def _make_room(self, space: int, n: int) -> int | None:
        """Compaction, bounded: the window of n rows whose holders are fewest rows to move, each of them moved into a
        free range outside it (first fit, largest first); the window's rows are then taken -> its start. A compaction
        moves the holders of one window of n rows (fewer than n + max_lora_rank rows: rank 16 on the default model's
        float32 pools, under 32 rows, 2.4 ms on a 2-core Zen 5 VM), never the whole pool (moving half of its 256 MiB
        pool took 20 ms there): it never stalls a step for much longer than writing the adapter it makes room for.
        None: no window can be emptied so (an eviction makes room instead). Rows are read per step: moving them between
        steps is safe (meta built afterwards sees them)."""
        pool = self.pools[space]
        holders = sorted(((v.rows[space], v.ranks[space], v) for v in self.versions if v.rows[space] >= 0),
                         key=lambda h: h[0])
        free = pool.allocator.free_ranges()
        best = None  # (rows moved, window start, [(holder, its first row, its destination)])
        for s in sorted({*(h[0] for h in holders), *(f[0] for f in free)}):
            e = s + n
            if e > pool.capacity:
                break
            inside = [h for h in holders if h[0] < e and h[0] + h[1] > s]
            cost = sum(h[1] for h in inside)
            if best is not None and cost >= best[0]:
                continue
            gaps = []  # the free ranges outside the window [s, e) and outside the holders that move
            lo_busy = min([s] + [h[0] for h in inside])
            hi_busy = max([e] + [h[0] + h[1] for h in inside])
            for fs, fl in free:
                for a, b in ((fs, min(fs + fl, lo_busy)), (max(fs, hi_busy), fs + fl)):
                    if b > a:
                        gaps.append([a, b - a])
            plan = []
            for start, r, v in sorted(inside, key=lambda h: -h[1]):
                gap = next((g for g in gaps if g[1] >= r), None)
                if gap is None:
                    break
                plan.append((v, start, gap[0]))
                gap[0] += r
                gap[1] -= r
            else:
                best = (cost, s, plan)
        if best is None:
            return None
        self.copies.drain()
        alloc = pool.allocator
        for v, src, dst in best[2]:
            r = v.ranks[space]
            alloc.take(dst, r)
            pool.move(src, dst, r)
            if self.peer_log is not None:
                self.peer_log.move(space, src, dst, r)
            alloc.free(src, r)
            v.rows[space] = dst
        alloc.take(best[1], n)
        self.compactions[space] += 1
        self.moved_rows[space] += best[0]
        return best[1]
