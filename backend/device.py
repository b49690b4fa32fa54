"""The engine's device for every thread that launches work on it.

Triton launches its kernels on the calling thread's *current* CUDA device, and a new thread's current device is
0: an engine on cuda:1 would otherwise run its kernels (or create a context) on GPU 0 from its loop thread or its
adapter loader. Every thread that touches the device calls bind_thread(device) first. No-ops on CPU.
"""
from __future__ import annotations

import torch


def resolve_device(device: torch.device | str) -> torch.device:
    """cuda without an index -> cuda:<current device>, so other threads can bind to the same one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def bind_thread(device: torch.device | str | None) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for CPU or None)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(resolve_device(device))
