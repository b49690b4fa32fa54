"""The local disk cache of fetched adapters: one folder per source URI, a byte budget, least recently used dropped.

An entry is whole or absent: a fetch writes into a temporary folder beside the entries, checks what it wrote (the
sizes the source reported, adapter_config.json parses to an object, the safetensors header reads and its tensors
end where the file ends), then renames the folder into place. A failed or partial fetch removes its temporary
folder, so the cache never holds, and never serves, half an adapter. Entries are named by a hash of their URI and
found again after a restart (their folders' modification times order them; a use touches its folder).

Thread-safe: concurrent gets of one URI fetch it once (the others wait for that fetch and use its entry). Several
processes may share a folder: an entry renamed into place by another process first wins, and this one's copy is
discarded. Leftovers of a process killed mid-fetch (`.tmp-*` folders) are not counted and not served.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
from typing import Callable

from loom.lora.peft_config import CONFIG_NAME, SAFETENSORS_MAX_HEADER, WEIGHTS_NAME, AdapterLoadError

ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # all that peft_loader reads

# copy(file name, local destination path): writes one file of the adapter, raising on any failure
Copier = Callable[[str, str], None]


def check_adapter_files(folder: str, sizes: dict[str, int]) -> None:
    """Raise AdapterLoadError unless `folder` holds the adapter files whole: the expected sizes, a JSON object
    config, a readable safetensors header whose tensors fill the file."""
    for fname, size in sizes.items():
        got = os.path.getsize(os.path.join(folder, fname))
        if got != size:
            raise AdapterLoadError(f"{fname}: fetched {got} bytes of {size} (incomplete transfer)")
    try:
        with open(os.path.join(folder, CONFIG_NAME), "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise AdapterLoadError(f"{CONFIG_NAME} does not parse: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterLoadError(f"{CONFIG_NAME} is not a JSON object")
    path = os.path.join(folder, WEIGHTS_NAME)
    total = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(SAFETENSORS_MAX_HEADER, total - 8):
                raise ValueError(f"header length {n} past the end of the file")
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise AdapterLoadError(f"{WEIGHTS_NAME}: unreadable safetensors header ({e})") from None
    if 8 + n + end != total:
        raise AdapterLoadError(f"{WEIGHTS_NAME}: its tensors end at byte {8 + n + end}, the file has {total} "
                               "(truncated or corrupt)")


class AdapterCache:
    def __init__(self, folder: str, max_bytes: int):
        self.folder = folder
        self.max_bytes = int(max_bytes)
        os.makedirs(folder, exist_ok=True)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a fetch ended, or a get started waiting for one
        self._fetching: set[str] = set()  # keys being fetched (by one thread each)
        self._entries: dict[str, int] = {}  # key -> bytes, least recently used first
        self.fetches = 0  # transfers committed
        self.evictions = 0
        self.waiting = 0  # gets waiting for another thread's fetch of their URI
        found = []
        for key in os.listdir(folder):
            path = os.path.join(folder, key)
            if not key.startswith(".") and os.path.isdir(path):
                found.append((os.path.getmtime(path), key, sum(_size(path, f) for f in ADAPTER_FILES)))
        for _, key, size in sorted(found):
            self._entries[key] = size

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    def path_of(self, uri: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(uri.encode()).hexdigest()[:40])

    def get(self, uri: str, sizes: Callable[[], dict[str, int]], copy: Copier, refresh: bool = False) -> str:
        """The local folder holding the adapter at `uri`, fetched first unless cached (or when `refresh`).
        `sizes()` gives each file's size at the source (called only to fetch); `copy` transfers one file."""
        path = self.path_of(uri)
        key = os.path.basename(path)
        with self._changed:
            if key in self._fetching:  # one fetch per URI: wait for it, then use its entry (or fetch if it failed)
                self.waiting += 1
                self._changed.notify_all()
                self._changed.wait_for(lambda: key not in self._fetching)
                self.waiting -= 1
            if key in self._entries and not refresh and os.path.isdir(path):
                self._touch(key, path)
                return path
            self._fetching.add(key)
        try:
            self._fetch(uri, path, sizes(), copy)
        finally:
            with self._changed:
                self._fetching.discard(key)
                self._changed.notify_all()
        return path

    def _fetch(self, uri: str, path: str, sizes: dict[str, int], copy: Copier) -> None:
        need = sum(sizes.values())
        if need > self.max_bytes:
            raise AdapterLoadError(f"{uri} is {need} bytes, more than the whole adapter cache: raise "
                                   f"adapter_cache_bytes (now {self.max_bytes}) to at least {need}")
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=self.folder)
        try:
            for fname in sizes:
                copy(fname, os.path.join(tmp, fname))
            check_adapter_files(tmp, sizes)
            with open(os.path.join(tmp, ".uri"), "w") as f:  # which URI an entry is (for people reading the cache)
                f.write(uri)
            key = os.path.basename(path)
            with self._lock:
                if os.path.isdir(path):  # a refresh, or another process's copy
                    self._remove(key, path)
                try:
                    os.rename(tmp, path)
                except OSError:
                    if not os.path.isdir(path):
                        raise
                    # another process put the entry in place between the check and the rename: theirs wins
                self._entries[key] = need
                self._touch(key, path)
                self.fetches += 1
                self._trim(keep=key)
        except AdapterLoadError as e:
            raise AdapterLoadError(f"fetching {uri}: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _touch(self, key: str, path: str) -> None:
        self._entries[key] = self._entries.pop(key)
        try:
            os.utime(path)  # the order survives a restart
        except OSError:
            pass

    def _trim(self, keep: str) -> None:
        """Drop least recently used entries (never `keep`, nor one being fetched) until the cache fits its budget."""
        total = sum(self._entries.values())
        for key in list(self._entries):
            if total <= self.max_bytes:
                return
            if key == keep or key in self._fetching:
                continue
            total -= self._entries[key]
            self._remove(key, os.path.join(self.folder, key))
            self.evictions += 1

    def _remove(self, key: str, path: str) -> None:
        """Out of the index and, atomically for readers, off the disk (renamed aside before it is deleted)."""
        self._entries.pop(key, None)
        trash = tempfile.mkdtemp(prefix=".tmp-", dir=self.folder)
        try:
            os.rename(path, os.path.join(trash, "entry"))
        except OSError:
            pass  # already gone
        shutil.rmtree(trash, ignore_errors=True)


def _size(folder: str, fname: str) -> int:
    try:
        return os.path.getsize(os.path.join(folder, fname))
    except OSError:
        return 0
