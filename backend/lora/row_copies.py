"""Copies of adapter weights into device rows, off the step's path, and their order against the steps.

CUDA: each copy runs on a copy stream, queued after the work already on the compute stream (a step queued earlier may
still read rows just freed and now rewritten), and records an event; before a step reads a version's rows the compute
stream waits on that version's latest event (the host never waits: the step's kernels do). CPU: one helper thread runs
the copies in order (its ops serial: it must not open a second OpenMP team beside the engine's), paced to the share
of a core loads may take (loom.lora.load_pace: it shares the cores the steps compute on); a version whose copy is
still running is `busy` (the registry does not run its requests yet: the loop does not wait for a paced copy), and
`sync` waits for a version's copy (the registry's: one it started itself at activation). Rows move (compaction) only
after `drain`: every copy in flight done, those of versions evicted since included. While the loop waits in `sync` or
`drain` the copier runs unpaced (the cores would be idle).

The stream operations go through `CudaStreams`, so that the ordering is tested on any machine with a recording stand-in
(tests/lora/test_row_copies.py).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

import torch

from loom.kernels.cpu_ext import serial_thread
from loom.lora.load_pace import Pacer


class CudaStreams:
    """The CUDA stream operations RowCopies uses, on one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def on_copy(self):
        return torch.cuda.stream(self.copy)

    def event(self):
        return torch.cuda.Event()


class RowCopies:
    def __init__(self, device: torch.device, streams: CudaStreams | None = None,
                 share: Callable[[], float] | None = None):
        """share: the CPU share of a core loads may take (loom.lora.load_pace.LoadShare.get); None: unpaced."""
        self.device = torch.device(device)
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        self._streams = streams
        self._copier = None if streams is not None else ThreadPoolExecutor(
            1, thread_name_prefix="loom-lora-copy", initializer=serial_thread)
        self._pending: dict[Hashable, Future | object] = {}  # copies in flight, the latest per key (version)
        self._urgent = threading.Event()  # the loop waits for the copier: no pauses, and a pause under way ends
        # the CPU copier's pacer, for `copy` to call between its pieces (None: never paused)
        self.pace = Pacer(lambda: 1.0 if self._urgent.is_set() else share(), wake=self._urgent) \
            if share is not None and streams is None else None

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def write(self, key: Hashable, copy: Callable[[], None]) -> None:
        """Run `copy` (writes key's rows) off the step's path, after the steps already queued."""
        s = self._streams
        if s is None:  # one worker: copies run in order, so the latest marks the key's end
            self._pending[key] = self._copier.submit(copy)
            return
        s.copy.wait_stream(s.compute())  # freed rows: steps queued may still read them
        with s.on_copy():
            copy()
            done = s.event()
            done.record()
        self._pending[key] = done

    def in_flight(self, key: Hashable) -> bool:
        return key in self._pending

    def busy(self, key: Hashable) -> bool:
        """CPU: key's copy is still running (a step must not read its rows yet). CUDA: never (the step's work waits
        on the device)."""
        copy = self._pending.get(key)
        return isinstance(copy, Future) and not copy.done()

    def sync(self, key: Hashable) -> None:
        """key's rows written before the next step reads them (CUDA: that step's work waits on the device, the host
        does not; CPU: the copier is done with them)."""
        copy = self._pending.pop(key, None)
        if isinstance(copy, Future):
            self._wait(copy)
        elif copy is not None:
            self._streams.compute().wait_event(copy)

    def forget(self, key: Hashable) -> None:
        """key freed: nobody syncs on it (rows reused later are written after it, in order, moved after drain)."""
        self._pending.pop(key, None)

    def drain(self) -> None:
        """Every copy in flight complete before rows move."""
        if self._streams is not None:
            self._streams.compute().wait_stream(self._streams.copy)
        else:
            self._wait(self._copier.submit(int))
        self._pending.clear()

    def _wait(self, copy: Future) -> None:
        """The loop waits for a CPU copy: the copier unpaced meanwhile (it takes the cores the step would have)."""
        self._urgent.set()
        try:
            copy.result()
        finally:
            self._urgent.clear()
