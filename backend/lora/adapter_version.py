"""One version of an adapter (AdapterVersion), a request's hold on it (AdapterRef), and the row-space indices.

A version is one load or reload of a name (loom.lora.adapter_registry). Its record is what the other pieces of the
registry share, so it lives apart from all of them: the name API sets its name, path and lifecycle flags, the
background loader its weights, error and future, the row residency (loom.lora.residency) its device rows and LRU
clock, and the batch metadata (loom.lora.batch_meta) reads its rows, ranks, scaling and targets. The record holds
state only; the registry's lock guards it.

Row spaces: DENSE (attention, dense MLP) and EXPERT (MoE experts) index AdapterRegistry.pools and a version's
`rows` / `ranks`; SPACE_FIELDS names the EngineConfig field that sizes each.
"""
from __future__ import annotations

from concurrent.futures import Future

from loom.lora.peft_config import AdapterConfigInfo
from loom.lora.peft_loader import AdapterWeights

DENSE, EXPERT = 0, 1  # row spaces: index into AdapterRegistry.pools and AdapterVersion.rows / .ranks
SPACE_NAMES = ("dense", "expert")
SPACE_FIELDS = ("lora_memory_bytes", "lora_expert_memory_bytes")  # the EngineConfig field sizing each space


class AdapterVersion:
    __slots__ = ("name", "path", "source", "version", "config", "rank", "ranks", "scaling", "host", "loading",
                 "error", "refcount", "active", "rows", "last_used", "stale", "content_hash", "targets",
                 "pending_kind", "future")

    def __init__(self, name: str, path: str, version: int, config: AdapterConfigInfo | None, ranks: list[int],
                 pending_kind: str, source: str = ""):
        self.name = name
        self.path = path  # the local folder read ("" until a remote adapter is first fetched)
        # a fetched adapter's URI (loom.lora.adapter_sources); "" = local, or, with no path either, not known yet:
        # the loader looks its name up under the adapter sources
        self.source = source
        self.version = version
        self.config = config  # None until the loader has fetched a remote adapter and read its config
        self.rank = config.max_rank if config else 0  # largest module rank; final once loaded
        self.ranks = list(ranks)  # rows per space (0 = targets nothing there); final once loaded
        self.scaling = config.scaling_for(config.r, config.lora_alpha) if config else 0.0
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
        """Rows in every space it targets (what a step needs); never while its ranks are unknown (being fetched)."""
        return any(self.ranks) and all(start >= 0 for start, rank in zip(self.rows, self.ranks) if rank)

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

    def __init__(self, v: AdapterVersion):
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
