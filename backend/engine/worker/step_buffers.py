"""Persistent inputs of a step: allocated once, written in place every step, never a fresh tensor per step.

Fields (input ids, positions, slots, block tables, ...) are carved out of one flat buffer per dtype, each at a
fixed offset aligned to 16 elements (Triton specialises kernels on pointer alignment: a field must start aligned
in every step). The model reads views of the device buffers; CUDA graphs capture those views once.

On CUDA the host side is pinned memory in two slots used in turn: a step writes its fields into a slot with
numpy, then `commit()` copies the written prefix of each dtype's buffer to the device in one asynchronous copy
and records an event; a slot is rewritten only after its copy has finished (normally long done: that event is
two steps old). On CPU the host buffers are the device buffers and nothing is copied.

The same slots carry the rest of a step's traffic, so one place owns every host <-> device copy of a step:
`upload()` for arrays whose size varies from step to step (the sampler's index arrays, loom.engine.
sampling_state), one copy per call, and `download()` for the step's results (sampled tokens, logprobs when
asked), one copy into pinned memory that the host reads once the step's device work is done. With async
scheduling at most one step is in flight, so a slot comes round again only after the step that used it was
waited for and its results read.
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
        self._views: dict[str, tuple[int, int | None, torch.Tensor]] = {}  # device_view's last view per field
        # per slot, grown on demand: pinned space for upload() and download(), and how much of it this step used
        self._up = [{}, {}]
        self._down = [{}, {}]
        self._up_used: dict[torch.dtype, int] = {}
        self._down_used: dict[torch.dtype, int] = {}

    @property
    def slot(self) -> int:
        """Which host slot this step writes (CUDA: two, used in turn; CPU: one)."""
        return self._slot

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
        self._up_used, self._down_used = {}, {}

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
        """The device tensor of the first n elements (n rows of cols) of a field: what kernels read. The last view
        of each field is kept: a decode batch asks for the same shapes step after step (a torch slice costs
        microseconds, seven of them a step)."""
        hit = self._views.get(name)
        if hit is not None and hit[0] == n and hit[1] == cols:
            return hit[2]
        f = self.fields[name]
        count = n * cols if cols is not None else n
        t = self.dev[f.dtype][f.offset:f.offset + count]
        if cols is not None:
            t = t.view(n, cols)
        self._views[name] = (n, cols, t)
        return t

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

    def _record(self) -> None:
        ev = torch.cuda.Event()
        ev.record()
        self._events[self._slot] = ev  # stream order: covers every earlier copy of this slot too

    def _scratch(self, kind: list, used: dict, dtype: torch.dtype, n: int) -> torch.Tensor:
        """n elements of this slot's pinned space of one kind, after what this step already took."""
        pool = kind[self._slot]
        start = used.get(dtype, 0)
        buf = pool.get(dtype)
        if buf is None or buf.numel() < start + n:
            # a replaced buffer may still be read by a queued copy: the caching host allocator keeps it until then
            size = max(start + n, 2 * (buf.numel() if buf is not None else 512))
            new = torch.empty(size, dtype=dtype, pin_memory=True)
            if buf is not None and start:
                new[:start] = buf[:start]
            buf = pool[dtype] = new
        used[dtype] = start + n
        return buf[start:start + n]

    def upload(self, parts: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """1-D arrays of this step concatenated into pinned memory and copied in one copy; device views of each.
        After begin() (the step's slot); on CPU the concatenated array itself."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if not self._cuda:
            flat = torch.from_numpy(np.concatenate(parts).astype(_NP[dtype], copy=False)) if total else \
                torch.empty(0, dtype=dtype)
        else:
            host = self._scratch(self._up, self._up_used, dtype, total)
            view, o = host.numpy(), 0
            for p, n in zip(parts, sizes):
                view[o:o + n] = p
                o += n
            flat = host.to(self.device, non_blocking=True)
            self._record()
        out, o = [], 0
        for n in sizes:
            out.append(flat[o:o + n])
            o += n
        return out

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying a device tensor to pinned host memory; read it once the step's device work is done
        (on CPU: the tensor itself)."""
        if not self._cuda:
            return t
        host = self._scratch(self._down, self._down_used, t.dtype, t.numel()).view(t.shape)
        host.copy_(t, non_blocking=True)
        self._record()
        return host


_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64}
