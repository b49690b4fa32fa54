"""Where the loader process lays adapters out: slots of a few anonymous memory files (chunks) that both the engine's
process and the loader process keep mapped, so that a load writes into pages that earlier loads already faulted in.

Why: a fresh memory file per adapter (the hand-over before this) cost its pages' first touches on every load - ~8 of
a rank-16 float32 adapter's ~27 ms of loader CPU for its 20 MB on a 2-core Zen 5 VM - and the engine's process faulted
them in again when it copied them into rows. A slot freed when the host tier drops an adapter is written again by a
later load: its pages stay mapped on both sides.

Engine side (`Arena`): chunks of at least CHUNK_BYTES (larger for an adapter that needs more), slots allocated first
fit in pages; `alloc` before the loader writes, `adopt` makes the slot's tensors once it has (numpy arrays viewing the
chunk: the last tensor viewing a slot frees it, through a finalizer on its array - whatever holds the adapter's
tensors, the host tier, a copy in flight, a test, keeps its slot). A chunk left empty, other than the newest, is
unmapped and closed here and in the loader process (`dropped`, sent with the next job). Thread-safe: finalizers run on
any thread.

Loader side (`ChunkMaps`): the chunks it was sent (their descriptors come over the job socket), mapped once;
`slot` gives a slot's bytes, zeroed (the layout writes only what the adapter targets), as a tensor.
"""
from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Callable

import numpy as np
import torch

from loom.lora.load_pace import PIECE_BYTES
from loom.lora.lora_pool import RowAllocator

CHUNK_BYTES = 64 << 20
PAGE = 4096


def _pages(nbytes: int) -> int:
    return max(1, -(-nbytes // PAGE))


class _Chunk:
    def __init__(self, cid: int, size: int):
        self.cid, self.size = cid, size
        self.fd = os.memfd_create(f"loom-lora-arena-{cid}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.pages = RowAllocator(size // PAGE)

    def close(self) -> None:
        """Close the descriptor and drop the mapping: it is unmapped when the last array viewing it is gone (closing
        it here would fail while one still does, e.g. inside the finalizer of the slot that emptied the chunk)."""
        os.close(self.fd)
        self.map = None


class Arena:
    """The engine side (module docstring)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[int, _Chunk] = {}
        self._next = 0
        self._dropped: list[int] = []
        self._empty: set[int] = set()  # chunks a free emptied: closed at the next alloc / dropped (a safe point)
        self._lock = threading.RLock()  # a finalizer may free a slot on a thread that holds it (GC inside alloc)

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """A slot of nbytes -> (chunk id, byte offset)."""
        pages = _pages(nbytes)
        with self._lock:
            self._reap()
            for c in list(self._chunks.values()):
                start = c.pages.alloc(pages)
                if start is not None:
                    return c.cid, start * PAGE
            size = max(self.chunk_bytes, pages * PAGE)
            c = _Chunk(self._next, size)
            self._next += 1
            self._chunks[c.cid] = c
            c.pages.alloc(pages)
            return c.cid, 0

    def fd(self, cid: int) -> tuple[int, int]:
        """A chunk's descriptor and size (to send it to the loader process)."""
        c = self._chunks[cid]
        return c.fd, c.size

    def free(self, cid: int, off: int, nbytes: int) -> None:
        with self._lock:
            c = self._chunks.get(cid)
            if c is None:
                return
            c.pages.free(off // PAGE, _pages(nbytes))
            if c.pages.num_free == c.pages.capacity and cid != self._next - 1:
                self._empty.add(cid)

    def _reap(self) -> None:
        for cid in sorted(self._empty):
            c = self._chunks.get(cid)
            if c is not None and c.pages.num_free == c.pages.capacity:
                del self._chunks[cid]
                c.close()
                self._dropped.append(cid)
        self._empty.clear()

    def dropped(self) -> list[int]:
        """Chunks closed here since the last call (the loader process closes its mappings of them)."""
        with self._lock:
            self._reap()
            out, self._dropped = self._dropped, []
            return out

    def adopt(self, cid: int, off: int, nbytes: int, layout: dict) -> dict:
        """The slot's tensors by layout {"a"/"b": {group: (offset in the slot, shape, dtype)}}; the slot is freed when
        the last of them (or of their views) is gone."""
        arr = np.frombuffer(self._chunks[cid].map, dtype=np.uint8, count=nbytes, offset=off)
        weakref.finalize(arr, self.free, cid, off, nbytes)
        return views(torch.from_numpy(arr), layout)

    def bytes(self) -> int:
        with self._lock:
            return sum(c.size for c in self._chunks.values())

    def close(self) -> None:
        """Close every chunk (a chunk still viewed by adopted slots' tensors is unmapped when they are gone)."""
        with self._lock:
            for c in self._chunks.values():
                c.close()
            self._chunks.clear()


class ChunkMaps:
    """The loader side (module docstring)."""

    def __init__(self):
        self._maps: dict[int, torch.Tensor] = {}  # a chunk's bytes (the tensor keeps its mapping)

    def add(self, cid: int, fd: int, size: int) -> None:
        try:
            self._maps[cid] = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        finally:
            os.close(fd)

    def drop(self, cids: list[int]) -> None:
        """Unmap these chunks (with the last view of them)."""
        for cid in cids:
            self._maps.pop(cid, None)

    def slot(self, cid: int, off: int, nbytes: int, pace: Callable[[], None]) -> torch.Tensor:
        """The slot's bytes, zeroed in pieces of PIECE_BYTES (pace between them)."""
        buf = self._maps[cid][off:off + nbytes]
        for i in range(0, nbytes, PIECE_BYTES):
            buf[i:i + PIECE_BYTES].zero_()
            pace()
        return buf


def views(buf: torch.Tensor, layout: dict) -> dict:
    """{"a"/"b": {group: tensor}} of a slot's bytes, by layout {"a"/"b": {group: (offset, shape, dtype)}} (the same
    on both sides)."""
    return {kind: {g: buf[off:off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
                   for g, (off, shape, dtype) in layout[kind].items()} for kind in ("a", "b")}
