"""Weight-only quantized GEMM on CPU: y = x @ dequant(W)^T + b with W kept as 8-bit ints, 4-bit ints or FP8 (e4m3)
and dequantised in registers by the C++ kernel (kernels/csrc/quant_gemm.cpp), x float32 (bfloat16 x is widened and
the result rounded back).

`PackedQuantWeight` re-lays a QuantizedWeight (loom.models.quant.weight) out once, at load, into the kernel's panels:
NR output columns a panel (the float GEMM's panel width), each input column's NR bytes adjacent (int4: two columns'
nibbles per byte), scales and zero points widened to float32 [panel, group, NR] (per-tensor and block-wise scales
expanded to one row per output column), and an act-order checkpoint's K permuted so that each group's columns are
adjacent (x's columns gathered by the same permutation at each call). Each output element is one fma chain over k
in the (permuted) order on w = (q - zero) * scale exactly as dequantize() computes it: the bits of loom's float32
GEMM over the dequantised weight (with the same K order), whatever the batch size.

Memory: the panels hold N * K bytes (int8, FP8) or N * K / 2 (int4), plus 8 bytes per (output column, group) of
scale and zero point, where the float32 GEMM's hold 4 * N * K.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from loom.kernels import cpu_ext
from loom.kernels.cpu_linear import panel_width, row_block
from loom.models.quant.weight import QuantizedWeight, dequantize, unpack_int32

KIND_U8, KIND_U4, KIND_F8 = 0, 1, 2


def takes(qw: QuantizedWeight) -> bool:
    """Whether the C++ kernel runs this weight (int4: every group, its columns made adjacent, of even length: the
    kernel takes nibble pairs of one group)."""
    if qw.kind == "fp8" or (qw.kind == "int" and qw.bits == 8):
        return True
    if not (qw.kind == "int" and qw.bits == 4):
        return False
    counts = torch.unique_consecutive(torch.sort(_columns(qw)).values, return_counts=True)[1]
    return not bool((counts % 2).any())


def _columns(qw: QuantizedWeight) -> torch.Tensor:
    """int64 [in]: the scale column of each input column."""
    inp = qw.shape[1]
    if qw.g_idx is not None:
        return qw.g_idx.to("cpu", torch.int64)
    size = qw.block[1] if qw.block is not None else qw.group_size
    return torch.arange(inp) // size if size else torch.zeros(inp, dtype=torch.int64)


def _rows(qw: QuantizedWeight, t: torch.Tensor) -> torch.Tensor:
    """A [rows, groups] scale / zero point tensor -> float32 [out, groups]: one row per output column."""
    out = qw.shape[0]
    if qw.block is not None:
        idx = torch.arange(out) // qw.block[0]
    else:
        idx = torch.arange(out) if t.shape[0] == out else torch.zeros(out, dtype=torch.int64)
    return t.to("cpu", torch.float32)[idx]


def _panels(t: torch.Tensor, nr: int) -> torch.Tensor:
    """[Np, X] (Np a multiple of nr) -> [Np / nr, X, nr], contiguous."""
    return t.unflatten(0, (-1, nr)).transpose(1, 2).contiguous()


def act_order_groups(qw: QuantizedWeight) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(the act-order permutation that makes each group's input columns adjacent, or None; the scale columns in the
    order K then runs; each group's length)."""
    cols, perm = _columns(qw), None
    if qw.g_idx is not None:
        p = torch.argsort(cols, stable=True)
        if not torch.equal(p, torch.arange(cols.numel())):
            perm, cols = p, cols[p]
    used, counts = torch.unique_consecutive(cols, return_counts=True)
    return perm, used, counts


class PackedQuantBase:
    """What the C++ weight-only kernels' packed weights share: the scales (and zero points) as float32 panels
    [panel, group, nr], the shape, the bytes held, and the QuantizedWeight packed from until drop_source()."""

    shape: tuple[int, int]
    q: torch.Tensor
    bounds: torch.Tensor
    perm: Optional[torch.Tensor]  # act-order: the input columns in the packed K order, or None

    def _input_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] as rows [M, K], its columns in the order the packed K runs."""
        x2 = x.reshape(-1, self.shape[1])
        return x2.index_select(1, self.perm) if self.perm is not None else x2

    def _pack_scales(self, qw: QuantizedWeight, used: torch.Tensor, np_: int, nr: int) -> None:
        N = qw.shape[0]
        self.scale = _panels(F.pad(_rows(qw, qw.scale)[:, used], (0, 0, 0, np_ - N)), nr)
        self.zero = None
        if qw.zero is not None:
            self.zero = _panels(F.pad(_rows(qw, qw.zero)[:, used], (0, 0, 0, np_ - N)), nr)
        self.source: Optional[QuantizedWeight] = qw

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def drop_source(self) -> None:
        """Forget the QuantizedWeight this was packed from (its tensors are a second copy of the weight)."""
        self.source = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero, self.bounds) if t is not None)


class PackedQuantWeight(PackedQuantBase):
    """A QuantizedWeight re-laid-out for the C++ kernel (see the module's doc); `quant` keeps the original's
    description (shape, kind, bits, groups), its tensors dropped with drop_source()."""

    def __init__(self, qw: QuantizedWeight):
        lib = cpu_ext.load()
        if lib is None or not takes(qw):
            raise ValueError("the C++ quantized GEMM needs the built CPU kernels and an int8, FP8 or int4 (groups of "
                             "even length) weight")
        qw.validate()
        self.lib, self.shape, self.kind_name, self.bits = lib, qw.shape, qw.kind, qw.bits
        N, K = qw.shape
        nr = panel_width()
        np_ = -(-N // nr) * nr
        # the groups in the order K now runs (the scale columns follow), each a run of columns: group g's are
        # [bounds[g], bounds[g + 1])
        self.perm, used, counts = act_order_groups(qw)
        self.bounds = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32).contiguous()
        self.groups = int(used.numel())
        if qw.kind == "fp8":
            q = qw.weight.to("cpu").view(torch.uint8)
            self.kind = KIND_F8
        else:
            q = unpack_int32(qw.weight.to("cpu"), qw.bits, K).to(torch.uint8)
            self.kind = KIND_U8 if qw.bits == 8 else KIND_U4
        if self.perm is not None:
            q = q[:, self.perm]
        q = F.pad(q, (0, 0, 0, np_ - N))
        if self.kind == KIND_U4:  # k even in the low nibble, k + 1 in the high one
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.q = _panels(q, nr)
        self._pack_scales(qw, used, np_, nr)
        self.zc = float(1 << (qw.bits - 1)) if qw.kind == "int" else 0.0

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        N, K = self.shape
        shape = x.shape
        x2 = self._input_rows(x)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        y = torch.empty((m, N), dtype=torch.float32)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        if m:
            self.lib.loom_quant_gemm(
                x2.data_ptr(), x2.stride(0), m, K, self.q.data_ptr(), self.kind, self.scale.data_ptr(),
                None if self.zero is None else self.zero.data_ptr(), self.zc, self.bounds.data_ptr(), self.groups, N,
                None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), row_block(m, K),
                cpu_ext.nthreads())
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*shape[:-1], N)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] back from the panels (in the checkpoint's K order): dequantize(qw)'s bits."""
        N, K = self.shape
        q = self.q.transpose(1, 2).flatten(0, 1)[:N].to(torch.int32)  # [N, K or K / 2]
        if self.kind == KIND_U4:
            q = torch.stack([q & 0xF, q >> 4], -1).flatten(1)
        kg = torch.repeat_interleave(torch.arange(self.groups), self.bounds.diff().long())
        scale = self.scale.transpose(1, 2).flatten(0, 1)[:N][:, kg]
        if self.kind == KIND_F8:
            w = q.to(torch.uint8).view(torch.float8_e4m3fn).float()
        else:
            zero = self.zc if self.zero is None else self.zero.transpose(1, 2).flatten(0, 1)[:N][:, kg]
            w = q.float() - zero
        w = w * scale
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w.to(dtype)


def quant_linear_ref(x: torch.Tensor, qw: QuantizedWeight | PackedQuantWeight,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, dequantize(qw, x.dtype), bias): the reference."""
    w = qw.dequantize(x.dtype) if isinstance(qw, PackedQuantWeight) else dequantize(qw, x.dtype)
    return F.linear(x, w.to(x.device), None if bias is None else bias.to(x.dtype))
