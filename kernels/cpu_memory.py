"""Large CPU buffers the kernel may back with 2 MiB pages (transparent huge pages).

A decode step streams the packed weights (kernels/cpu_linear.py) and reads the KV cache through the block table:
on 4 KiB pages that is a TLB miss every 4 KiB. Buffers made here start on a 2 MiB boundary and are marked
madvise(MADV_HUGEPAGE) before anything touches them, so on Linux with transparent huge pages in "madvise" or
"always" mode their first touch maps 2 MiB pages (measured on this project's 2-core AMD EPYC, one thread: the GEMMs
of a SmolLM2 decode step -5 to -7%, its decode attention at 64 x ~200 tokens -7%). Elsewhere (no THP, not Linux,
madvise refused) they are ordinary memory: the hint never changes what the buffer holds.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge_pages(addr: int, nbytes: int) -> bool:
    """Ask for huge pages over the whole 2 MiB pages inside [addr, addr + nbytes); whether the kernel took it."""
    lo = -(-addr // HUGE_PAGE) * HUGE_PAGE
    hi = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    fn = _madvise()
    return fn is not None and hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, starting on a 2 MiB boundary and advised for huge pages when it spans
    at least one. Untouched: write it (zero_, copy_) after this call, not before, for the pages to be huge."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # large: mapped by the allocator, not yet touched
    start = -raw.data_ptr() % HUGE_PAGE
    advise_huge_pages(raw.data_ptr() + start, nbytes)
    return raw[start:start + nbytes].view(dtype).view(shape)


def large_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, touch: bool = True) -> torch.Tensor:
    """torch.zeros(shape) on `device`; on the CPU on huge pages (long-lived buffers a step reads all over).
    touch=False (CPU): the pages are mapped at their first write, not here - for pools mostly unused (LoRA rows:
    256 MiB by default, zeroed at start cost 0.2-1.3 s here and their resident memory whatever was loaded)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if touch:
        return empty_on_huge_pages(shape, dtype).zero_()
    return zero_pages(shape, dtype)


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from an anonymous mapping of its own (zero by definition, whatever malloc holds), on a 2 MiB
    boundary and advised for huge pages; nothing is touched. The tensor keeps the mapping; it goes with it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    advise_huge_pages(raw.data_ptr() + start, nbytes)
    return raw[start:start + nbytes].view(dtype).view(shape)
