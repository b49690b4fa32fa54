"""The one form every quantized-checkpoint reader produces, and its reference dequantisation.

`QuantizedWeight` keeps a linear weight as the checkpoint stores it, in one canonical layout whatever the format, so
a quantized GEMM kernel can take it as is:

- integer weights (`kind == "int"`, 4 or 8 bits): `weight` is int32 [out, ceil(in * bits / 32)], packed along the
  input dimension, element j of a row in word j // (32 / bits) at bit shift bits * (j % (32 / bits)), unsigned
  (0 .. 2**bits - 1). `zero` holds the unsigned zero points (int32, the shape of `scale`); None means symmetric,
  zero point 2**(bits - 1). w = (q - zero) * scale.
- FP8 weights (`kind == "fp8"`): `weight` is float8_e4m3fn [out, in]; w = weight * scale.

`scale` is [rows, cols]: rows is out (per output channel), 1 (one scale for every row), or ceil(out / block[0])
(block-wise); cols is the number of groups along the input dimension (1: per channel or per tensor). The scale column
of input column j is `g_idx[j]` when given (GPTQ act-order; a tensor-parallel shard keeps every scale column), else
j // group_size, else j // block[1], else 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("int", "fp8")


@dataclass
class QuantizedWeight:
    shape: tuple[int, int]  # (out_features, in_features) of the float weight
    kind: str  # "int" | "fp8"
    bits: int
    weight: torch.Tensor  # int: packed int32 [out, ceil(in * bits / 32)]; fp8: float8_e4m3fn [out, in]
    scale: torch.Tensor  # float [out | 1 | ceil(out / block[0]), groups]
    zero: torch.Tensor | None = None  # int32 unsigned zero points, scale's shape; None: symmetric
    group_size: int | None = None  # input columns per scale column
    g_idx: torch.Tensor | None = None  # int [in]: the scale column of each input column (act-order)
    block: tuple[int, int] | None = None  # (rows, cols) one scale covers (block-wise FP8)

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def validate(self) -> None:
        """Raise ValueError, naming what disagrees, unless the tensors fit the shape and the layout above."""
        out, inp = self.shape
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "int":
            if self.bits not in (4, 8):
                raise ValueError(f"{self.bits}-bit integer weights are not supported (4 or 8)")
            want, dtype = (out, -(-inp * self.bits // 32)), torch.int32
        else:
            want, dtype = (out, inp), torch.float8_e4m3fn
        if tuple(self.weight.shape) != want or self.weight.dtype != dtype:
            raise ValueError(f"weight is {self.weight.dtype} {tuple(self.weight.shape)}, expected {dtype} {want}")
        if self.scale.dim() != 2:
            raise ValueError(f"scale has shape {tuple(self.scale.shape)}, expected 2 dims")
        rows, cols = self.scale.shape
        if self.block is not None:
            want_scale = (-(-out // self.block[0]), -(-inp // self.block[1]))
            if (rows, cols) != want_scale:
                raise ValueError(f"scale has shape {(rows, cols)}, expected {want_scale} for blocks {self.block}")
        else:
            if rows not in (out, 1):
                raise ValueError(f"scale has {rows} rows for {out} output features")
            # (a meta g_idx, the memory plan's: its values unknown, every scale column taken as used)
            groups = (cols if self.g_idx.is_meta else int(self.g_idx.max()) + 1) if self.g_idx is not None else \
                -(-inp // self.group_size) if self.group_size else 1
            # act-order: a tensor-parallel shard's columns need not reach the last group (models/quant/shard.py)
            fits = cols >= groups if self.g_idx is not None else cols == groups
            if not fits or (self.g_idx is not None and tuple(self.g_idx.shape) != (inp,)):
                raise ValueError(f"scale has {cols} groups, expected {groups} for {inp} input features")
        if self.zero is not None and tuple(self.zero.shape) != tuple(self.scale.shape):
            raise ValueError(f"zero points have shape {tuple(self.zero.shape)}, scale {tuple(self.scale.shape)}")


def meta_weight(shape: tuple[int, int], kind: str, bits: int, scale_shape: tuple[int, int], scale_dtype: torch.dtype,
                zero: bool = False, group_size: int | None = None, act_order: bool = False,
                block: tuple[int, int] | None = None) -> QuantizedWeight:
    """A QuantizedWeight of this layout on the meta device: what a reader produces for such a checkpoint tensor,
    without its values (loom.engine.worker.memory_plan counts its bytes)."""
    out, inp = shape
    meta = torch.device("meta")
    weight = torch.empty((out, -(-inp * bits // 32)), dtype=torch.int32, device=meta) if kind == "int" else \
        torch.empty((out, inp), dtype=torch.float8_e4m3fn, device=meta)
    return QuantizedWeight(shape=(out, inp), kind=kind, bits=bits, weight=weight,
                           scale=torch.empty(scale_shape, dtype=scale_dtype, device=meta),
                           zero=torch.empty(scale_shape, dtype=torch.int32, device=meta) if zero else None,
                           group_size=group_size, block=block,
                           g_idx=torch.empty((inp,), dtype=torch.int32, device=meta) if act_order else None)


def num_groups(inp: int, group_size: int | None) -> int:
    return -(-inp // group_size) if group_size else 1


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ints [..., n] (each < 2**bits) -> int32 [..., ceil(n * bits / 32)], packed along the last dim."""
    per = 32 // bits
    n = values.shape[-1]
    v = values.to(torch.int64)
    if n % per:
        v = torch.nn.functional.pad(v, (0, per - n % per))
    v = v.unflatten(-1, (-1, per)) << (torch.arange(per, dtype=torch.int64) * bits)
    words = v.sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed


def unpack_int32(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 [..., words] -> the first n unsigned ints [..., n] (int32), unpacked along the last dim."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.flatten(-2)[..., :n]


def _expand(t: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """A [rows, cols] scale (or zero point) tensor -> [out, in], each weight element's own value."""
    out, inp = qw.shape
    if qw.block is not None:
        rows, cols = torch.arange(out) // qw.block[0], torch.arange(inp) // qw.block[1]
    else:
        rows = torch.arange(out) if t.shape[0] == out else torch.zeros(out, dtype=torch.long)
        cols = qw.g_idx.long() if qw.g_idx is not None else \
            torch.arange(inp) // qw.group_size if qw.group_size else torch.zeros(inp, dtype=torch.long)
    return t[rows][:, cols]


@torch.no_grad()
def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [out, in]: computed in float32 (exact products of the stored values), then cast to dtype."""
    qw.validate()
    if qw.kind == "fp8":
        w = qw.weight.float()
    else:
        q = unpack_int32(qw.weight, qw.bits, qw.shape[1])
        zero = _expand(qw.zero, qw) if qw.zero is not None else 1 << (qw.bits - 1)
        w = (q - zero).float()
    return (w * _expand(qw.scale.float(), qw)).to(dtype)
