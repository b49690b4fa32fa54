"""The device the test suite runs on, from LOOM_TEST_DEVICE: `cpu` (default; Triton kernels under the
interpreter, float32/float16) or `cuda` (compiled kernels on the GPU, bfloat16 too, an explicit device and dtype
for the engine). tests/conftest.py reads it before anything imports Triton."""
from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu").strip().lower() or "cpu"
ON_CUDA = DEVICE == "cuda"


def check() -> None:
    """Refuse a mode the machine cannot run: a CUDA run that silently fell back to the CPU would prove nothing."""
    if DEVICE not in ("cpu", "cuda"):
        raise ValueError(f"LOOM_TEST_DEVICE must be cpu or cuda, got {DEVICE!r}")
    if ON_CUDA:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise ValueError("LOOM_TEST_DEVICE=cuda runs compiled kernels: unset TRITON_INTERPRET")
        if not torch.cuda.is_available():
            raise ValueError("LOOM_TEST_DEVICE=cuda but torch sees no CUDA device")


def kernel_dtypes() -> list[torch.dtype]:
    # bfloat16 only compiled: the interpreter's bf16 dot is wrong in triton 3.6
    return [torch.float32, torch.float16, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]


def engine_kwargs() -> dict:
    """Engine parity tests compare float32 greedy tokens: name the device and dtype (on CUDA `auto` is bf16)."""
    return dict(device=DEVICE, dtype="float32")
