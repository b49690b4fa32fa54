"""Persistent inputs of a step: allocated once, written in place every step, never a fresh tensor per step.

Fields (input ids, positions, slots, block tables, ...) are carved out of one flat buffer per dtype, each at a
fixed offset aligned to 16 elements (Triton specialises kernels on pointer alignment: a field must start aligned
in every step). The model reads views of the device buffers; CUDA graphs capture those views once.

On CUDA the host side is pinned memory in two slots used in turn: a step writes its fields into a slot with
numpy, then `commit()` copies the written prefix of each dtype's buffer to the device in one asynchronous copy
and records an event; a slot is rewritten only after its copy has finished (normally long done: that event is
two steps old). On CPU the host buffers are the device buffers and nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 16  # elements


@dataclass(frozen=True)
class _Field:
    dtype: torch.dtype
    offset: int
    size: int


class StepBuffers:
    def __init__(self, fields: dict[str, tuple[torch.dtype, int]], device: torch.device):
        """fields: name -> (dtype, capacity in elements), laid out in the order given (put the large, partly
        used ones last: a commit copies each dtype's buffer up to the end of the last field written)."""
        self.device = torch.device(device)
        self.fields: dict[str, _Field] = {}
        ends: dict[torch.dtype, int] = {}
        for name, (dtype, size) in fields.items():
            off = -(-ends.get(dtype, 0) // _ALIGN) * _ALIGN
            self.fields[name] = _Field(dtype, off, int(size))
            ends[dtype] = off + int(size)
        self._cuda = self.device.type == "cuda"
        self.dev = {dt: torch.zeros(max(n, 1), dtype=dt, device=self.device) for dt, n in ends.items()}
        if self._cuda:
            self._slots = [{dt: torch.zeros(max(n, 1), dtype=dt, pin_memory=True) for dt, n in ends.items()}
                           for _ in range(2)]
            self._events: list[torch.cuda.Event | None] = [None, None]
        else:
            self._slots = [self.dev]
        self._np = [{dt: t.numpy() for dt, t in slot.items()} for slot in self._slots]
        self._slot = 0
        self._used: dict[torch.dtype, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dev.values())

    def begin(self) -> None:
        """Start writing a step (into the next host slot, once the copy that last read it has finished)."""
        if self._cuda:
            self._slot ^= 1
            ev = self._events[self._slot]
            if ev is not None:
                ev.synchronize()
        self._used = {}

    def host(self, name: str, n: int, cols: int | None = None) -> np.ndarray:
        """numpy view of the first n elements of a field in the current slot (n rows of `cols` with cols)."""
        f = self.fields[name]
        count = n * cols if cols is not None else n
        if count > f.size:
            raise ValueError(f"step buffer {name!r} holds {f.size} elements, {count} asked")
        self._used[f.dtype] = max(self._used.get(f.dtype, 0), f.offset + count)
        a = self._np[self._slot][f.dtype][f.offset:f.offset + count]
        return a.reshape(n, cols) if cols is not None else a

    def device_view(self, name: str, n: int, cols: int | None = None) -> torch.Tensor:
        """The device tensor of the first n elements (n rows of cols) of a field: what kernels read."""
        f = self.fields[name]
        count = n * cols if cols is not None else n
        t = self.dev[f.dtype][f.offset:f.offset + count]
        return t.view(n, cols) if cols is not None else t

    def commit(self) -> None:
        """Copy what this step wrote to the device (asynchronously, on the current stream)."""
        if not self._cuda:
            return
        src = self._slots[self._slot]
        for dt, end in self._used.items():
            self.dev[dt][:end].copy_(src[dt][:end], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[self._slot] = ev
