"""Weight-only quantized GEMM on CPU for bfloat16 activations: y = x @ dequant(W)^T + b, x and y bfloat16, W int8 or
int4 (kernels/csrc/quant_gemm_bf16.cpp: VDPBF16PS over the exact bfloat16 values of q, each group's scale and zero
point applied once per group after its dot product; float32 accumulation, y rounded once).

`PackedQuantBf16` re-lays a QuantizedWeight out once, at load, into that kernel's panels: 48 output columns a panel,
the (k, k + 1) pairs of a column adjacent (int4: the nibbles of k and k + 2 in one byte), scales and zero points as
kernels/cpu_quant.PackedQuantWeight's (float32 [panel, group, 48]), act-order K permuted so that a group's columns are
adjacent. A bfloat16 engine packs its quantized weights this way where the CPU has avx512_bf16
(engine/worker/cpu.pack_quantized_weights); elsewhere they run the float32 kernel (cpu_quant.py), x widened and y
rounded. `emulate=True` runs the same algorithm in plain C++ on any CPU (tests).

Not the float32 kernel's bits: y = sum_g scale_g (sum_{k in g} x_k q_k - zero_g sum_{k in g} x_k), each sum in
float32, within gamma_(K + G + 4) of the exact result relative to sum_k |x_k| |scale| (|q_k| + |zero|), then the
bfloat16 rounding; a row's bits do not depend on the rows beside it.
Memory: as PackedQuantWeight's (N * K or N * K / 2 bytes, plus the scales).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from loom.kernels import cpu_ext
from loom.kernels.cpu_linear import loom_bf16_gemm
from loom.kernels.cpu_quant import PackedQuantBase, act_order_groups
from loom.models.quant.weight import QuantizedWeight, unpack_int32

NR = 48  # output columns a panel (quant_gemm_bf16.cpp QB_NR)


def _unit(bits: int) -> int:
    """Input columns a packed unit holds: a pair (int8), a quad (int4)."""
    return 4 if bits == 4 else 2


def takes(qw: QuantizedWeight) -> bool:
    """Whether this kernel runs the weight: int8 or int4, every group but the last (in the packed K order) a whole
    number of units (a k pair, a k quad: a unit's columns share their scale)."""
    if not (qw.kind == "int" and qw.bits in (4, 8)):
        return False
    counts = act_order_groups(qw)[2]
    return not bool((counts[:-1] % _unit(qw.bits)).any())


def runs_here() -> bool:
    """Whether the VDPBF16PS kernel runs on this CPU (avx512_bf16 and a library built with it)."""
    lib = cpu_ext.load()
    return lib is not None and loom_bf16_gemm(lib) and bool(lib.loom_quant_gemm_bf16_built())


class PackedQuantBf16(PackedQuantBase):
    """A QuantizedWeight re-laid-out for the bfloat16 kernel (see the module's doc)."""

    def __init__(self, qw: QuantizedWeight, emulate: bool = False):
        lib = cpu_ext.built()
        if lib is None or not takes(qw) or not (emulate or runs_here()):
            raise ValueError("the bfloat16 quantized GEMM needs the built CPU kernels, an int8 or int4 weight whose "
                             "groups are whole k pairs / quads, and avx512_bf16 (else emulate=True)")
        qw.validate()
        self.lib, self.emulate, self.shape, self.kind_name, self.bits = lib, emulate, qw.shape, qw.kind, qw.bits
        N, K = qw.shape
        unit = _unit(qw.bits)
        self.kp = -(-K // unit) * unit
        np_ = -(-N // NR) * NR
        self.perm, used, counts = act_order_groups(qw)
        bounds = F.pad(torch.cumsum(counts, 0), (1, 0))
        bounds[-1] = self.kp
        self.bounds = bounds.to(torch.int32).contiguous()
        self.groups = int(used.numel())
        q = unpack_int32(qw.weight.to("cpu"), qw.bits, K).to(torch.uint8)
        if self.perm is not None:
            q = q[:, self.perm]
        q = F.pad(q, (0, self.kp - K, 0, np_ - N))  # [Np, Kp]
        q = q.view(np_ // NR, 3, 16, self.kp // unit, unit)  # panel, block, column, unit, k in the unit
        if qw.bits == 4:  # byte h of a column: k = h (low nibble) and k = 2 + h (high)
            q = q[..., 0:2] | (q[..., 2:4] << 4)
        self.q = q.permute(0, 3, 1, 2, 4).contiguous()  # [P, units, 3, 16, 2]
        self._pack_scales(qw, used, np_, NR)
        self.zc = float(1 << (qw.bits - 1))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] (bfloat16; float32 is rounded to it) -> [..., N] in x's dtype."""
        N, K = self.shape
        shape = x.shape
        x2 = self._input_rows(x)
        if self.kp != K:
            x2 = F.pad(x2, (0, self.kp - K))
        if x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
            x2 = x2.to(torch.bfloat16).contiguous()
        out_f32 = x.dtype == torch.float32
        m = x2.shape[0]
        y = torch.empty((m, N), dtype=torch.float32 if out_f32 else torch.bfloat16)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        if m:
            self.lib.loom_quant_gemm_bf16(
                x2.data_ptr(), x2.stride(0), m, self.kp, self.q.data_ptr(), int(self.bits == 4),
                self.scale.data_ptr(), None if self.zero is None else self.zero.data_ptr(), self.zc,
                self.bounds.data_ptr(), self.groups, N, None if bias is None else bias.data_ptr(), y.data_ptr(),
                y.stride(0), int(out_f32), cpu_ext.nthreads(), int(self.emulate))
        return y.view(*shape[:-1], N)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] back from the panels (in the checkpoint's K order)."""
        N, K = self.shape
        q = self.q.to(torch.int32)  # [P, units, 3, 16, 2]
        if self.bits == 4:
            q = torch.cat([q & 0xF, q >> 4], -1)
        q = q.permute(0, 2, 3, 1, 4).reshape(-1, self.kp)[:N]  # [N, Kp]
        kg = torch.repeat_interleave(torch.arange(self.groups), self.bounds.diff().long())
        scale = self.scale.transpose(1, 2).flatten(0, 1)[:N][:, kg]
        zero = self.zc if self.zero is None else self.zero.transpose(1, 2).flatten(0, 1)[:N][:, kg]
        w = ((q.float() - zero) * scale)[:, :K]
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w.to(dtype)
