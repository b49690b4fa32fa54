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

Row spaces: the dense groups (attention, dense MLP; pools sized by lora_memory_bytes) and the MoE expert groups
(sized by lora_expert_memory_bytes) have separate pools and allocators. A version holds rows in a space only if it
targets a group there, as many as its largest module rank in that space (known from its config before loading);
allocation, LRU eviction and compaction run per space, so making room in one space never drops the other's rows.
A version is device-resident when it has rows in every space it targets.
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from loom.device import bind_thread
from loom.errors import RequestError
from loom.kernels.cpu_ext import serial_thread
from loom.layers.forward_context import LoraBatchMeta
from loom.lora.adapter_paths import resolve_adapter_path, validate_adapter_name
from loom.lora.lora_pool import LoraPool
from loom.lora.model_spec import EXPERT_PROJS
from loom.lora.peft_loader import (
    GROUP_LAYOUT,
    PROJ_TO_GROUP,
    AdapterConfigInfo,
    AdapterLoadError,
    AdapterWeights,
    LoraModelSpec,
    load_peft_adapter,
    read_adapter_config,
    target_ranks,
)

DENSE, EXPERT = 0, 1  # row spaces: index into AdapterRegistry.pools and _Version.rows / .ranks
SPACE_NAMES = ("dense", "expert")
SPACE_FIELDS = ("lora_memory_bytes", "lora_expert_memory_bytes")  # the EngineConfig field sizing each space


class _Version:
    __slots__ = ("name", "path", "version", "config", "rank", "ranks", "scaling", "host", "loading", "error",
                 "refcount", "active", "rows", "last_used", "stale", "content_hash", "targets",
                 "pending_kind", "future")

    def __init__(self, name: str, path: str, version: int, config: AdapterConfigInfo, ranks: list[int],
                 pending_kind: str):
        self.name = name
        self.path = path
        self.version = version
        self.config = config
        self.rank = config.max_rank  # largest module rank; final once loaded
        self.ranks = list(ranks)  # rows per space (0 = targets nothing there); final once loaded
        self.scaling = config.scaling_for(config.r, config.lora_alpha)
        self.host: AdapterWeights | None = None
        self.loading = False
        self.error: str | None = None
        self.refcount = 0  # refs not yet released
        self.active = 0  # refs currently activated (pins device rows)
        self.rows = [-1, -1]  # first row per space, >= 0 while it holds rows there
        self.last_used = 0
        self.stale = False  # unloaded or replaced by a reload: freed when refcount drops to 0
        self.content_hash = ""
        self.targets: list[str] = []
        self.pending_kind = pending_kind  # "load" | "reload" | "" (published)
        self.future: Future | None = None

    @property
    def resident(self) -> bool:
        """Rows in every space it targets (what a step needs)."""
        return all(start >= 0 for start, rank in zip(self.rows, self.ranks) if rank)

    @property
    def state(self) -> str:
        if self.loading:
            return "loading"
        if self.resident:
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
        return self._v.host is not None or self._v.resident

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
        """First row in the dense pools (-1 if it targets no dense group); valid while active (and read it after the
        step's activate() calls: compaction moves rows)."""
        return self._v.rows[DENSE]

    @property
    def expert_row_start(self) -> int:
        """First row in the expert pools (-1 if it targets no expert); valid like row_start."""
        return self._v.rows[EXPERT]

    def __repr__(self) -> str:
        return (f"AdapterRef({self.name!r}, version={self.version}, rank={self.rank}, ready={self.ready}, "
                f"active={self.active}, rows={self.row_start})")


def _loader_thread(device: torch.device) -> None:
    bind_thread(device)
    serial_thread()


class AdapterRegistry:
    def __init__(self, config, model: torch.nn.Module, device, dtype: torch.dtype, spec: LoraModelSpec | None = None):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.roots = list(config.adapter_roots)
        self.max_lora_rank = int(config.max_lora_rank)
        self.max_host_adapters = int(config.max_host_adapters)
        self.spec = spec if spec is not None else LoraModelSpec.from_model(model)
        pools = []
        for space, field_name in zip((DENSE, EXPERT), SPACE_FIELDS):
            sub = self.spec.space(expert=space == EXPERT)
            pools.append(LoraPool(sub, LoraPool.capacity_for(sub, getattr(config, field_name), dtype, self.device),
                                  self.device, dtype))
            if model is not None:
                pools[-1].attach(model)
        self.pools: tuple[LoraPool, LoraPool] = tuple(pools)
        self.pool, self.expert_pool = pools  # dense, expert
        self._pin = self.device.type == "cuda"
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._names: dict[str, _Version] = {}  # name -> current (possibly still loading on first load)
        self._reloading: dict[str, _Version] = {}  # name -> version a reload is loading
        self._versions: set[_Version] = set()
        self._version_ids = itertools.count(1)
        self._clock = 0
        # the loader pins host memory and may touch the device: on the engine's device, not the thread's default;
        # its CPU ops serial, so that it never opens a second OpenMP team beside the engine's (cpu_ext.serial_thread)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-lora-load",
                                            initializer=_loader_thread, initargs=(self.device,))
        self.evictions = [0, 0]  # per space
        self.compactions = [0, 0]
        self.num_disk_loads = 0

    # ------------------------------------------------------------------ properties

    @property
    def enabled(self) -> bool:
        return any(p.capacity > 0 for p in self.pools)

    @property
    def capacity_rows(self) -> int:
        return self.pool.capacity

    @property
    def num_evictions(self) -> int:
        return sum(self.evictions)

    @property
    def num_compactions(self) -> int:
        return sum(self.compactions)

    def num_resident(self) -> int:
        with self._lock:
            return sum(1 for v in self._versions if v.resident)

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
            real = resolve_adapter_path(path if path is not None else name, self.roots,
                                        "lora_path" if path is not None else "lora_name")
            cfg, ranks = self._read_config(real, name, "lora_path")
            v = self._new_version(name, real, cfg, ranks, "load")
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
            cfg, ranks = self._read_config(real, name, "lora_path")
            v = self._new_version(name, real, cfg, ranks, "reload")
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
        """Counts; the row keys without a prefix are the dense space's, those with `expert_` the expert space's."""
        with self._lock:
            out = {
                "resident": sum(1 for v in self._versions if v.resident),
                "host": sum(1 for v in self._versions if v.host is not None and not v.resident),
                "versions": len(self._versions),
                "refs": sum(v.refcount for v in self._versions),  # unreleased request refs, stale versions included
                "active": sum(v.active for v in self._versions),
                "disk_loads": self.num_disk_loads,
            }
            for space, pool in enumerate(self.pools):
                pre = "expert_" if space == EXPERT else ""
                out.update({
                    f"{pre}capacity_rows": pool.capacity,
                    f"{pre}free_rows": pool.allocator.num_free,
                    f"{pre}pool_bytes": pool.nbytes,
                    f"{pre}row_bytes": pool.row_bytes,
                    f"{pre}holders": sum(1 for v in self._versions if v.rows[space] >= 0),  # versions with rows here
                    f"{pre}evictions": self.evictions[space],
                    f"{pre}compactions": self.compactions[space],
                })
            return out

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
                names = [f for f, p in zip(SPACE_FIELDS, self.pools) if p.spec.groups]
                raise RequestError("lora_name", f"LoRA adapters are disabled ({' and '.join(names)} "
                                   f"{'is' if len(names) == 1 else 'are'} too small for one rank row)")
            v = self._names.get(name)
            if v is None:
                real = self._resolve_first_use(name)
                cfg, ranks = self._read_config(real, name, "lora_name")
                v = self._new_version(name, real, cfg, ranks, "load")
                self._names[name] = v
                self._start_load(v)
            elif v.host is None and not v.resident and not v.loading:
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
            if not v.resident:
                if v.host is None:
                    if v.error is not None and not v.loading:
                        raise RequestError("lora_name", v.error)
                    return False
                for space, pool in enumerate(self.pools):
                    if v.ranks[space] and v.rows[space] < 0:
                        start = self._alloc_rows(space, v.ranks[space])
                        if start is None:
                            return False  # rows taken in the other space stay cached (evictable, not pinned)
                        pool.write(start, v.host)
                        v.rows[space] = start
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

    def _read_config(self, real: str, name: str, field_name: str) -> tuple[AdapterConfigInfo, list[int]]:
        """The adapter's config and the rows it takes per space (refused if a space cannot hold them)."""
        try:
            cfg = read_adapter_config(real, name, self.max_lora_rank)
            modules = target_ranks(name, cfg, self.spec)
        except AdapterLoadError as e:
            raise RequestError(field_name, str(e)) from None
        if not modules:
            raise RequestError(field_name, f"adapter {name!r}: target_modules {cfg.target_modules!r} selects no "
                               f"module of this {self.spec.arch}")
        ranks = [0, 0]
        for (_, proj), r in modules.items():
            space = EXPERT if proj in EXPERT_PROJS else DENSE
            ranks[space] = max(ranks[space], r)
        err = self._room_error(name, ranks)
        if err is not None:
            raise RequestError(field_name, err)
        return cfg, ranks

    def _room_error(self, name: str, ranks: list[int]) -> str | None:
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

    def _resolve_first_use(self, name: str) -> str:
        if not self.roots:
            raise RequestError("lora_name",
                               f"unknown adapter {name!r} (not loaded, and no adapter_roots are configured)")
        found = any(os.path.isdir(os.path.join(r, name)) for r in self.roots)
        if not found:
            raise RequestError("lora_name", f"unknown adapter {name!r}: not loaded, and no directory of that name "
                               f"under the adapter roots")
        return resolve_adapter_path(name, self.roots, "lora_name")

    def _new_version(self, name: str, path: str, cfg: AdapterConfigInfo, ranks: list[int], kind: str) -> _Version:
        v = _Version(name, path, next(self._version_ids), cfg, ranks, kind)
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
            ranks = [pool.rank_of(w) for pool in self.pools] if err is None else []
            if err is None:  # the weights decide (the loader checked them against the config's ranks)
                err = self._room_error(v.name, ranks)
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
                v.host, v.rank, v.ranks, v.scaling = w, w.rank, ranks, w.scaling
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
            for space, pool in enumerate(self.pools):
                if v.rows[space] >= 0:
                    pool.allocator.free(v.rows[space], v.ranks[space])
                    v.rows[space] = -1
            v.host = None
            self._versions.discard(v)

    def _evict(self, v: _Version, space: int) -> None:
        """Drop v's rows in one space (its rows in the other space stay)."""
        self.pools[space].allocator.free(v.rows[space], v.ranks[space])
        v.rows[space] = -1
        self.evictions[space] += 1
        self._maybe_free(v)

    def _alloc_rows(self, space: int, n: int) -> int | None:
        """n contiguous rows in one space: first fit, else compaction if enough rows are free, else evict the least
        recently used unpinned holder of rows in this space and retry."""
        alloc = self.pools[space].allocator
        start = alloc.alloc(n)
        while start is None:
            if alloc.num_free >= n:
                self._compact(space)
                start = alloc.alloc(n)
                break
            victims = [x for x in self._versions if x.rows[space] >= 0 and x.active == 0]
            if not victims:
                return None
            self._evict(min(victims, key=lambda x: x.last_used), space)
            start = alloc.alloc(n)
        return start

    def _compact(self, space: int) -> None:
        """Slide the space's row holders to the front of its pools (rows are read per step, so this is safe
        between steps; meta built afterwards sees the new rows)."""
        pool, pos = self.pools[space], 0
        for v in sorted((x for x in self._versions if x.rows[space] >= 0), key=lambda x: x.rows[space]):
            if v.rows[space] != pos:
                pool.move(v.rows[space], pos, v.ranks[space])
                v.rows[space] = pos
            pos += v.ranks[space]
        pool.allocator.reset(pos)
        self.compactions[space] += 1

    def _trim_host(self) -> None:
        """Keep at most max_host_adapters versions in host memory that are not device-resident; drop the
        least recently used ones no request holds (they are read from disk again on next use)."""
        held = [v for v in self._versions if v.host is not None and not v.resident]
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
            "row_start": v.rows[DENSE],
            "expert_row_start": v.rows[EXPERT],
            "rows": dict(zip(SPACE_NAMES, v.ranks)),  # rows it takes per space
            "stale": v.stale,
        }


def build_lora_meta(refs: Sequence[AdapterRef | None], num_tokens: Sequence[int], device) -> LoraBatchMeta | None:
    """LoraBatchMeta for a flattened batch: sequence i has num_tokens[i] consecutive tokens, in order.

    refs[i] is the sequence's active AdapterRef or None. The returned meta groups the tokens of adapters with dense
    rows (no group if none has any); its `experts` groups the tokens of adapters with expert rows, by their expert
    rows (None if none has any). Returns None if no token uses an adapter.
    """
    if len(refs) != len(num_tokens):
        raise ValueError(f"{len(refs)} refs but {len(num_tokens)} token counts")
    seq_versions: list[_Version | None] = []
    for ref in refs:
        if ref is not None and (not ref.active or not ref._v.resident):
            raise RuntimeError(f"adapter {ref.name!r} is not active: call activate() before building the batch")
        seq_versions.append(None if ref is None else ref._v)
    if all(v is None for v in seq_versions):
        return None
    counts = torch.tensor(list(num_tokens), dtype=torch.int64)
    device = torch.device(device)
    meta = _space_meta(seq_versions, counts, DENSE, device) or _empty_meta(device)
    meta.experts = _space_meta(seq_versions, counts, EXPERT, device)
    return meta


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    nb = device.type == "cuda"
    return (t.pin_memory() if nb else t).to(device, non_blocking=nb)


def _space_meta(seq_versions: list[_Version | None], counts: torch.Tensor, space: int,
                device: torch.device) -> LoraBatchMeta | None:
    """The grouping of one row space: tokens per adapter version with rows there (a stable argsort; one loop over
    sequences, none over tokens); None if no sequence's adapter has rows in the space."""
    group_of: dict[int, int] = {}
    seq_group = [-1] * len(seq_versions)
    targeted: set[str] = set()
    row_start: list[int] = []
    ranks: list[int] = []
    scalings: list[float] = []
    for i, v in enumerate(seq_versions):
        if v is None or not v.ranks[space]:
            continue
        g = group_of.get(id(v))
        if g is None:
            g = group_of[id(v)] = len(row_start)
            row_start.append(v.rows[space])
            ranks.append(v.ranks[space])
            scalings.append(float(v.scaling))
            targeted.update(GROUP_LAYOUT[PROJ_TO_GROUP[p][0]][0] for p in v.targets
                            if (p in EXPERT_PROJS) == (space == EXPERT))
        seq_group[i] = g
    if not row_start:
        return None
    tok_group = torch.repeat_interleave(torch.tensor(seq_group, dtype=torch.int64), counts)
    order = torch.argsort(tok_group, stable=True)
    num_none = int((tok_group < 0).sum())
    token_indices = order[num_none:]
    seg_counts = torch.bincount(tok_group[tok_group >= 0], minlength=len(row_start))
    seg_starts = torch.zeros(len(row_start) + 1, dtype=torch.int64)
    torch.cumsum(seg_counts, 0, out=seg_starts[1:])
    return LoraBatchMeta(
        token_indices=_to_device(token_indices.contiguous(), device),
        seg_starts=_to_device(seg_starts.to(torch.int32), device),
        row_start=_to_device(torch.tensor(row_start, dtype=torch.int32), device),
        ranks=_to_device(torch.tensor(ranks, dtype=torch.int32), device),
        scalings=_to_device(torch.tensor(scalings, dtype=torch.float32), device),
        max_rank=max(ranks),
        max_seg_len=int(seg_counts.max()),
        seg_starts_cpu=seg_starts.tolist(),
        row_start_cpu=row_start,
        ranks_cpu=ranks,
        scalings_cpu=scalings,
        module_groups=frozenset(targeted) if targeted else None,
    )


def _empty_meta(device: torch.device) -> LoraBatchMeta:
    """No token has dense rows (every adapter of the step targets experts only): the linear layers skip LoRA."""
    return LoraBatchMeta(
        token_indices=torch.zeros(0, dtype=torch.int64, device=device),
        seg_starts=torch.zeros(1, dtype=torch.int32, device=device),
        row_start=torch.zeros(0, dtype=torch.int32, device=device),
        ranks=torch.zeros(0, dtype=torch.int32, device=device),
        scalings=torch.zeros(0, dtype=torch.float32, device=device),
        max_rank=0, max_seg_len=0, seg_starts_cpu=[0], row_start_cpu=[], ranks_cpu=[], scalings_cpu=[],
        module_groups=frozenset(),
    )
