"""The worker processes one engine owns: start (ranks 1..N-1, each on its device), check, stop.

The engine's process is rank 0; `Ranks(config, model_dir, ModelRunner)` spawns the workers, joins the process
group with them and hands rank 0's group to the engine's runner. `check()` raises RankFailure naming a worker that
is gone (rank 0 calls it around every step); `close()` stops them: a stop message, a join with a timeout, then
terminate / kill. A Ranks that is dropped without close() is stopped by its finalizer (and at interpreter exit).
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
from loom.distributed.parallel_state import ParallelGroup, RankFailure, destroy_group, init_group, make_store
from loom.distributed.step_broadcast import send_stop
from loom.distributed.worker import worker_main
from loom.errors import ConfigError

log = logging.getLogger("loom")


def rank_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Rank r's device: CPU for all, or on CUDA the r-th visible device from the engine's (CUDA_VISIBLE_DEVICES
    decides what is visible; the workers inherit it)."""
    if device.type != "cuda":
        return [device] * world_size
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    base = resolve_device(device).index if count else (device.index or 0)
    if base + world_size > count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError("tensor_parallel_size", f"{world_size} ranks need {world_size} GPUs from cuda:{base}; "
                          f"{count} visible (CUDA_VISIBLE_DEVICES={visible!r})")
    return [torch.device("cuda", base + r) for r in range(world_size)]


def _spawn_context():
    ctx = mp.get_context("spawn")
    # Inside an embedding process (Triton's Python backend stub) sys.executable may not be a Python interpreter.
    if not os.path.basename(sys.executable or "").startswith("python"):
        ctx.set_executable(os.path.join(sys.exec_prefix, "bin", "python3"))
    return ctx


def _stop(processes: list, conns: list, timeout: float) -> None:
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


class Ranks:
    def __init__(self, config, model_dir: str, runner_cls):
        n = config.tensor_parallel_size
        if dist.is_initialized():
            raise ConfigError("tensor_parallel_size", "this process already has a torch.distributed group (another "
                              "engine with tensor_parallel_size > 1?): one such engine per process")
        devices = rank_devices(config.torch_device, n)
        self.devices = devices
        self.processes: list = []
        self._conns: list = []
        self._errors: dict[int, str] = {}
        self.group: ParallelGroup | None = None
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns, 0.0)
        store = make_store(n)
        ctx = _spawn_context()
        try:
            for r in range(1, n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, name=f"loom-tp-rank{r}", daemon=True,
                                args=(r, n, store.port, replace(config, device=str(devices[r])), model_dir,
                                      runner_cls, child))
                p.start()
                child.close()  # only the worker holds its end: it reads end-of-file when this process goes
                self.processes.append(p)
                self._conns.append(parent)
            log.info("tensor parallel: %d ranks on %s; workers %s", n, ", ".join(map(str, devices)),
                     [p.pid for p in self.processes])
            self.group = init_group(0, n, store, devices[0])
        except BaseException:
            self.close(orderly=False)
            raise
        self.group.check_peers = self.check

    def _error_text(self, rank: int) -> str:
        conn = self._conns[rank - 1]
        try:
            while conn.poll():
                self._errors[rank] = conn.recv()
        except (EOFError, OSError):
            pass
        return self._errors.get(rank, "")

    def check(self, grace_s: float = 0.0) -> None:
        """Raise RankFailure naming the first worker that is gone; grace_s: wait that long for one that is dying
        (after a collective failed)."""
        deadline = time.monotonic() + grace_s
        for r, p in enumerate(self.processes, 1):
            if grace_s:
                p.join(max(0.0, deadline - time.monotonic()))
            if not p.is_alive():
                text = self._error_text(r).strip()
                last = text.splitlines()[-1] if text else ""
                raise RankFailure(r, f"(worker pid {p.pid}) exited with code {p.exitcode}"
                                  + (f": {last}" if last else ""))

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
        _stop(self.processes, self._conns, timeout)
