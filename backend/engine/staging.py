"""Host <-> device transfers of one engine step, one copy per direction and dtype, through pinned buffers.

On CUDA a copy from pageable host memory synchronises the stream before it starts, which would stall the host
until the device has caught up and defeat the overlap of host work with device work. So every per-step upload
and download goes through page-locked buffers. Each direction keeps a ring of two buffers per dtype: the
engine has at most one step in flight, so by the time a buffer comes round again the step that used it has been
waited for (its copy is complete). That holds for at most one upload and one download per dtype per step,
which is how the engine uses it. On CPU there is nothing to copy: the arrays are used as they are.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class _Ring:
    """Two pinned host buffers of one dtype, grown (doubled) on demand."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.bufs: list[Tensor | None] = [None, None]
        self.turn = 0

    def next(self, n: int) -> Tensor:
        i = self.turn
        self.turn ^= 1
        buf = self.bufs[i]
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 256))
            buf = self.bufs[i] = torch.empty(size, dtype=self.dtype, pin_memory=True)
        return buf[:n]


class Staging:
    """upload(): numpy parts -> device tensors with one copy; download(): device tensor -> host, one copy."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._up: dict[torch.dtype, _Ring] = {}
        self._down: dict[torch.dtype, _Ring] = {}

    def upload(self, parts: list[np.ndarray], dtype: torch.dtype) -> list[Tensor]:
        """The parts (1-D numpy arrays) concatenated into one host buffer, copied once; device views of each."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if not self.pinned:
            flat = torch.from_numpy(np.concatenate(parts).astype(_NP[dtype], copy=False)) if total else \
                torch.empty(0, dtype=dtype)
            dev = flat
        else:
            ring = self._up.setdefault(dtype, _Ring(dtype))
            host = ring.next(total)
            view = host.numpy()
            o = 0
            for p, n in zip(parts, sizes):
                view[o:o + n] = p
                o += n
            dev = host.to(self.device, non_blocking=True)
        out, o = [], 0
        for n in sizes:
            out.append(dev[o:o + n])
            o += n
        return out

    def download(self, t: Tensor) -> Tensor:
        """Start copying a device tensor to the host; the result is valid once the step's event completed."""
        if not self.pinned:
            return t
        ring = self._down.setdefault(t.dtype, _Ring(t.dtype))
        host = ring.next(t.numel()).view(t.shape)
        host.copy_(t, non_blocking=True)
        return host


_NP = {torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32}
