"""What the adapter registry reports for metrics: a snapshot of its tiers (LoraStats) and its recent load latencies.

Latencies are events, but the engine's stats are snapshots that several readers take at their own pace, so the
registry keeps the most recent RECENT_LOADS loads numbered in order (LoadLog): a reader remembers the last number it
has seen and takes the newer ones (none is lost unless more than RECENT_LOADS loads happen between two reads).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# The tiers a load moves an adapter between (the `tier` label of loom_lora_load_seconds)
DISK_TO_HOST = "disk_to_host"  # a local folder (or a fetched adapter already in the cache) read into host memory
REMOTE_TO_HOST = "remote_to_host"  # fetched from an adapter source into the cache, then read
HOST_TO_DEVICE = "host_to_device"  # host weights written into device rows (on CUDA: the copies' launch)
LOAD_TIERS = (DISK_TO_HOST, REMOTE_TO_HOST, HOST_TO_DEVICE)
RECENT_LOADS = 1024


@dataclass(frozen=True)
class AdapterLoad:
    seq: int  # 1, 2, ... in the order loads finished
    tier: str  # one of LOAD_TIERS
    seconds: float


@dataclass(frozen=True)
class LoraStats:
    device_adapters: int = 0  # versions with rows in every space they target
    host_adapters: int = 0  # versions in host memory only (the host tier that max_host_adapters bounds)
    host_bytes: int = 0  # their weights' bytes (what max_host_adapter_bytes bounds)
    device_evictions: int = 0  # since start: rows taken back from a version for another (every space)
    host_evictions: int = 0  # since start: host copies dropped to disk
    cache_bytes: int = 0  # the fetched adapters' local cache
    cache_evictions: int = 0  # since start: cache entries dropped for the byte budget
    remote_fetches: int = 0  # since start: transfers from the adapter sources
    device_bytes: int = 0  # bytes of the device rows versions hold (every space)
    compactions: int = 0  # since start: compactions of device rows (every space)
    load_cpu_share: float = 1.0  # the CPU share loads may take now (loom.lora.load_pace; 1.0 on CUDA: unpaced)
    loads: tuple[AdapterLoad, ...] = ()  # the most recent, oldest first


class LoadLog:
    """The most recent load latencies, numbered; not thread-safe (the registry records under its lock)."""

    def __init__(self, maxlen: int = RECENT_LOADS):
        self._recent: deque[AdapterLoad] = deque(maxlen=maxlen)
        self._seq = 0
        self._snapshot: tuple[AdapterLoad, ...] = ()  # rebuilt per load, not per read: reads happen every step

    def record(self, tier: str, seconds: float) -> None:
        self._seq += 1
        self._recent.append(AdapterLoad(self._seq, tier, seconds))
        self._snapshot = tuple(self._recent)

    def recent(self) -> tuple[AdapterLoad, ...]:
        return self._snapshot
