"""CPU tuning the engine applies at its start (not at import: importing loom has no side effects)."""
from __future__ import annotations

import os


def tune_mkl_for_amd() -> None:
    """MKL's AVX-512 GEMM path is pathologically slow for small-M matmuls on AMD EPYC (measured here: 16 ms vs
    0.18 ms for an fp32 [8,1536]x[1536,576] matmul); its AVX2 kernels are the fast ones there. MKL reads the
    variable when it first dispatches, so the engine's start is early enough; entry points that run other
    torch work first (benchmarks with HF peers, tests) call this before importing torch. A user's own setting
    always wins."""
    if "MKL_ENABLE_INSTRUCTIONS" in os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            amd = "AuthenticAMD" in f.read(4096)
    except OSError:
        return
    if amd:
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
