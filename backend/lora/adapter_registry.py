"""Adapters by name: versions, host cache, device residency (LRU), background disk loads, batch metadata.

Threading: every public method is meant for the engine's loop thread. A single background thread reads
adapters from disk into host memory; it takes the registry lock only to publish the result (and does no
device work), so the loop thread never waits for disk I/O.

Lifecycle of a version (one per load/reload of a name; `version` is unique per version):
  loading -> host (weights in host memory) <-> device (rows in the pools; keeps its host copy) -> ...
  A version not referenced by any request may drop its host copy ("disk") beyond max_host_adapters and
  is read again on next use (refused if the files changed in between: reload picks up new weights).
  unload/reload make the old version stale; it is freed when its last ref is released.

Request flow (engine):
  ref = reg.acquire(name)           # at add_request; RequestError("lora_name", ...) if unknown/bad
  if ref.error: fail the request     # a background load failed
  if ref.ready and reg.activate(ref): schedule it (row_start/rank/scaling valid until deactivate)
  reg.deactivate(ref)                # preempted (rows stay cached until evicted)
  reg.release(ref)                   # finished/aborted (always, exactly once)
  meta = reg.build_lora_meta(refs_per_seq, tokens_per_seq)   # after all activate() calls of the step
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from loom.errors import RequestError
from loom.layers.forward_context import LoraBatchMeta
from loom.lora.adapter_paths import resolve_adapter_path, validate_adapter_name
from loom.lora.lora_pool import LoraPool
from loom.lora.peft_loader import (
    GROUP_LAYOUT,
    PROJ_TO_GROUP,
    AdapterConfigInfo,
    AdapterLoadError,
    AdapterWeights,
    LoraModelSpec,
    load_peft_adapter,
    read_adapter_config,
)


class _Version:
    __slots__ = ("name", "path", "version", "config", "rank", "scaling", "host", "loading", "error",
                 "refcount", "active", "row_start", "last_used", "stale", "content_hash", "targets",
                 "pending_kind", "future")

    def __init__(self, name: str, path: str, version: int, config: AdapterConfigInfo, pending_kind: str):
        self.name = name
        self.path = path
        self.version = version
        self.config = config
        self.rank = config.max_rank  # final once loaded
        self.scaling = config.scaling_for(config.r, config.lora_alpha)
        self.host: AdapterWeights | None = None
        self.loading = False
        self.error: str | None = None
        self.refcount = 0  # refs not yet released
        self.active = 0  # refs currently activated (pins device rows)
        self.row_start = -1  # >= 0 while device-resident
        self.last_used = 0
        self.stale = False  # unloaded or replaced by a reload: freed when refcount drops to 0
        self.content_hash = ""
        self.targets: list[str] = []
        self.pending_kind = pending_kind  # "load" | "reload" | "" (published)
        self.future: Future | None = None

    @property
    def state(self) -> str:
        if self.loading:
            return "loading"
        if self.row_start >= 0:
            return "device"
        if self.host is not None:
            return "host"
        if self.error is not None:
            return "failed"
        return "disk"


class AdapterRef:
    """A request's hold on one exact adapter version (pins the version; activate() pins device rows)."""

    __slots__ = ("_v", "active", "released")

    def __init__(self, v: _Version):
        self._v = v
        self.active = False
        self.released = False

    @property
    def name(self) -> str:
        return self._v.name

    @property
    def version(self) -> int:
        return self._v.version

    @property
    def ready(self) -> bool:
        """Weights are in host (or device) memory, so activate() can succeed without waiting for disk."""
        return self._v.host is not None or self._v.row_start >= 0

    @property
    def error(self) -> str | None:
        """Set when the background load of this version failed (the request cannot be served)."""
        return None if self.ready else self._v.error

    @property
    def rank(self) -> int:
        return self._v.rank

    @property
    def scaling(self) -> float:
        return self._v.scaling

    @property
    def row_start(self) -> int:
        """First pool row; valid while active (and read it after the step's activate() calls: compaction moves rows)."""
        return self._v.row_start

    def __repr__(self) -> str:
        return (f"AdapterRef({self.name!r}, version={self.version}, rank={self.rank}, ready={self.ready}, "
                f"active={self.active}, rows={self.row_start})")


class AdapterRegistry:
    def __init__(self, config, model: torch.nn.Module, device, dtype: torch.dtype, spec: LoraModelSpec | None = None):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.roots = list(config.adapter_roots)
        self.max_lora_rank = int(config.max_lora_rank)
        self.max_host_adapters = int(config.max_host_adapters)
        self.spec = spec if spec is not None else LoraModelSpec.from_model(model)
        capacity = LoraPool.capacity_for(self.spec, config.lora_memory_bytes, dtype)
        self.pool = LoraPool(self.spec, capacity, self.device, dtype)
        if model is not None:
            self.pool.attach(model)
        self._pin = self.device.type == "cuda"
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._names: dict[str, _Version] = {}  # name -> current (possibly still loading on first load)
        self._reloading: dict[str, _Version] = {}  # name -> version a reload is loading
        self._versions: set[_Version] = set()
        self._version_ids = itertools.count(1)
        self._clock = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-lora-load")
        self.num_evictions = 0
        self.num_compactions = 0
        self.num_disk_loads = 0

    # ------------------------------------------------------------------ properties

    @property
    def enabled(self) -> bool:
        return self.pool.capacity > 0

    @property
    def capacity_rows(self) -> int:
        return self.pool.capacity

    def num_resident(self) -> int:
        with self._lock:
            return sum(1 for v in self._versions if v.row_start >= 0)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ management API

    def load(self, name: str, path: str | None = None, wait: bool = True):
        """Load a new adapter name from `path` (inside an adapter root; default `<root>/<name>`).

        Config problems raise RequestError at once. With wait=True returns the info dict (weight problems
        raise RequestError("lora_path", ...)); with wait=False returns a Future of it (do not block the loop
        thread on it). Until the load completes, requests naming it wait for it.
        """
        validate_adapter_name(name)
        with self._lock:
            if name in self._names or name in self._reloading:
                raise RequestError("lora_name", f"adapter {name!r} is already loaded (use reload to replace it)")
            real = resolve_adapter_path(path if path is not None else name, self.roots, "lora_path" if path is not None else "lora_name")
            cfg = self._read_config(real, name, "lora_path")
            v = self._new_version(name, real, cfg, "load")
            self._names[name] = v
            fut = self._start_load(v)
        return fut.result() if wait else fut

    def reload(self, name: str, path: str | None = None, wait: bool = True):
        """Load a new version of `name` (from `path`, default its current path). Running and already-admitted
        requests keep their version; requests acquired after the new version is published get it."""
        validate_adapter_name(name)
        with self._lock:
            cur = self._names.get(name)
            if cur is None:
                raise RequestError("lora_name", f"adapter {name!r} is not loaded")
            if cur.pending_kind == "load" or name in self._reloading:
                raise RequestError("lora_name", f"adapter {name!r} is still loading; retry when done")
            real = resolve_adapter_path(path if path is not None else cur.path, self.roots, "lora_path")
            cfg = self._read_config(real, name, "lora_path")
            v = self._new_version(name, real, cfg, "reload")
            self._reloading[name] = v
            fut = self._start_load(v)
        return fut.result() if wait else fut

    def unload(self, name: str) -> dict:
        """Forget `name`; versions still used by requests stay until their last ref is released."""
        validate_adapter_name(name)
        with self._lock:
            v = self._names.pop(name, None)
            p = self._reloading.pop(name, None)
            if v is None and p is None:
                raise RequestError("lora_name", f"adapter {name!r} is not loaded")
            info = self._info(v if v is not None else p)
            for x in (v, p):
                if x is not None:
                    x.stale = True
                    self._maybe_free(x)
            return info

    def list(self) -> list[dict]:
        with self._lock:
            out = []
            for name in sorted(self._names):
                d = self._info(self._names[name])
                p = self._reloading.get(name)
                d["reloading"] = p is not None
                out.append(d)
            for name in sorted(set(self._reloading) - set(self._names)):
                d = self._info(self._reloading[name])
                d["reloading"] = True
                out.append(d)
            return out

    def info(self) -> dict:
        with self._lock:
            return {
                "capacity_rows": self.pool.capacity,
                "free_rows": self.pool.allocator.num_free,
                "pool_bytes": self.pool.nbytes,
                "resident": sum(1 for v in self._versions if v.row_start >= 0),
                "host": sum(1 for v in self._versions if v.host is not None and v.row_start < 0),
                "versions": len(self._versions),
                "refs": sum(v.refcount for v in self._versions),  # unreleased request refs, stale versions included
                "active": sum(v.active for v in self._versions),
                "evictions": self.num_evictions,
                "compactions": self.num_compactions,
                "disk_loads": self.num_disk_loads,
            }

    def wait_for_loads(self, timeout: float | None = None) -> bool:
        """Block until some background load finishes (or timeout); True if none is in flight afterwards.
        For an engine loop with nothing runnable but requests waiting on adapter loads."""
        with self._cond:
            if any(v.loading for v in self._versions):
                self._cond.wait(timeout)
            return not any(v.loading for v in self._versions)

    def has_pending_loads(self) -> bool:
        with self._lock:
            return any(v.loading for v in self._versions)

    # ------------------------------------------------------------------ request API

    def acquire(self, name: str) -> AdapterRef:
        """Pin the current version of `name` for one request (resolving `<root>/<name>` on first use)."""
        validate_adapter_name(name, "lora_name")
        with self._lock:
            if not self.enabled:
                raise RequestError("lora_name", "LoRA adapters are disabled (lora_memory_bytes is too small for one rank row)")
            v = self._names.get(name)
            if v is None:
                real = self._resolve_first_use(name)
                cfg = self._read_config(real, name, "lora_name")
                v = self._new_version(name, real, cfg, "load")
                self._names[name] = v
                self._start_load(v)
            elif v.host is None and v.row_start < 0 and not v.loading:
                v.error = None
                self._start_load(v)  # dropped from host memory earlier (or a failed re-read): read again
            v.refcount += 1
            self._touch(v)
            return AdapterRef(v)

    def activate(self, ref: AdapterRef) -> bool:
        """Make the ref's version device-resident and pin it. False: not loaded yet, or no rows free now."""
        with self._lock:
            if ref.released:
                raise RuntimeError("activate() on a released AdapterRef")
            v = ref._v
            if ref.active:
                return True
            if v.row_start < 0:
                if v.host is None:
                    if v.error is not None and not v.loading:
                        raise RequestError("lora_name", v.error)
                    return False
                start = self._alloc_rows(v.rank)
                if start is None:
                    return False
                self.pool.write(start, v.host)
                v.row_start = start
                self._trim_host()
            v.active += 1
            ref.active = True
            self._touch(v)
            return True

    def deactivate(self, ref: AdapterRef) -> None:
        with self._lock:
            if ref.active:
                ref.active = False
                ref._v.active -= 1
                self._touch(ref._v)

    def release(self, ref: AdapterRef) -> None:
        with self._lock:
            if ref.released:
                return
            self.deactivate(ref)
            ref.released = True
            v = ref._v
            v.refcount -= 1
            self._maybe_free(v)
            self._trim_host()

    def build_lora_meta(self, refs: Sequence[AdapterRef | None], num_tokens: Sequence[int]) -> LoraBatchMeta | None:
        return build_lora_meta(refs, num_tokens, self.device)

    # ------------------------------------------------------------------ internals

    def _touch(self, v: _Version) -> None:
        self._clock += 1
        v.last_used = self._clock

    def _read_config(self, real: str, name: str, field_name: str) -> AdapterConfigInfo:
        try:
            cfg = read_adapter_config(real, name, self.max_lora_rank)
        except AdapterLoadError as e:
            raise RequestError(field_name, str(e)) from None
        if cfg.max_rank > self.pool.capacity:
            raise RequestError(field_name, f"adapter {name!r}: rank {cfg.max_rank} does not fit the device LoRA pool "
                               f"({self.pool.capacity} rank rows); raise lora_memory_bytes")
        return cfg

    def _resolve_first_use(self, name: str) -> str:
        if not self.roots:
            raise RequestError("lora_name", f"unknown adapter {name!r} (not loaded, and no adapter_roots are configured)")
        found = any(os.path.isdir(os.path.join(r, name)) for r in self.roots)
        if not found:
            raise RequestError("lora_name", f"unknown adapter {name!r}: not loaded, and no directory of that name "
                               f"under the adapter roots")
        return resolve_adapter_path(name, self.roots, "lora_name")

    def _new_version(self, name: str, path: str, cfg: AdapterConfigInfo, kind: str) -> _Version:
        v = _Version(name, path, next(self._version_ids), cfg, kind)
        self._versions.add(v)
        self._touch(v)
        return v

    def _start_load(self, v: _Version) -> Future:
        v.loading = True
        fut: Future = Future()
        v.future = fut
        self._executor.submit(self._load_job, v, fut)
        return fut

    def _load_job(self, v: _Version, fut: Future) -> None:
        w, err = None, None
        try:
            w = load_peft_adapter(v.path, v.name, self.spec, self.dtype, self.max_lora_rank,
                                  config=v.config, pin_memory=self._pin)
        except AdapterLoadError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - report, never kill the loader thread
            err = f"adapter {v.name!r}: unexpected error while loading: {e!r}"
        with self._cond:
            if err is None and v.content_hash and w.content_hash != v.content_hash:
                err = (f"adapter {v.name!r}: its files in {v.path} changed on disk since it was loaded; "
                       f"call reload({v.name!r}) to serve the new weights")
                w = None
            v.loading = False
            self.num_disk_loads += 1
            if err is not None:
                v.error = err
                if v.pending_kind == "load" and self._names.get(v.name) is v:
                    del self._names[v.name]
                    v.stale = True
                elif v.pending_kind == "reload" and self._reloading.get(v.name) is v:
                    del self._reloading[v.name]
                    v.stale = True
                v.pending_kind = ""
                self._maybe_free(v)
            else:
                v.host, v.rank, v.scaling = w, w.rank, w.scaling
                v.content_hash, v.targets, v.error = w.content_hash, w.target_modules, None
                if v.pending_kind == "reload" and self._reloading.get(v.name) is v:
                    del self._reloading[v.name]
                    old = self._names.get(v.name)
                    self._names[v.name] = v
                    if old is not None:
                        old.stale = True
                        self._maybe_free(old)
                v.pending_kind = ""
                self._maybe_free(v)  # unloaded while loading and nobody holds it
                self._trim_host()
            info = self._info(v)
            self._cond.notify_all()
        if err is None:
            fut.set_result(info)
        else:
            fut.set_exception(RequestError("lora_path", err))

    def _maybe_free(self, v: _Version) -> None:
        """Free a stale version nobody holds (rows + host weights)."""
        if v.stale and v.refcount == 0 and not v.loading and v in self._versions:
            if v.row_start >= 0:
                self.pool.allocator.free(v.row_start, v.rank)
                v.row_start = -1
            v.host = None
            self._versions.discard(v)

    def _evict(self, v: _Version) -> None:
        self.pool.allocator.free(v.row_start, v.rank)
        v.row_start = -1
        self.num_evictions += 1
        self._maybe_free(v)

    def _alloc_rows(self, n: int) -> int | None:
        alloc = self.pool.allocator
        start = alloc.alloc(n)
        while start is None:
            if alloc.num_free >= n:
                self._compact()
                start = alloc.alloc(n)
                break
            victims = [x for x in self._versions if x.row_start >= 0 and x.active == 0]
            if not victims:
                return None
            self._evict(min(victims, key=lambda x: x.last_used))
            start = alloc.alloc(n)
        return start

    def _compact(self) -> None:
        """Slide all resident versions to the front of the pools (rows are read per step, so this is safe
        between steps; meta built afterwards sees the new row_start)."""
        pos = 0
        for v in sorted((x for x in self._versions if x.row_start >= 0), key=lambda x: x.row_start):
            if v.row_start != pos:
                self.pool.move(v.row_start, pos, v.rank)
                v.row_start = pos
            pos += v.rank
        self.pool.allocator.reset(pos)
        self.num_compactions += 1

    def _trim_host(self) -> None:
        """Keep at most max_host_adapters versions in host memory that are not device-resident; drop the
        least recently used ones no request holds (they are read from disk again on next use)."""
        held = [v for v in self._versions if v.host is not None and v.row_start < 0]
        over = len(held) - self.max_host_adapters
        if over <= 0:
            return
        for v in sorted((v for v in held if v.refcount == 0 and not v.loading), key=lambda x: x.last_used)[:over]:
            v.host = None
            self._maybe_free(v)

    def _info(self, v: _Version) -> dict:
        return {
            "name": v.name,
            "path": v.path,
            "version": v.version,
            "rank": v.rank,
            "scaling": v.scaling,
            "target_modules": list(v.targets),
            "state": v.state,
            "error": v.error,
            "refs": v.refcount,
            "active": v.active,
            "row_start": v.row_start,
            "stale": v.stale,
        }


def build_lora_meta(refs: Sequence[AdapterRef | None], num_tokens: Sequence[int], device) -> LoraBatchMeta | None:
    """LoraBatchMeta for a flattened batch: sequence i has num_tokens[i] consecutive tokens, in order.

    refs[i] is the sequence's active AdapterRef or None. Tokens are grouped per adapter version with a
    stable argsort (one loop over sequences, none over tokens). Returns None if no token uses an adapter.
    """
    if len(refs) != len(num_tokens):
        raise ValueError(f"{len(refs)} refs but {len(num_tokens)} token counts")
    group_of: dict[int, int] = {}
    seq_group = [-1] * len(refs)
    targeted: set[str] = set()
    row_start: list[int] = []
    ranks: list[int] = []
    scalings: list[float] = []
    for i, ref in enumerate(refs):
        if ref is None:
            continue
        v = ref._v
        g = group_of.get(id(v))
        if g is None:
            if not ref.active or v.row_start < 0:
                raise RuntimeError(f"adapter {v.name!r} is not active: call activate() before building the batch")
            g = group_of[id(v)] = len(row_start)
            row_start.append(v.row_start)
            ranks.append(v.rank)
            scalings.append(float(v.scaling))
            targeted.update(GROUP_LAYOUT[PROJ_TO_GROUP[p][0]][0] for p in v.targets)
        seq_group[i] = g
    if not row_start:
        return None
    counts = torch.tensor(list(num_tokens), dtype=torch.int64)
    tok_group = torch.repeat_interleave(torch.tensor(seq_group, dtype=torch.int64), counts)
    order = torch.argsort(tok_group, stable=True)
    num_none = int((tok_group < 0).sum())
    token_indices = order[num_none:]
    seg_counts = torch.bincount(tok_group[tok_group >= 0], minlength=len(row_start))
    seg_starts = torch.zeros(len(row_start) + 1, dtype=torch.int64)
    torch.cumsum(seg_counts, 0, out=seg_starts[1:])
    seg_starts_cpu = seg_starts.tolist()
    device = torch.device(device)
    nb = device.type == "cuda"

    def dev(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu":
            return t
        return (t.pin_memory() if nb else t).to(device, non_blocking=nb)

    return LoraBatchMeta(
        token_indices=dev(token_indices.contiguous()),
        seg_starts=dev(seg_starts.to(torch.int32)),
        row_start=dev(torch.tensor(row_start, dtype=torch.int32)),
        ranks=dev(torch.tensor(ranks, dtype=torch.int32)),
        scalings=dev(torch.tensor(scalings, dtype=torch.float32)),
        max_rank=max(ranks),
        max_seg_len=int(seg_counts.max()),
        seg_starts_cpu=seg_starts_cpu,
        row_start_cpu=row_start,
        ranks_cpu=ranks,
        scalings_cpu=scalings,
        module_groups=frozenset(targeted) if targeted else None,
    )
