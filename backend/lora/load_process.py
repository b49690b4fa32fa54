"""The adapter loader process: reads, checks and lays out adapters (loom.lora.peft_loader.load_peft_adapter, the one
function that makes the per-group A / B^T tensors) in a process of its own, and hands the laid-out weights back in
shared memory.

Why a process: a load of a rank-16 adapter of the default model is tens of ms of reading, parsing, checking and
converting. On a thread of the engine's process it holds the interpreter between its torch ops (the engine loop
waits for it) and its ops take a core from the compute threads' team (the step waits for its slowest thread): the
running streams' steps doubled during loads. The child runs with one torch thread (priority NICE), paced
to the CPU share the engine sets each step (loom.lora.load_pace); the engine's process only views the result.

Hand-over: the child lays every tensor of the AdapterWeights out (SlotAlloc), in the layout the host tier keeps and
the pools take (A [group layers, (E,) S, r, in], B^T [group layers, (E,) r, out]), at 64-byte aligned offsets in a
slot of the engine's arena (loom.lora.load_arena: anonymous memory files both processes keep mapped, their
descriptors sent once over the job socket, SCM_RIGHTS): it asks for a slot of the layout's size ("need"), the engine
allocates it, the child writes there and sends the offsets, shapes and dtypes. The host tier's tensors are views of
the slot (freed with the last of them): no copy on either side, and pages earlier loads faulted in are written again;
the copy into device rows is loom.lora.residency's, off the step's path.

Lifetime: started at the first job (a fresh interpreter, as multiprocessing's spawn, but never re-running the
engine's __main__), owned by the registry: `close()` sends a stop, joins, then terminates /
kills; a finalizer does the same if the owner is dropped without it. The child exits when its pipe reads end-of-file
or its parent changes (the engine's process exited or was killed, even mid-load). A child found dead is replaced
and the job sent once more; a job that kills it twice fails alone (the adapter's error says so). One job at a time:
the registry's single loader thread is the only caller of `load`.
"""
from __future__ import annotations

import gc
import logging
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

from loom.lora.load_arena import Arena, ChunkMaps, views
from loom.lora.load_pace import LoadShare, Pacer
from loom.lora.peft_config import AdapterConfigInfo, AdapterLoadError
from loom.lora.peft_loader import AdapterWeights, LoraModelSpec, load_peft_adapter

log = logging.getLogger("loom")

# The child's CPU priority (nice). Its CPU share is the pacer's (loom.lora.load_pace), which holds it to
# lora_load_cpu_share of a core while requests run; the priority only decides how much of a core it gets when the share
# is larger (requests waiting for their adapters) and every core is busy. At 5 (before the pacing) it got about a
# quarter of a core there: bench_lora --adapters 1000 --popularity zipf:1.0 read adapters p50 5.0 s after their
# request (0.49-0.53x the one-adapter tokens/s); at 0 2.7 s (0.59x), every queue within the admission bound, and the
# steps while it loads paced as slow as at 5 (--load-during: p50 +1%). Its boot (importing torch and loom, ~1.25 s of
# CPU) is not paced: a server starts it at initialize (AdapterRegistry.start_loader), before requests stream.
NICE = 0
_ALIGN = 64


# The child: a fresh interpreter (nothing of the engine's process inherited), which sets its CPU priority to argv[2]
# first (before its imports, seconds of CPU), then takes the engine's sys.path and its arguments over the socket it is
# given (argv[1]); never the engine's __main__ (as multiprocessing's spawn would).
_BOOT = ("import os, sys\ntry:\n    os.nice(int(sys.argv[2]))\nexcept OSError:\n    pass\n"
         "from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
         "sys.path[:0] = [p for p in c.recv() if p not in sys.path]; "
         "from loom.lora.load_process import child_main; child_main(c, *c.recv())")


def _python() -> str:
    # Inside an embedding process (Triton's Python backend stub) sys.executable may not be a Python interpreter.
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    return os.path.join(sys.exec_prefix, "bin", "python3")


class SlotAlloc:
    """Child: load_peft_adapter's allocation (peft_loader.Alloc) in a slot of the engine's arena
    (loom.lora.load_arena): asks the engine for a slot of the layout's size ("need"), maps any chunk it is sent, and
    returns the slot's views, zeroed (the layout writes only what the adapter targets)."""

    def __init__(self, conn, chunks: ChunkMaps, pace):
        self.conn, self.chunks, self.pace = conn, chunks, pace
        self.layout, self.size = {"a": {}, "b": {}}, 0

    def __call__(self, shapes, dtype: torch.dtype) -> dict:
        off = 0
        for kind, g, shape in shapes:  # offsets 64-byte aligned
            self.layout[kind][g] = (off, tuple(shape), dtype)
            off += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.size = max(off, _ALIGN)
        self.conn.send(("need", self.size))
        while True:
            msg = self.conn.recv()
            if msg[0] == "chunk":
                self.chunks.add(msg[1], recv_handle(self.conn), msg[2])
                continue
            _, cid, slot_off = msg
            break
        buf = self.chunks.slot(cid, slot_off, self.size, self.pace)
        return {(kind, g): t for kind, parts in views(buf, self.layout).items() for g, t in parts.items()}


def load_packed(conn, chunks: ChunkMaps, path: str, name: str, spec: LoraModelSpec, dtype: torch.dtype,
                max_lora_rank: int, config: AdapterConfigInfo, pace) -> dict:
    """Child: one adapter read and laid out straight into a slot of the engine's arena -> what the engine's `adopt`
    needs. pace: the child's Pacer (loom.lora.load_pace), called between pieces of the work."""
    mem = SlotAlloc(conn, chunks, pace)
    w = load_peft_adapter(path, name, spec, dtype, max_lora_rank, config=config, alloc=mem, map_file=True, pace=pace)
    return {"name": w.name, "path": w.path, "rank": w.rank, "scaling": w.scaling, "target_modules": w.target_modules,
            "content_hash": w.content_hash, "ranks": w.ranks, "layout": mem.layout, "size": mem.size}


def _watch_parent(parent: int) -> None:
    """Child: exit at once when the engine's process is gone (reparented), even in the middle of a load."""
    import time

    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def child_main(conn, parent: int, spec: LoraModelSpec, dtype: torch.dtype, max_lora_rank: int,
               share_fd: int) -> None:
    """The loader process of engine process `parent`: jobs (path, name, config, chunks to drop) -> ("need", bytes)
    answered by the engine's ("chunk", id, size) + its descriptor (a chunk this process has not mapped yet) and
    ("slot", chunk id, offset); then ("ok", meta) or ("error", message naming the adapter); None or end-of-file:
    exit. share_fd: the engine's LoadShare (the CPU share its loads may take, loom.lora.load_pace), which paces every
    job."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the engine's terminal: the engine stops it
    torch.set_num_threads(1)  # (its priority was lowered by _BOOT before any import)
    # What the imports made (~360k objects of torch and loom) lives as long as the process: out of the collector's
    # passes, which otherwise scanned it all again and again under the loads' garbage (~11% of the process's CPU in a
    # run of cold loads; a full pass is ~0.2 s of a core)
    gc.collect()
    gc.freeze()
    pace = Pacer(LoadShare(share_fd).get)
    chunks = ChunkMaps()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        path, name, config, dropped = job
        chunks.drop(dropped)
        try:
            meta = load_packed(conn, chunks, path, name, spec, dtype, max_lora_rank, config, pace)
        except AdapterLoadError as e:
            conn.send(("error", str(e)))
            continue
        except (EOFError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - report, never end the loader on one adapter
            conn.send(("error", f"adapter {name!r}: unexpected error while loading: {e!r}"))
            continue
        conn.send(("ok", meta))


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
        self.arena = Arena()  # where the child lays adapters out (loom.lora.load_arena)
        self._sent_chunks: set[int] = set()  # the arena's chunks the running child has mapped
        self._state: dict = {}  # "proc", "conn" while one runs
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._state, 0.0)

    @property
    def pid(self) -> int | None:
        proc = self._state.get("proc")
        return proc.pid if proc is not None else None

    def ensure_started(self) -> None:
        """Start the child if none runs (the caller of `load`'s thread only: one at a time)."""
        if "proc" not in self._state and not self._closed:
            self._start()

    def _start(self) -> None:
        self._sent_chunks = set()  # a new process has mapped none of the arena's chunks
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
        """Read and lay out one adapter in the loader process (started here if none runs), into a slot of the arena.
        Raises AdapterLoadError (the child's, or its death's). A child found dead is replaced and the job sent once
        more (it may have died between jobs; a job that kills it twice fails)."""
        for attempt in (1, 2):
            if self._closed:
                raise AdapterLoadError(f"adapter {name!r}: the engine is shutting down")
            self.ensure_started()
            conn, proc = self._state["conn"], self._state["proc"]
            slot = None
            try:
                conn.send((path, name, config, self.arena.dropped()))
                while True:
                    msg = conn.recv()
                    if msg[0] == "need":
                        slot = (*self.arena.alloc(msg[1]), msg[1])
                        if slot[0] not in self._sent_chunks:
                            fd, size = self.arena.fd(slot[0])
                            conn.send(("chunk", slot[0], size))
                            send_handle(conn, fd, proc.pid)
                            self._sent_chunks.add(slot[0])
                        conn.send(("slot", slot[0], slot[1]))
                        continue
                    if msg[0] == "error":
                        raise AdapterLoadError(msg[1])
                    meta = msg[1]
                    parts = self.arena.adopt(*slot, meta["layout"])
                    slot = None  # its tensors free it now
                    return AdapterWeights(meta["name"], meta["path"], meta["rank"], meta["scaling"], parts["a"],
                                          parts["b"], meta["target_modules"], meta["content_hash"], meta["ranks"])
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
            finally:
                if slot is not None:
                    self.arena.free(*slot)
        raise AssertionError("unreachable")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (idempotent); a load in flight fails."""
        self._closed = True
        self._finalizer.detach()
        _stop(self._state, timeout)
        self.arena.close()
        if self._own_share:
            self._share.close()
