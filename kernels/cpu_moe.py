"""The experts of a sparse MoE block on CPU over packed copies of their weights (kernels/cpu_linear.py).

fused_moe_ref's loop - per expert that received tokens: gather its tokens, gate|up GEMM, SiLU-and-mul, down GEMM,
scale by the routing weight, add into float32 sums in expert order - in one C++ call (kernels/csrc/moe.cpp), each
expert's GEMMs on panels packed once instead of torch's matmul, which re-packs the weight at every call (a decode
step's few tokens per expert: 24 layers of 8 experts (hidden 576, 2 x 768), 32 tokens, top-2, the project's 2-core
EPYC: 144 -> 57 ms on one thread, 103 -> 43-51 on two, the loop still in Python; in C++, a Mixtral-shaped model's
decode step a further 10-20% shorter). The same sums in the same order, so within rounding of the reference. A
bfloat16 model on a CPU with avx512_bf16 takes PackedExpertsBf16 (loom's VDPBF16PS GEMM; a decode step's experts of
that shape, 32 tokens, top-2, on the loaded 2-core VM: 182 -> 80 ms against fused_moe_ref's oneDNN matmuls).
"""
from __future__ import annotations

import ctypes

import torch

from loom.kernels import cpu_ext
from loom.kernels.cpu_linear import BLOCK_ABOVE_BYTES, PackedWeight, block_rows
from loom.kernels.dispatch import fused_moe


class PackedExperts:
    """gate|up [E, 2I, H] and down [E, H, I] weights, each expert's packed into its own panels."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None = None):
        """out: float32 memory for all the panels (at least numel(*shapes) elements), else buffers of their own."""
        self.w13, self.w2 = w13, w2  # for fused_moe: under torch.compile
        sizes = [PackedWeight.panels_numel(*w.shape) for w in (*w13, *w2)]
        views, start = [], 0
        for n in sizes:
            views.append(None if out is None else out[start:start + n])
            start += n
        E = w13.shape[0]
        self.gate_up = [PackedWeight(w13[e], out=views[e]) for e in range(E)]
        self.down = [PackedWeight(w2[e], out=views[E + e]) for e in range(E)]
        self.lib = self.gate_up[0].lib
        pointers = ctypes.c_void_p * E
        self._p13 = pointers(*(p.panels.data_ptr() for p in self.gate_up))
        self._p2 = pointers(*(p.panels.data_ptr() for p in self.down))

    @staticmethod
    def numel(w13_shape: tuple, w2_shape: tuple) -> int:
        E, two_i, H = w13_shape
        return E * (PackedWeight.panels_numel(two_i, H) + PackedWeight.panels_numel(*w2_shape[1:]))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # packed only where kernels/policy.py chose them (engine/worker/cpu.py); traced (ctypes calls cannot be) or
        # given what the kernel does not take, fused_moe runs (the reference)
        if torch.compiler.is_compiling() or not cpu_ext.usable(x) or x.dim() != 2:
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        x, w, ids, (T, H, I, E, K), out = _operands(x, topk_weights, topk_ids, self.w13)
        if T:
            self.lib.loom_moe_experts(x.data_ptr(), T, H, I, E, self._p13, self._p2, w.data_ptr(), ids.data_ptr(), K,
                                      out.data_ptr(), BLOCK_ABOVE_BYTES, block_rows(H), block_rows(I),
                                      cpu_ext.nthreads())
        return out


class PackedExpertsBf16:
    """The experts of a bfloat16 model on a CPU with avx512_bf16: each expert's gate|up and down packed once into the
    VDPBF16PS panels of kernels/cpu_linear.PackedBf16, run by one C++ call (kernels/csrc/moe.cpp) that rounds where
    fused_moe_ref's bfloat16 matmuls round (each GEMM's output, the SiLU-and-mul) and sums in float32. oneDNN's
    bfloat16 matmul, which the reference calls per expert, re-lays the weight out at every call."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        from loom.kernels.cpu_linear import PackedBf16

        self.w13, self.w2 = w13, w2
        E = w13.shape[0]
        self.gate_up = [PackedBf16(w13[e]) for e in range(E)]
        self.down = [PackedBf16(w2[e]) for e in range(E)]
        self.lib = self.gate_up[0].lib
        pointers = ctypes.c_void_p * E
        self._p13 = pointers(*(p.panels.data_ptr() for p in self.gate_up))
        self._p2 = pointers(*(p.panels.data_ptr() for p in self.down))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2:
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        x, w, ids, (T, H, I, E, K), out = _operands(x, topk_weights, topk_ids, self.w13)
        if T:
            self.lib.loom_moe_experts_bf16(x.data_ptr(), T, H, I, E, self._p13, self._p2, w.data_ptr(),
                                           ids.data_ptr(), K, out.data_ptr(), cpu_ext.nthreads())
        return out.to(torch.bfloat16)


def _operands(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor):
    """What the C++ experts calls take: x, the routing weights (float32) and ids (int64) contiguous, (tokens, hidden,
    intermediate, experts, experts per token) and the float32 output."""
    x = x.contiguous()
    w = cpu_ext.contiguous(topk_weights, torch.float32)
    ids = cpu_ext.contiguous(topk_ids, torch.int64)
    (T, H), (E, two_i, _), K = x.shape, w13.shape, ids.shape[1]
    return x, w, ids, (T, H, two_i // 2, E, K), torch.empty((T, H), dtype=torch.float32)
