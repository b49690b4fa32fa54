"""Adapters by name: the public registry (load / reload / unload / list by name, acquire / activate / release per
request), its versions' lifecycle and the background loader that reads adapters from disk.

Threading: every public method is meant for the engine's loop thread. A single background thread reads
adapters from disk into host memory; it takes the registry lock only to publish the result (and does no
device work), so the loop thread never waits for disk I/O. Adapters of lora_load_process_min_bytes or more it hands to
the loader process (loom.lora.load_process), which reads, checks and lays them out off the engine's interpreter and
cores; it only maps the result. Fetches from adapter sources run on fetcher threads of their own, so a slow source
holds up only the adapters fetched from it.

Lifecycle of a version (one per load/reload of a name; `version` is unique per version):
  loading -> host (weights in host memory) <-> device (rows in the pools; keeps its host copy) -> ...
  A version not referenced by any request may drop its host copy ("disk") beyond max_host_adapters and
  is read again on next use (refused if the files changed in between: reload picks up new weights).
  unload/reload make the old version stale; it is freed when its last ref is released.

Adapters not on local disk (loom.lora.adapter_sources says how a request names one): with adapter_sources set, a
name missing from the adapter roots, or a `lora_path` URI under a source, makes a version whose config is not known
yet; a fetcher thread looks it up, fetches it into the local cache (once: later reads, and other versions, find it
there; a reload fetches afresh) and reads its config, the loader its weights; either publishes it or its error as
for a local one (a request then fails with "lora_name: <why>"). A version dropped from host memory is read from the
cache again, fetched again if the cache dropped it.

Request flow (engine):
  ref = reg.acquire(name)           # at add_request; RequestError("lora_name", ...) if unknown/bad; starts the
                                     # read into host memory (background) unless it is there
  reg.prefetch(ref)                  # at add_request and at each step while queued: rows ahead of admission where
                                     # that evicts nothing a request holds; -> "device" | "host" | "disk"
  if ref.error: fail the request     # a background load failed
  if ref.ready and reg.activate(ref): schedule it (row_start/rank/scaling valid until deactivate)
  reg.deactivate(ref)                # preempted (rows stay cached until evicted)
  reg.release(ref)                   # finished/aborted (always, exactly once)
  meta = reg.build_lora_meta(refs_per_seq, tokens_per_seq)   # after all activate() calls of the step

Kept apart, each in its own module: a version's record and the request's handle (loom.lora.adapter_version), the
device rows per row space, LRU eviction and the host tier (loom.lora.residency), and the per-step batch metadata
(loom.lora.batch_meta). The names they export are importable from here too.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from loom.device import bind_thread
from loom.errors import RequestError
from loom.kernels.cpu_ext import serial_thread
from loom.layers.forward_context import LoraBatchMeta
from loom.lora.adapter_paths import resolve_adapter_path, validate_adapter_name
from loom.lora.adapter_sources import AdapterSources, is_uri
from loom.lora.adapter_version import DENSE, EXPERT, SPACE_FIELDS, SPACE_NAMES, AdapterRef, AdapterVersion
from loom.lora.batch_meta import build_lora_meta
from loom.lora.load_pace import PIECE_BYTES, LoadShare, load_share
from loom.lora.load_process import LoaderProcess
from loom.lora.lora_pool import LoraPool
from loom.lora.lora_stats import DISK_TO_HOST, HOST_TO_DEVICE, REMOTE_TO_HOST, LoadLog, LoraStats
from loom.lora.model_spec import EXPERT_PROJS
from loom.lora.peft_loader import (
    WEIGHTS_NAME,
    AdapterConfigInfo,
    AdapterLoadError,
    AdapterWeights,
    LoraModelSpec,
    load_peft_adapter,
    read_adapter_config,
    target_ranks,
)
from loom.lora.residency import RowResidency

__all__ = ["DENSE", "EXPERT", "SPACE_FIELDS", "SPACE_NAMES", "AdapterRef", "AdapterRegistry", "AdapterVersion",
           "build_lora_meta"]


_FETCH_THREADS = 4  # adapters fetched from the sources at once


def _loader_thread(device: torch.device) -> None:
    bind_thread(device)
    serial_thread()


class AdapterRegistry:
    def __init__(self, config, model: torch.nn.Module, device, dtype: torch.dtype, spec: LoraModelSpec | None = None,
                 tp=None):
        """tp: rank 0's tensor-parallel group, or None (loom.lora.tp_pools: the other ranks' rows follow these)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.roots = list(config.adapter_roots)
        self.max_lora_rank = int(config.max_lora_rank)
        self.spec = spec if spec is not None else LoraModelSpec.from_model(model)
        # On the CPU loads share the cores the steps compute on: their CPU share, set each step (pace_loads), paces
        # the loader process and the copier thread (loom.lora.load_pace)
        self.load_share = LoadShare()
        self.paces_loads = self.device.type == "cpu"  # on CUDA the steps compute on the GPU: loads are not paced
        self.residency = RowResidency(config, self.spec, model, self.device, dtype, tp,  # device rows and host tier
                                      self.load_share.get if self.paces_loads else None)
        self.pools: tuple[LoraPool, LoraPool] = self.residency.pools
        self.pool, self.expert_pool = self.pools  # dense, expert
        self._pin = self.device.type == "cuda"
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._names: dict[str, AdapterVersion] = {}  # name -> current (possibly still loading on first load)
        self._reloading: dict[str, AdapterVersion] = {}  # name -> version a reload is loading
        self._versions: set[AdapterVersion] = self.residency.versions  # every live version (freed by the residency)
        self._version_ids = itertools.count(1)
        self._clock = 0
        # the loader pins host memory and may touch the device: on the engine's device, not the thread's default;
        # its CPU ops serial, so that it never opens a second OpenMP team beside the engine's (cpu_ext.serial_thread)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-lora-load",
                                            initializer=_loader_thread, initargs=(self.device,))
        # adapters of at least lora_load_process_min_bytes are read in a process (loom.lora.load_process), started
        # at the first such load
        self._process = LoaderProcess(self.spec, dtype, self.max_lora_rank, self.load_share)
        self.num_disk_loads = 0
        self.sources = (AdapterSources(config.adapter_sources, config.adapter_cache_dir, config.adapter_cache_bytes)
                        if config.adapter_sources else None)
        # fetches from the sources on threads of their own: a slow source never holds up the reads of other adapters
        self._fetcher = (ThreadPoolExecutor(max_workers=_FETCH_THREADS, thread_name_prefix="loom-lora-fetch")
                         if self.sources is not None else None)
        self.load_log = LoadLog()

    # ------------------------------------------------------------------ properties

    @property
    def enabled(self) -> bool:
        return any(p.capacity > 0 for p in self.pools)

    @property
    def capacity_rows(self) -> int:
        return self.pool.capacity

    @property
    def max_host_adapters(self) -> int:
        return self.residency.max_host_adapters

    @property
    def evictions(self) -> list[int]:
        """Per space."""
        return self.residency.evictions

    @property
    def compactions(self) -> list[int]:
        """Per space."""
        return self.residency.compactions

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
        """Stop the loader thread, the loader process and the copier (idempotent)."""
        if self._fetcher is not None:  # a fetch still running publishes its version's error (no loader to read it)
            self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._process.close()
        self.residency.close()
        self.load_share.close()

    def start_loader(self) -> None:
        """Boot the loader process now, in the background (on the loader thread, before any load queued after this):
        its boot (~1 s of CPU importing torch and loom) is not paced, so a server starts it before requests stream
        rather than at its first large adapter load."""
        self._executor.submit(self._process.ensure_started)

    @property
    def loader_pid(self) -> int | None:
        """The loader process's pid while it runs (tests, health)."""
        return self._process.pid

    # ------------------------------------------------------------------ management API

    def load(self, name: str, path: str | None = None, wait: bool = True):
        """Load a new adapter name from `path` (inside an adapter root, or a URI under an adapter source; default
        `<root>/<name>`, else `<source>/<name>`).

        Config problems raise RequestError at once. With wait=True returns the info dict (weight problems
        raise RequestError("lora_path", ...)); with wait=False returns a Future of it (do not block the loop
        thread on it). Until the load completes, requests naming it wait for it.
        """
        validate_adapter_name(name)
        with self._lock:
            if name in self._names or name in self._reloading:
                raise RequestError("lora_name", f"adapter {name!r} is already loaded (use reload to replace it)")
            if path is None and self.sources is not None and self._resolve_first_use(name) is None:
                v = self._new_version(name, "", None, [0, 0], "load")  # the loader looks it up under the sources
            else:
                v = self._new_version_at(name, path if path is not None else name,
                                         "lora_path" if path is not None else "lora_name", "load")
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
            v = self._new_version_at(name, path if path is not None else (cur.source or cur.path), "lora_path",
                                     "reload")
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
                    self.residency.maybe_free(x)
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
            out.update(self.residency.info())
            return out

    def stats(self) -> LoraStats:
        """The tiers' sizes and counters, and the recent load latencies (loom.lora.lora_stats); one pass over the
        versions."""
        with self._lock:
            device = host = host_bytes = 0
            # every taken row is a version's (rows are taken for a version and freed with it): from the allocators
            device_bytes = sum((p.capacity - p.allocator.num_free) * p.row_bytes for p in self.pools)
            for v in self._versions:
                if v.resident:
                    device += 1
                elif v.host is not None:
                    host += 1
                    host_bytes += v.host.nbytes
            cache = self.sources.cache if self.sources is not None else None
            return LoraStats(device_adapters=device, host_adapters=host, host_bytes=host_bytes,
                             device_evictions=self.num_evictions, host_evictions=self.residency.host_evictions,
                             cache_bytes=cache.bytes if cache else 0, cache_evictions=cache.evictions if cache else 0,
                             remote_fetches=cache.fetches if cache else 0, device_bytes=device_bytes,
                             compactions=self.num_compactions, load_cpu_share=self.load_share.get(),
                             loads=self.load_log.recent())

    def tier_of(self, name: str) -> str:
        """Where the current version of `name` is ("device", "host", "disk", "loading", "failed"); "" if the name is not
        loaded. O(1), unlike list()."""
        with self._lock:
            v = self._names.get(name)
            return v.state if v is not None else ""

    def wait_for_loads(self, timeout: float | None = None) -> bool:
        """Block until some background load finishes (or timeout); True if none is in flight afterwards.
        For an engine loop with nothing runnable but requests waiting on adapter loads."""
        with self._cond:
            if any(v.loading for v in self._versions):
                self._cond.wait(timeout)
            return not any(v.loading for v in self._versions)

    def pace_loads(self, running: int, queued: Sequence[tuple[AdapterRef, int]], max_wait: int) -> None:
        """Once per step, from the engine's loop where loads are paced (paces_loads): the CPU share adapter loads may
        take until the next one, from the requests in the step (`running`) and the queued ones - (adapter ref, steps
        waited) - whose adapter is not on the device yet, one of them overdue if it has waited max_wait (> 0) steps
        (load_pace.load_share, lora_load_cpu_share)."""
        with self._lock:
            late = [max_wait > 0 and age >= max_wait for ref, age in queued if not self._ready(ref._v)]
        self.load_share.set(load_share(self.config.lora_load_cpu_share, len(late), running, any(late)))

    def _ready(self, v: AdapterVersion) -> bool:
        """v's rows are on the device and written (a step may read them)."""
        return v.resident and not self.residency.copying(v)

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
                if real is None:  # not under the roots: the loader looks it up under the adapter sources
                    v = self._new_version(name, "", None, [0, 0], "load")
                else:
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
                t0 = time.perf_counter()
                if not self.residency.place(v):
                    return False  # rows taken in the other space stay cached (evictable, not pinned)
                self.load_log.record(HOST_TO_DEVICE, time.perf_counter() - t0)
                self.residency.trim_host()
            elif self.residency.copying(v) and self.load_share.get() < 1.0 and v.host.nbytes > PIECE_BYTES:
                return False  # placed ahead (prefetch), the CPU copier still writes its rows, paced: not waited for
            self.residency.sync(v)  # its copy ends before the step reads (CPU: waited for, unpaced, if placed just
            # now, if loads may take a whole core - nothing runs, or a request is overdue -, or if the copy is one
            # piece, which the pacer never pauses: a small adapter's request is not put off a step for it)
            v.active += 1
            ref.active = True
            self._touch(v)
            return True

    def prefetch(self, ref: AdapterRef, place: bool = True) -> str:
        """Move the ref's version toward the device ahead of its request's admission: once it is in host memory
        (acquire started the read), write it into free rows or rows of adapters no request holds, never rows a
        queued or running request may use (the copy overlaps the steps: residency.place). Pins nothing.
        -> where it is then: "device", "host", or "disk" (still loading, or its load failed); place=False only
        says where it is."""
        with self._lock:
            v = ref._v
            if v.resident:
                return "device"
            if v.host is None or ref.released:
                return "disk"
            if not place:
                return "host"
            t0 = time.perf_counter()
            if not self.residency.place(v, evict_held=False):
                return "host"
            self.load_log.record(HOST_TO_DEVICE, time.perf_counter() - t0)
            self.residency.trim_host()
            self._touch(v)
            return "device"

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
            self.residency.maybe_free(v)
            self.residency.trim_host()

    def build_lora_meta(self, refs: Sequence[AdapterRef | None], num_tokens: Sequence[int]) -> LoraBatchMeta | None:
        return build_lora_meta(refs, num_tokens, self.device)

    # ------------------------------------------------------------------ internals

    def _touch(self, v: AdapterVersion) -> None:
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
        err = self.residency.room_error(name, ranks)
        if err is not None:
            raise RequestError(field_name, err)
        return cfg, ranks

    def _resolve_first_use(self, name: str) -> str | None:
        """The local folder of `name` under the roots; None: not there, to be looked up under the sources."""
        if not self.roots and self.sources is None:
            raise RequestError("lora_name", f"unknown adapter {name!r} (not loaded, and no adapter_roots or "
                               f"adapter_sources are configured)")
        found = any(os.path.isdir(os.path.join(r, name)) for r in self.roots)
        if found:
            return resolve_adapter_path(name, self.roots, "lora_name")
        if self.sources is not None:
            return None
        raise RequestError("lora_name", f"unknown adapter {name!r}: not loaded, and no directory of that name "
                           f"under the adapter roots")

    def _new_version_at(self, name: str, path: str, field_name: str, kind: str) -> AdapterVersion:
        """A version to load from a local path (its config read and checked now) or from a URI under an adapter
        source (checked now, no I/O: the loader fetches it and reads its config)."""
        if is_uri(path):
            if self.sources is None:
                raise RequestError(field_name, f"{path!r} is a URI, and no adapter_sources are configured")
            return self._new_version(name, "", None, [0, 0], kind, source=self.sources.check(path, field_name))
        real = resolve_adapter_path(path, self.roots, field_name)
        cfg, ranks = self._read_config(real, name, "lora_path")
        return self._new_version(name, real, cfg, ranks, kind)

    def _new_version(self, name: str, path: str, cfg: AdapterConfigInfo | None, ranks: list[int], kind: str,
                     source: str = "") -> AdapterVersion:
        v = AdapterVersion(name, path, next(self._version_ids), cfg, ranks, kind, source)
        self._versions.add(v)
        self._touch(v)
        return v

    def _start_load(self, v: AdapterVersion) -> Future:
        v.loading = True
        fut: Future = Future()
        v.future = fut
        if v.source or not v.path:  # fetched first (its own threads), then read on the loader thread
            self._fetcher.submit(self._fetch_job, v, fut, time.perf_counter())
        else:
            self._executor.submit(self._load_job, v, fut, time.perf_counter())
        return fut

    def _fetch_job(self, v: AdapterVersion, fut: Future, t0: float) -> None:
        """Fetcher thread: the version's files into the local cache (config read and checked as a local adapter's is
        at load), then its read queued on the loader thread."""
        try:
            source = v.source or self.sources.find(v.name)
            cached = os.path.isdir(self.sources.cache.path_of(source)) and v.pending_kind != "reload"
            path = self.sources.fetch(source, refresh=v.pending_kind == "reload")
            cfg = v.config if v.config is not None else self._read_config(path, v.name, "lora_path")[0]
            self._executor.submit(self._load_job, v, fut, t0, (source, path, cfg,
                                                               DISK_TO_HOST if cached else REMOTE_TO_HOST))
        except Exception as e:  # noqa: BLE001 - AdapterLoadError, RequestError, any filesystem's, a closed loader
            self._publish(v, fut, None, _load_error(v.name, e), v.source, v.path, v.config, REMOTE_TO_HOST, t0)

    def _read_weights(self, path: str, name: str, cfg: AdapterConfigInfo) -> AdapterWeights:
        """Loader thread: an adapter's host weights, read and laid out by loom.lora.peft_loader.load_peft_adapter; in
        the loader process when its weights file has at least lora_load_process_min_bytes (the engine's interpreter
        and cores stay free for the steps), else here."""
        try:
            size = os.path.getsize(os.path.join(path, WEIGHTS_NAME))
        except OSError:
            size = 0  # load_peft_adapter reports it
        if size and size >= self.config.lora_load_process_min_bytes:
            w = self._process.load(path, name, cfg)
            return w.pin_memory() if self._pin else w
        return load_peft_adapter(path, name, self.spec, self.dtype, self.max_lora_rank, config=cfg,
                                 pin_memory=self._pin)

    def _load_job(self, v: AdapterVersion, fut: Future, t0: float, fetched: tuple | None = None) -> None:
        """Loader thread: read the version's weights (fetched: where _fetch_job put them) and publish them."""
        source, path, cfg, tier = fetched if fetched is not None else (v.source, v.path, v.config, DISK_TO_HOST)
        w, err = None, None
        try:
            w = self._read_weights(path, v.name, cfg)
        except Exception as e:  # noqa: BLE001 - report, never kill the loader thread
            err = _load_error(v.name, e)
        self._publish(v, fut, w, err, source, path, cfg, tier, t0)

    def _publish(self, v: AdapterVersion, fut: Future, w: AdapterWeights | None, err: str | None, source: str,
                 path: str, cfg: AdapterConfigInfo | None, tier: str, t0: float) -> None:
        """A load's end: the version's weights, or its error, made visible to the engine (under the lock)."""
        with self._cond:
            if err is None and v.content_hash and w.content_hash != v.content_hash:
                err = (f"adapter {v.name!r}: its files {f'at {source}' if source else f'in {path}'} changed on disk "
                       f"since it was loaded; "
                       f"call reload({v.name!r}) to serve the new weights")
                w = None
            ranks = [pool.rank_of(w) for pool in self.pools] if err is None else []
            if err is None:  # the weights decide (the loader checked them against the config's ranks)
                err = self.residency.room_error(v.name, ranks)
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
                self.residency.maybe_free(v)
            else:
                self.load_log.record(tier, time.perf_counter() - t0)
                v.source, v.path, v.config = source, path, cfg
                v.host, v.rank, v.ranks, v.scaling = w, w.rank, ranks, w.scaling
                v.content_hash, v.targets, v.error = w.content_hash, w.target_modules, None
                if v.pending_kind == "reload" and self._reloading.get(v.name) is v:
                    del self._reloading[v.name]
                    old = self._names.get(v.name)
                    self._names[v.name] = v
                    if old is not None:
                        old.stale = True
                        self.residency.maybe_free(old)
                v.pending_kind = ""
                self.residency.maybe_free(v)  # unloaded while loading and nobody holds it
                self.residency.trim_host()
            info = self._info(v)
            self._cond.notify_all()
        if err is None:
            fut.set_result(info)
        else:
            fut.set_exception(RequestError("lora_path", err))

    def _info(self, v: AdapterVersion) -> dict:
        return {
            "name": v.name,
            "path": v.path,
            "source": v.source,  # the URI of a fetched adapter, "" for a local one
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


def _load_error(name: str, e: Exception) -> str:
    """The message a failed load publishes (the request then fails with "lora_name: <it>")."""
    if isinstance(e, AdapterLoadError):
        return str(e)
    if isinstance(e, RequestError):  # a fetched adapter's config or URI refused as a local one's would be
        return str(e).removeprefix(f"{e.field}: ")
    return f"adapter {name!r}: unexpected error while loading: {e!r}"
