"""The worker processes one engine owns: start (ranks 1..L-1 of node 0, each on its device), check, stop.

The engine's process is rank 0; `Ranks(config, model_dir, ModelRunner)` opens the rendezvous (loom.distributed.
rendezvous: loopback on one node, MASTER_ADDR / MASTER_PORT across nodes, where the engine's configuration is
published for the other nodes' processes), spawns this node's workers, joins the process group with every rank and
hands rank 0's group to the engine's runner. `check()` raises RankFailure naming a rank that is gone: a local worker
(rank 0 calls it before every step), or, after a failed collective and in the idle health check, a rank another
node's process reported dead. `close()` stops them: a stop message, a join with a timeout, then terminate / kill. A
Ranks that is dropped without close() is stopped by its finalizer (and at interpreter exit).
"""
from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.device import resolve_device
from loom.distributed import placement, rendezvous
from loom.distributed.parallel_state import ParallelGroup, RankFailure, destroy_group, init_group
from loom.distributed.step_broadcast import send_stop
from loom.distributed.worker import worker_main
from loom.errors import ConfigError

log = logging.getLogger("loom")


def node_devices(device: torch.device, local_ranks: int, visible: str | None) -> list[torch.device]:
    """This node's rank devices (loom.distributed.placement) from what this process sees."""
    count = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.is_available() else 0
    if device.type == "cuda" and count:
        device = resolve_device(device)
    return placement.rank_devices(device, local_ranks, count, visible)


def rank_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """The devices of `world_size` ranks on this node, as this process sees them."""
    return node_devices(device, world_size, os.environ.get("CUDA_VISIBLE_DEVICES"))


def spawn_context():
    ctx = mp.get_context("spawn")
    # Inside an embedding process (Triton's Python backend stub) sys.executable may not be a Python interpreter.
    if not os.path.basename(sys.executable or "").startswith("python"):
        ctx.set_executable(os.path.join(sys.exec_prefix, "bin", "python3"))
    return ctx


def stop_workers(processes: list, conns: list, timeout: float) -> None:
    """Join the worker processes for up to `timeout`, then terminate / kill what is left; close their pipes."""
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()  # the worker's pipe reads end-of-file (if it still runs, it exits)
    destroy_group()


def start_worker(ctx, rank: int, rdv: rendezvous.Rendezvous, config, model_dir: str, runner_cls):
    """One worker process (rank `rank`, on config.device) and rank 0's / its node process's end of its pipe."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=worker_main, name=f"loom-tp-rank{rank}", daemon=True,
                    args=(rank, rdv, config, model_dir, runner_cls, child))
    p.start()
    child.close()  # only the worker holds its end: it reads end-of-file when this process goes
    return p, parent


def last_error(conn, seen: str = "") -> str:
    """The traceback a worker sent before it exited (or `seen`)."""
    try:
        while conn.poll():
            seen = conn.recv()
    except (EOFError, OSError):
        pass
    return seen


class Ranks:
    def __init__(self, config, model_dir: str, runner_cls):
        n = config.tensor_parallel_size
        if dist.is_initialized():
            raise ConfigError("tensor_parallel_size", "this process already has a torch.distributed group (another "
                              "engine with tensor_parallel_size > 1?): one such engine per process")
        rdv = rendezvous.resolve(config)
        devices = node_devices(config.torch_device, rdv.ranks_per_node, rdv.visible_devices)
        self.devices = devices
        self.nnodes = rdv.nnodes
        self.processes: list = []
        self._conns: list = []
        self._errors: dict[int, str] = {}
        self.group: ParallelGroup | None = None
        self._finalizer = weakref.finalize(self, stop_workers, self.processes, self._conns, 0.0)
        try:
            self._store = store = rdv.store(master=True)
        except RuntimeError as e:  # the port is taken, or the address is not this host's
            raise ConfigError("master_port", f"the rendezvous cannot listen on port {rdv.port}: {e}") from None
        rdv = replace(rdv, port=store.port)  # the free port it bound (one node)
        ctx = spawn_context()
        try:
            if rdv.nnodes > 1:
                rendezvous.publish_engine(store, config, model_dir)
            for r in range(1, rdv.ranks_per_node):
                p, conn = start_worker(ctx, r, rdv, replace(config, device=str(devices[r])), model_dir, runner_cls)
                self.processes.append(p)
                self._conns.append(conn)
            log.info("tensor parallel: %d ranks on %d node(s), this one's on %s; workers %s (rendezvous %s:%d)", n,
                     rdv.nnodes, ", ".join(map(str, devices)), [p.pid for p in self.processes], rdv.host, rdv.port)
            self.group = init_group(0, n, store, devices[0])
        except BaseException:
            self.close(orderly=False)
            raise
        self.group.check_peers = self.check

    def _error_text(self, rank: int) -> str:
        self._errors[rank] = last_error(self._conns[rank - 1], self._errors.get(rank, ""))
        return self._errors[rank]

    def check(self, grace_s: float = 0.0, remote: bool = False) -> None:
        """Raise RankFailure naming the first rank that is gone: a worker of this node, then (with grace_s or remote)
        one another node's process reported. grace_s: wait that long for one that is dying (after a collective
        failed)."""
        deadline = time.monotonic() + grace_s
        for r, p in enumerate(self.processes, 1):
            if grace_s:
                p.join(max(0.0, deadline - time.monotonic()))
            if not p.is_alive():
                text = self._error_text(r).strip()
                last = text.splitlines()[-1] if text else ""
                raise RankFailure(r, f"(worker pid {p.pid}) exited with code {p.exitcode}"
                                  + (f": {last}" if last else ""))
        if self.nnodes > 1 and (grace_s or remote):
            self._check_nodes(deadline)

    def _check_nodes(self, deadline: float) -> None:
        keys = [rendezvous.failure_key(k) for k in range(1, self.nnodes)]
        while True:
            for key in keys:
                if self._store.check([key]):
                    rank, _, text = self._store.get(key).decode().partition("\t")
                    raise RankFailure(int(rank), text)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def close(self, orderly: bool = True, timeout: float = 10.0) -> None:
        """Stop the workers: orderly (between steps, all alive) they leave their loop; else, or after `timeout`,
        they are terminated. Idempotent."""
        if not self._finalizer.alive:
            return
        if orderly and self.group is not None and self.alive():
            try:
                send_stop(self.group)
            except Exception:  # noqa: BLE001 - a worker died meanwhile: terminated below
                log.warning("tensor parallel: the stop message did not reach every rank", exc_info=True)
        else:
            timeout = 0.0
        self._finalizer.detach()
        stop_workers(self.processes, self._conns, timeout)
