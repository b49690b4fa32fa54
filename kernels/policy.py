"""Where loom's ops run: the Triton kernels, loom's C++ CPU kernels (kernels/cpu_*.py) or the PyTorch references.

`_TABLE` below is the one decision, from the device, the environment, whether the C++ library built and the dtype:
  - CUDA: Triton (GEMMs are cuBLAS through F.linear; argmax is torch's).
  - LOOM_FORCE_TRITON=1: Triton on CPU too (run by TRITON_INTERPRET=1: the engine parity tests); argmax is torch's.
  - CPU: the C++ kernels where they built, unless LOOM_CPU_KERNELS=0; the references otherwise. By dtype:
    float32: every C++ kernel; its linear layers' weights packed for the C++ GEMM (Triton forced or not) and, its
      forward not compiled, each decoder layer run as one C++ call (engine/worker/cpu.py sets both up).
    bfloat16: the C++ norms, rotary, activations, KV store and paged attention (bfloat16 storage, float32 math; the
      cache read in place); its linear layers, the forward not compiled, over weights re-laid out once at start:
      loom's bfloat16 GEMM (VDPBF16PS panels, kernels/csrc/gemm_bf16.cpp) where the CPU has avx512_bf16 and no AMX
      (measured against oneDNN on Zen 5: 0.44-0.67 of its time at 1 row, 0.76-0.98 at 32, even at 256-2,048),
      else oneDNN's prepacked bfloat16 GEMM (AMX where the CPU has it), where torch's oneDNN takes bfloat16 on this
      CPU; LOOM_BF16_GEMM=onednn picks oneDNN's (to compare). Over loom's GEMM each decoder layer runs in one C++
      call too, LoRA included (the C++ pass on rows widened to float32, kernels/cpu_lora.py), and MoE experts run
      loom's bfloat16 GEMM (kernels/cpu_moe.py); over oneDNN's they stay on the PyTorch path.
    float16: the references. Every dtype's float32 logits take the C++ argmax.
    Quantized checkpoints' linear layers and MoE experts keep their weights quantized (layers/quant_linear.py,
    layers/quant_experts.py): the C++ weight-only
    GEMM (int8 / int4 / FP8 dequantised in registers, float32 math) for float32 and bfloat16 models with the library
    built and an eager forward (a bfloat16 model's int8 / int4 linear layers on a CPU with avx512_bf16: the VDPBF16PS
    one, kernels/cpu_quant_bf16.py), inside the one-call C++ layer where layer_pass is set (its other linears, lm_head
    included, packed as the dense model's); Triton's weight-only kernel where Triton runs; dequantize + F.linear
    otherwise.
An engine decides once at its start (`decide`; model_runner logs `describe`); kernels/dispatch.py asks `for_tensor`
at each call: the same decision for the device and dtype of the call's tensors (an engine's tensors get the engine's
ops and argmax paths; a kernel test's, the default for them). Whether a C++ kernel takes a call's tensors (dtype,
layout) is its module's `takes_*`, which dispatch asks before it runs one. The environment is read per decision, so
tests may set it after import.
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass

import torch

from loom.kernels import cpu_ext

TRITON, CPU, REFERENCE = "triton", "cpu", "reference"


GEMM_LOOM, GEMM_ONEDNN = "loom", "onednn"  # the C++ GEMM over packed float32 panels; oneDNN's prepacked bfloat16
GEMM_LOOM_BF16 = "loom_bf16"  # the C++ bfloat16 GEMM over VDPBF16PS panels (avx512_bf16)


@dataclass(frozen=True)
class KernelPath:
    ops: str  # attention, the KV store, norms, rotary, activations, LoRA, fused_moe: TRITON, CPU or REFERENCE
    argmax: str  # CPU or REFERENCE (torch.argmax: there is no Triton argmax)
    gemm: str  # linear layers over weights packed at start: GEMM_LOOM, GEMM_LOOM_BF16, GEMM_ONEDNN, or "" (F.linear)
    layer_pass: bool  # each decoder layer the C++ layer takes runs in one call (models/layer_pass.py)
    # linear layers whose weights a quantized checkpoint stores (layers/quant_linear.py): TRITON (quant_gemm's
    # weight-only kernel), CPU (the C++ weight-only GEMM over weights re-laid out at start, kernels/cpu_quant.py) or
    # REFERENCE (dequantize + F.linear at each call)
    quant: str = REFERENCE

    @property
    def packed(self) -> bool:
        """Linear layers run over weights packed at start (engine/worker/cpu.py apply_path)."""
        return bool(self.gemm)

    @property
    def packed_experts(self) -> bool:
        """MoE experts over packed weights (kernels/cpu_moe.py: float32, or bfloat16 on loom's bfloat16 GEMM); Triton
        forced, fused_moe's kernel runs them."""
        return self.gemm in (GEMM_LOOM, GEMM_LOOM_BF16) and self.ops == CPU

    def describe(self, dtype: torch.dtype) -> str:
        """One line for the engine's start: which path runs and why."""
        if self.ops == TRITON:
            gemm = "; linear layers: the C++ GEMM over packed weights" if self.packed else ""
            return f"kernels: Triton{gemm}"
        if self.ops == CPU:
            line = cpu_ext.describe() + ("; each decoder layer in one C++ call" if self.layer_pass else "")
            if dtype != torch.float32:
                name = str(dtype).removeprefix("torch.")
                gemm = {GEMM_ONEDNN: "oneDNN's prepacked bfloat16 GEMM",
                        GEMM_LOOM_BF16: "loom's bfloat16 GEMM (VDPBF16PS)"}.get(self.gemm, "F.linear")
                units = ", ".join(f for f in ("amx_bf16", "avx512_bf16") if f in cpu_ext.cpu_flags()) or \
                    "no 16-bit units: emulated"
                experts = "loom's bfloat16 GEMM" if self.packed_experts else "PyTorch"
                line += (f"; {name}: C++ norms, rotary, activations, KV store, paged attention (float32 math); "
                         f"linear layers: {gemm} ({units}); "
                         f"LoRA: the C++ pass (float32 math on 16-bit rows widened as read); MoE experts: {experts}")
            return line
        if not cpu_ext.enabled():
            return cpu_ext.describe()
        if self.argmax == CPU:  # built, but not for this dtype
            return (f"CPU kernels: float32 and bfloat16 only; this {dtype} model runs the PyTorch references "
                    "(argmax: C++)")
        return "kernels: the PyTorch references (no C++ library: see the warning above)"


F32, BF16, OTHER = "float32", "bfloat16", "other"  # the dtype dimension: what the C++ kernels take


def _gemm(triton: bool, built: bool, kind: str, compiled: bool, bf16_gemm: str) -> str:
    if built and kind == F32:
        return GEMM_LOOM
    if built and kind == BF16 and not (triton or compiled):
        return bf16_gemm
    return ""


# (Triton, C++ library built, dtype kind, compiled, the bfloat16 GEMM this CPU runs best: GEMM_LOOM_BF16, GEMM_ONEDNN
# or "") -> the path
_TABLE = {
    (triton, built, kind, compiled, bf16_gemm): KernelPath(
        ops=TRITON if triton else CPU if built and kind in (F32, BF16) else REFERENCE,
        argmax=CPU if built and not triton else REFERENCE,
        gemm=_gemm(triton, built, kind, compiled, bf16_gemm),
        layer_pass=built and not (triton or compiled) and (kind == F32 or
                                                           kind == BF16 and bf16_gemm == GEMM_LOOM_BF16),
        quant=TRITON if triton else CPU if built and kind in (F32, BF16) and not compiled else REFERENCE)
    for triton, built, compiled in itertools.product((False, True), repeat=3) for kind in (F32, BF16, OTHER)
    for bf16_gemm in ("", GEMM_ONEDNN, GEMM_LOOM_BF16)
}


def _kind(dtype: torch.dtype) -> str:
    return F32 if dtype == torch.float32 else BF16 if dtype == torch.bfloat16 else OTHER


def decide(device: torch.device | str, dtype: torch.dtype, compiled: bool = False) -> KernelPath:
    """An engine's path, decided once at its start (compiled: its CPU forward runs under torch.compile)."""
    return _ON_CUDA if torch.device(device).type == "cuda" else _on_cpu(_kind(dtype), compiled)


def for_tensor(t: torch.Tensor) -> KernelPath:
    """The ops and argmax paths of an op on t, asked at each call: cheap (~2 us on CPU, reading the environment),
    and traceable by torch.compile (while tracing nothing runs the C++ kernels, whose ctypes calls cannot be traced:
    the references do, which inductor fuses)."""
    return _ON_CUDA if t.is_cuda else _on_cpu(_KINDS.get(t.dtype, OTHER), False, gemm=False)


_KINDS = {torch.float32: F32, torch.bfloat16: BF16}


@functools.lru_cache(maxsize=None)
def _bf16_gemms() -> tuple[bool, bool]:
    """(loom's bfloat16 GEMM runs here and is the faster: avx512_bf16 without AMX, whose tiles oneDNN drives; oneDNN
    takes bfloat16 on this CPU)."""
    from loom.kernels.cpu_linear import loom_bf16_gemm, onednn_bf16

    return loom_bf16_gemm() and "amx_bf16" not in cpu_ext.cpu_flags(), onednn_bf16()


def _bf16_gemm() -> str:
    ours, onednn = _bf16_gemms()
    if onednn and (not ours or os.environ.get("LOOM_BF16_GEMM", "").strip().lower() == GEMM_ONEDNN):
        return GEMM_ONEDNN
    return GEMM_LOOM_BF16 if ours else ""


def _on_cpu(kind: str, compiled: bool, gemm: bool = True) -> KernelPath:
    """gemm: False where only ops and argmax are asked (for_tensor: a bfloat16 op's call need not read the GEMM
    choice's environment)."""
    # load(): None with LOOM_CPU_KERNELS=0 or a failed build
    built = not torch.compiler.is_compiling() and cpu_ext.load() is not None
    return _TABLE[os.environ.get("LOOM_FORCE_TRITON") == "1", built, kind, compiled,
                  _bf16_gemm() if gemm and built and kind == BF16 else ""]


_ON_CUDA = _TABLE[True, False, OTHER, False, ""]
