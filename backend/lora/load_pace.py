"""How much CPU adapter loads may take while the engine computes on the same cores: one rule (`load_share`), the
value the engine publishes each step (`LoadShare`) and the pacer that holds a loading thread to it (`Pacer`).

On the CPU device a load's work (the loader process's read, check and layout; the copy of the laid-out weights into
the pools' rows) runs on the cores the steps compute on, and a step waits for its slowest compute thread: a load that
took a core while requests decoded made their steps up to 1.8x as long (bench_lora --load-during, issue 44). The
rule: while requests run, loads take at most `lora_load_cpu_share` of one core, or waiting / (waiting + running) of
one when `waiting` requests hold adapters not on the device yet beside `running` requests in the step (more work
queued behind adapters than running: the loads are what the engine waits for); a whole core when nothing runs or
when a request whose adapter is not on the device yet has waited max_lora_wait_steps (the scheduler's admission
bound, loom.engine.core.scheduler: its load is then what keeps it from the bound). On CUDA loads are not paced (the
steps compute on the GPU).

The share is one float64 in an 8-byte anonymous memory file, written by the engine's loop once per step and read by
the pacers of the loader process (which maps the same file: its descriptor is passed at the start) and of the
registry's copier thread. A pacer is called between pieces of a load's work of about a millisecond each; once the
thread's CPU time since its last pause reaches a quantum it sleeps so that its CPU time is at most the share of the
time passed (time.thread_time: what it took from the cores, not the time it waited for them).
"""
from __future__ import annotations

import mmap
import os
import time
from typing import Callable

# Bytes a piece of a load's copying handles between two pacer calls (~1 ms of copying into fresh pages here).
PIECE_BYTES = 1 << 20


def load_share(min_share: float, waiting: int, running: int, overdue: bool = False) -> float:
    """The share of one core loads may take (module docstring). overdue: a request waiting for its adapter has
    waited max_lora_wait_steps."""
    if running <= 0 or overdue:
        return 1.0
    return min(1.0, max(min_share, waiting / (waiting + running)))


class LoadShare:
    """The share, in an 8-byte memory file: made by the engine (fd None), mapped by the loader process (its fd)."""

    def __init__(self, fd: int | None = None):
        self._own = fd is None
        if fd is None:
            fd = os.memfd_create("loom-lora-share", os.MFD_CLOEXEC)
            os.ftruncate(fd, 8)
        self.fd = fd
        self._map = mmap.mmap(fd, 8)
        self._value = memoryview(self._map).cast("d")
        if self._own:
            self._value[0] = 1.0

    def get(self) -> float:
        return self._value[0]

    def set(self, share: float) -> None:
        self._value[0] = share

    def close(self) -> None:
        if self.fd < 0:
            return
        self._value.release()
        self._map.close()
        if self._own:
            os.close(self.fd)
        self.fd = -1


class Pacer:
    """Call between pieces of a load's work, on the one thread doing it: sleeps to hold that thread's CPU time to
    share() of the time passed, in pauses of at least `quantum` seconds of CPU. Its first call (on that thread)
    starts the count: call it before a load's first piece."""

    def __init__(self, share: Callable[[], float], quantum: float = 1e-3, wake=None):
        """wake: a threading.Event that ends a pause early when set (someone waits for this thread's work)."""
        self._share, self.quantum, self._wake = share, quantum, wake
        self._t0: float | None = None

    def __call__(self) -> None:
        if self._t0 is None:
            self._t0 = time.thread_time()
            return
        used = time.thread_time() - self._t0
        if used < self.quantum:
            return
        share = self._share()
        if share < 1.0:
            pause = used * (1.0 / max(share, 1e-3) - 1.0)
            if self._wake is None:
                time.sleep(pause)
            else:
                self._wake.wait(pause)
        self._t0 = time.thread_time()
