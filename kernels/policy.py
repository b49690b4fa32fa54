"""Where loom's ops run: the Triton kernels, loom's C++ CPU kernels (kernels/cpu_*.py) or the PyTorch references.

`_TABLE` below is the one decision, from the device, the environment, whether the C++ library built and the dtype:
  - CUDA: Triton (GEMMs are cuBLAS through F.linear; argmax is torch's).
  - LOOM_FORCE_TRITON=1: Triton on CPU too (run by TRITON_INTERPRET=1: the engine parity tests); argmax is torch's.
  - CPU: the C++ kernels where they built (float32 only: a bfloat16 model runs the references, though its float32
    logits still take the C++ argmax), unless LOOM_CPU_KERNELS=0; the references otherwise. A float32 model with the
    library also has its linear layers' weights packed for the C++ GEMM (Triton forced or not) and, its forward not
    compiled, each decoder layer run as one C++ call (engine/cpu.py sets both up).
An engine decides once at its start (`decide`; model_runner logs `describe`); kernels/dispatch.py asks `for_tensor`
at each call: the same decision for the device and dtype of the call's tensors (an engine's tensors get the engine's
ops and argmax paths; a kernel test's, the default for them). Whether a C++ kernel takes a call's tensors (dtype,
layout) is its module's `takes_*`, which dispatch asks before it runs one. The environment is read per decision, so
tests may set it after import.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from loom.kernels import cpu_ext

TRITON, CPU, REFERENCE = "triton", "cpu", "reference"


@dataclass(frozen=True)
class KernelPath:
    ops: str  # attention, the KV store, norms, rotary, activations, LoRA, fused_moe: TRITON, CPU or REFERENCE
    argmax: str  # CPU or REFERENCE (torch.argmax: there is no Triton argmax)
    packed: bool  # linear layers run the C++ GEMM over weights packed at start
    layer_pass: bool  # each decoder layer the C++ layer takes runs in one call (models/layer_pass.py)

    @property
    def packed_experts(self) -> bool:
        """MoE experts over packed weights (kernels/cpu_moe.py); Triton forced, fused_moe's kernel runs them."""
        return self.packed and self.ops == CPU

    def describe(self, dtype: torch.dtype) -> str:
        """One line for the engine's start: which path runs and why."""
        if self.ops == TRITON:
            gemm = "; linear layers: the C++ GEMM over packed weights" if self.packed else ""
            return f"kernels: Triton{gemm}"
        if self.ops == CPU:
            return cpu_ext.describe() + ("; each decoder layer in one C++ call" if self.layer_pass else "")
        if not cpu_ext.enabled():
            return cpu_ext.describe()
        if self.argmax == CPU:  # built, but not for this dtype
            return f"CPU kernels: float32 only; this {dtype} model runs the PyTorch references (argmax: C++)"
        return "kernels: the PyTorch references (no C++ library: see the warning above)"


# (Triton, C++ library built, float32, compiled) -> the path
_TABLE = {
    (triton, built, f32, compiled): KernelPath(
        ops=TRITON if triton else CPU if built and f32 else REFERENCE,
        argmax=CPU if built and not triton else REFERENCE,
        packed=built and f32,
        layer_pass=built and f32 and not (triton or compiled))
    for triton, built, f32, compiled in itertools.product((False, True), repeat=4)
}


def decide(device: torch.device | str, dtype: torch.dtype, compiled: bool = False) -> KernelPath:
    """An engine's path, decided once at its start (compiled: its CPU forward runs under torch.compile)."""
    return _ON_CUDA if torch.device(device).type == "cuda" else _on_cpu(dtype == torch.float32, compiled)


def for_tensor(t: torch.Tensor) -> KernelPath:
    """The ops and argmax paths of an op on t, asked at each call: cheap (~2 us on CPU, reading the environment),
    and traceable by torch.compile (while tracing nothing runs the C++ kernels, whose ctypes calls cannot be traced:
    the references do, which inductor fuses)."""
    return _ON_CUDA if t.is_cuda else _on_cpu(t.dtype == torch.float32, False)


def _on_cpu(f32: bool, compiled: bool) -> KernelPath:
    # load(): None with LOOM_CPU_KERNELS=0 or a failed build
    built = not torch.compiler.is_compiling() and cpu_ext.load() is not None
    return _TABLE[os.environ.get("LOOM_FORCE_TRITON") == "1", built, f32, compiled]


_ON_CUDA = _TABLE[True, False, False, False]
