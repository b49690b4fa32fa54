"""Copies of adapter weights into device rows, off the step's path, and their order against the steps.

CUDA: each copy runs on a copy stream, queued after the work already on the compute stream (a step queued earlier may
still read rows just freed and now rewritten), and records an event; before a step reads a version's rows the compute
stream waits on that version's latest event (the host never waits: the step's kernels do). CPU: one helper thread runs
the copies in order (its ops serial: it must not open a second OpenMP team beside the engine's); before a step reads a
version's rows the loop waits for that version's copy. Rows move (compaction) only after `drain`: every copy in flight
done, those of versions evicted since included.

The stream operations go through `CudaStreams`, so that the ordering is tested on any machine with a recording stand-in
(tests/lora/test_row_copies.py).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

import torch

from loom.kernels.cpu_ext import serial_thread


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
    def __init__(self, device: torch.device, streams: CudaStreams | None = None):
        self.device = torch.device(device)
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        self._streams = streams
        self._copier = None if streams is not None else ThreadPoolExecutor(
            1, thread_name_prefix="loom-lora-copy", initializer=serial_thread)
        self._pending: dict[Hashable, Future | object] = {}  # copies in flight, the latest per key (version)

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

    def sync(self, key: Hashable) -> None:
        """key's rows written before the next step reads them (CUDA: that step's work waits on the device, the host
        does not; CPU: the copier is done with them)."""
        copy = self._pending.pop(key, None)
        if isinstance(copy, Future):
            copy.result()
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
            self._copier.submit(int).result()
        self._pending.clear()
