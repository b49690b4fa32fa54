"""The device the test suite runs on, from LOOM_TEST_DEVICE: `cpu` (default; Triton kernels under the
interpreter) or `cuda` (compiled kernels on the GPU, an explicit device and dtype for the engine).
tests/conftest.py reads it before anything imports Triton."""
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
    """float32, float16 and bfloat16 on either device. Under the interpreter a bfloat16 run needs the GPU's bf16
    numerics patched in (the interpreter's own bf16 dot and casts are wrong in triton 3.6): run it within
    harness.interpreter_bf16.gpu_bf16(), a no-op on CUDA."""
    return [torch.float32, torch.float16, torch.bfloat16]


def engine_kwargs() -> dict:
    """Engine parity tests compare float32 greedy tokens: name the device and dtype (on CUDA `auto` is bf16)."""
    return dict(device=DEVICE, dtype="float32")
