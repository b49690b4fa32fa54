"""loom: an LLM serving engine for NVIDIA Triton Inference Server (paged KV cache, continuous batching, multi-LoRA)."""
import os as _os


def _tune_mkl_for_amd() -> None:
    """MKL's AVX-512 GEMM path is pathologically slow for small-M matmuls on AMD EPYC (measured here:
    16 ms vs 0.18 ms for an fp32 [8,1536]x[1536,576] matmul); its AVX2 kernels are the fast ones there.
    Takes effect only when set before torch loads MKL, and never overrides a user's own setting."""
    if "MKL_ENABLE_INSTRUCTIONS" in _os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            amd = "AuthenticAMD" in f.read(4096)
    except OSError:
        return
    if amd:
        _os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"


_tune_mkl_for_amd()
