"""The adapter loader process: reads, checks and lays out adapters (loom.lora.peft_loader.load_peft_adapter, the one
function that makes the per-group A / B^T tensors) in a process of its own, and hands the laid-out weights back in
shared memory.

Why a process: a load of a rank-16 adapter of the default model is ~200 ms of reading, parsing, checking and
converting. On a thread of the engine's process it holds the interpreter between its torch ops (the engine loop
waits for it) and its ops take a core from the compute threads' team (the step waits for its slowest thread): the
running streams' steps doubled during loads. The child runs at a low CPU priority (NICE) with one torch thread, so
the kernel gives the engine's threads the cores first; the engine's process only maps the result.

Hand-over: the child lays every tensor of the AdapterWeights out (MemfdAlloc), in the layout the host tier keeps and
the pools take (A [group layers, (E,) S, r, in], B^T [group layers, (E,) r, out]), at 64-byte aligned offsets in one
anonymous memory file (memfd_create: no name, nothing left in /dev/shm whatever happens), and sends its descriptor
(SCM_RIGHTS) with the offsets, shapes and dtypes. The parent maps it; the host tier's tensors are views of the mapping
(freed with them): no copy on either side; the copy into device rows is loom.lora.residency's, off the step's path.

Lifetime: started at the first job (a fresh interpreter, as multiprocessing's spawn, but never re-running the
engine's __main__), owned by the registry: `close()` sends a stop, joins, then terminates /
kills; a finalizer does the same if the owner is dropped without it. The child exits when its pipe reads end-of-file
or its parent changes (the engine's process exited or was killed, even mid-load). A child found dead is replaced
and the job sent once more; a job that kills it twice fails alone (the adapter's error says so). One job at a time:
the registry's single loader thread is the only caller of `load`.
"""
from __future__ import annotations

import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import torch

from loom.lora.load_pace import LoadShare, Pacer
from loom.lora.peft_config import AdapterConfigInfo, AdapterLoadError
from loom.lora.peft_loader import AdapterWeights, LoraModelSpec, load_peft_adapter

log = logging.getLogger("loom")

# The child's CPU priority: a trade between the running streams' steps and the requests waiting for their adapter.
# 19 starved it on a 2-core box whose two compute threads kept both cores busy (loads never ended); at 10 a rank-16
# load of the default model took ~0.45 s under load, and with 1,000 adapters (bench_lora --adapters 1000 --popularity
# zipf:1.0, 120 disk reads in a run) the reads queued behind each other: 0.23x the one-adapter tokens/s, queue times
# past the admission bound, no recovery after a popularity shift. At 5: 0.59x (0 gave the same), every queue time
# within the bound, recovered at once; the steps while a load runs are slower (bench_lora --load-during).
NICE = 5
_ALIGN = 64


# The child: a fresh interpreter (nothing of the engine's process inherited), which lowers its CPU priority to
# argv[2] first (its imports of torch and loom are seconds of CPU: at the engine's priority they would take a core
# from the running streams), then takes the engine's sys.path and its arguments over the socket it is given
# (argv[1]); never the engine's __main__ (as multiprocessing's spawn would).
_BOOT = ("import os, sys\ntry:\n    os.nice(int(sys.argv[2]))\nexcept OSError:\n    pass\n"
         "from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
         "sys.path[:0] = [p for p in c.recv() if p not in sys.path]; "
         "from loom.lora.load_process import child_main; child_main(c, *c.recv())")


def _python() -> str:
    # Inside an embedding process (Triton's Python backend stub) sys.executable may not be a Python interpreter.
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    return os.path.join(sys.exec_prefix, "bin", "python3")


class MemfdAlloc:
    """Child: load_peft_adapter's allocation (peft_loader.Alloc) in one anonymous memory file (zero-filled, as the
    layout needs), so the laid-out weights are written where the parent maps them: no copy into the file after the
    load (7 of a rank-16 bfloat16 adapter's ~32 ms of CPU). The descriptor is the caller's to close."""

    def __init__(self, name: str):
        self.name, self.fd, self.layout, self.size = name, -1, {"a": {}, "b": {}}, 0

    def __call__(self, shapes, dtype: torch.dtype) -> dict:
        off = 0
        for kind, g, shape in shapes:  # offsets 64-byte aligned
            self.layout[kind][g] = (off, tuple(shape), dtype)
            off += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.size = max(off, _ALIGN)
        self.fd = os.memfd_create(f"loom-lora-{self.name}"[:240], os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        return {(kind, g): t for kind, parts in _views(self.fd, self.layout, self.size).items()
                for g, t in parts.items()}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _views(fd: int, layout: dict, size: int) -> dict:
    """{"a"/"b": {group: tensor}} viewing the memory file; the mapping lives as long as any of them."""
    buf = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    return {kind: {g: buf[off:off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
                   for g, (off, shape, dtype) in layout[kind].items()} for kind in ("a", "b")}


def load_packed(path: str, name: str, spec: LoraModelSpec, dtype: torch.dtype, max_lora_rank: int,
                config: AdapterConfigInfo, pace=None) -> tuple[int, dict]:
    """Child: one adapter read and laid out straight into a memory file -> (its descriptor, what `unpack` needs).
    pace: the child's Pacer (loom.lora.load_pace), called between pieces of the work."""
    mem = MemfdAlloc(name)
    try:
        w = load_peft_adapter(path, name, spec, dtype, max_lora_rank, config=config, alloc=mem, map_file=True,
                              **({"pace": pace} if pace is not None else {}))
    except BaseException:
        mem.close()
        raise
    meta = {"name": w.name, "path": w.path, "rank": w.rank, "scaling": w.scaling, "target_modules": w.target_modules,
            "content_hash": w.content_hash, "ranks": w.ranks, "layout": mem.layout, "size": mem.size}
    return mem.fd, meta


def unpack(fd: int, meta: dict) -> AdapterWeights:
    """Parent: map the child's memory file (the descriptor is closed here) -> AdapterWeights viewing it."""
    try:
        parts = _views(fd, meta["layout"], meta["size"])
    finally:
        os.close(fd)
    return AdapterWeights(meta["name"], meta["path"], meta["rank"], meta["scaling"], parts["a"], parts["b"],
                          meta["target_modules"], meta["content_hash"], meta["ranks"])


def _watch_parent(parent: int) -> None:
    """Child: exit at once when the engine's process is gone (reparented), even in the middle of a load."""
    import time

    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def child_main(conn, parent: int, spec: LoraModelSpec, dtype: torch.dtype, max_lora_rank: int,
               share_fd: int) -> None:
    """The loader process of engine process `parent`: jobs (path, name, config) -> ("ok", meta) + the memory file's
    descriptor, or ("error", message naming the adapter); None or end-of-file: exit. share_fd: the engine's
    LoadShare (the CPU share its loads may take, loom.lora.load_pace), which paces every job."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the engine's terminal: the engine stops it
    torch.set_num_threads(1)  # (its priority was lowered by _BOOT before any import)
    pace = Pacer(LoadShare(share_fd).get)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        path, name, config = job
        try:
            fd, meta = load_packed(path, name, spec, dtype, max_lora_rank, config, pace)
        except AdapterLoadError as e:
            conn.send(("error", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - report, never end the loader on one adapter
            conn.send(("error", f"adapter {name!r}: unexpected error while loading: {e!r}"))
            continue
        try:
            conn.send(("ok", meta))
            send_handle(conn, fd, parent)
        finally:
            os.close(fd)


def _stop(state: dict, timeout: float) -> None:
    proc, conn = state.pop("proc", None), state.pop("conn", None)
    if proc is None:
        return
    try:
        conn.send(None)
    except (OSError, ValueError):
        pass
    for end in (proc.terminate, proc.kill, None):
        try:
            proc.wait(timeout)
            break
        except subprocess.TimeoutExpired:
            if end is None:
                raise
            end()
            timeout = 2.0
    conn.close()


class LoaderProcess:
    """The registry's loader process (module docstring): `load` on the loader thread, `close` at engine close."""

    def __init__(self, spec: LoraModelSpec, dtype: torch.dtype, max_lora_rank: int, share: LoadShare | None = None,
                 nice: int = NICE):
        """share: the engine's LoadShare (the child maps it: the CPU share its loads may take); None: a share of
        its own, a whole core (unpaced)."""
        self._own_share = share is None
        self._args, self._nice, self._share = (spec, dtype, max_lora_rank), nice, share or LoadShare()
        self._state: dict = {}  # "proc", "conn" while one runs
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._state, 0.0)

    @property
    def pid(self) -> int | None:
        proc = self._state.get("proc")
        return proc.pid if proc is not None else None

    def _start(self) -> None:
        mine, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([_python(), "-c", _BOOT, str(theirs.fileno()), str(self._nice)],
                                    pass_fds=(theirs.fileno(), self._share.fd), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()  # only the child holds its end: it reads end-of-file when this process goes
        conn = Connection(mine.detach())
        self._state.update(proc=proc, conn=conn)
        conn.send(list(sys.path))
        conn.send((os.getpid(), *self._args, self._share.fd))
        log.info("adapter loader process started (pid %d)", proc.pid)

    def load(self, path: str, name: str, config: AdapterConfigInfo) -> AdapterWeights:
        """Read and lay out one adapter in the loader process (started here if none runs). Raises AdapterLoadError
        (the child's, or its death's). A child found dead is replaced and the job sent once more (it may have died
        between jobs; a job that kills it twice fails)."""
        for attempt in (1, 2):
            if self._closed:
                raise AdapterLoadError(f"adapter {name!r}: the engine is shutting down")
            if "proc" not in self._state:
                self._start()
            conn, proc = self._state["conn"], self._state["proc"]
            try:
                conn.send((path, name, config))
                status, payload = conn.recv()
                if status == "error":
                    raise AdapterLoadError(payload)
                fd = recv_handle(conn)
                break
            except (EOFError, OSError) as e:
                try:
                    proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
                code = proc.returncode
                _stop(self._state, 0.0)  # a new one starts at the next try
                if attempt == 2 or self._closed:
                    why = "was stopped" if self._closed else f"exited (code {code}, {e!r})"
                    raise AdapterLoadError(f"adapter {name!r}: the adapter loader process {why} while loading it") \
                        from None
        return unpack(fd, payload)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (idempotent); a load in flight fails."""
        self._closed = True
        self._finalizer.detach()
        _stop(self._state, timeout)
        if self._own_share:
            self._share.close()
