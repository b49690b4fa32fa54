"""A tensor-parallel rank's shard of a QuantizedWeight, in the same canonical layout (loom.models.quant.weight).

A column-parallel layer takes its output rows (packed rows, and the scale / zero point rows where they are per output
channel or per row block); a row-parallel one takes its input columns (whole packed words, and the scale / zero
point columns of its groups or column blocks). Where the rank's range cuts a packed word, a group or a block, the
weight cannot be split: `Unsplittable`, which the loader turns into a ConfigError naming tensor_parallel_size (vLLM
refuses these layouts the same way rather than dequantising them).

Act-order weights (GPTQ desc_act, compressed-tensors weight_g_idx): a rank's columns carry their own g_idx entries and
may belong to any group, so every scale column is kept (as vLLM does for act-order under row parallelism); the
kernels index the scales through g_idx and need no more (kernels/quant_gemm.py, kernels/cpu_quant.py).

Slices are copied (clone), so the whole tensors read from the checkpoint are freed once the shard is taken.
"""
from __future__ import annotations

import dataclasses

from loom.models.quant.weight import QuantizedWeight


class Unsplittable(ValueError):
    """This rank's rows or columns of a quantized weight cut a packed word, a group or a block."""


def take(qw: QuantizedWeight, src: tuple) -> QuantizedWeight:
    """The part of `qw` a checkpoint index selects: (rows,) or (rows, columns), each a slice (the loader's pieces,
    layers/parallel_linear.py). The whole weight comes back as it is."""
    out, inp = qw.shape
    r0, r1, _ = src[0].indices(out)
    c0, c1, _ = src[1].indices(inp) if len(src) > 1 else (0, inp, 1)
    if (r0, r1) != (0, out):
        qw = take_rows(qw, r0, r1)
    if (c0, c1) != (0, inp):
        qw = take_cols(qw, c0, c1)
    return qw


def _aligned(a: int, b: int, full: int, unit: int, what: str, where: str) -> tuple[int, int]:
    """[a // unit, ceil(b / unit)): the units covering [a, b), which must start and end on a unit boundary (or at the
    end of the dimension)."""
    if a % unit or (b % unit and b != full):
        raise Unsplittable(f"its {where} [{a}, {b}) of {full} are not whole {what} of {unit}")
    return a // unit, -(-b // unit)


def take_rows(qw: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    """Output rows [a, b)."""
    out = qw.shape[0]
    if qw.block is not None:
        lo, hi = _aligned(a, b, out, qw.block[0], "row blocks", "output rows")
    elif qw.scale.shape[0] == out:
        lo, hi = a, b
    else:  # one scale row for every output row (per tensor): shared as it is
        lo, hi = 0, qw.scale.shape[0]

    def rows(t):
        return None if t is None else t[lo:hi].clone()

    # g_idx is per input column: the same tensor for every row range (a fused tensor's slices concatenate again)
    return dataclasses.replace(qw, shape=(b - a, qw.shape[1]), weight=qw.weight[a:b].clone(), scale=rows(qw.scale),
                               zero=rows(qw.zero))


def take_cols(qw: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    """Input columns [a, b)."""
    inp = qw.shape[1]
    if qw.kind == "int":
        w0, w1 = _aligned(a, b, inp, 32 // qw.bits, f"{32 // qw.bits}-column packed words", "input columns")
        weight = qw.weight[:, w0:w1].clone()
    else:
        weight = qw.weight[:, a:b].clone()
    g_idx = None
    if qw.g_idx is not None:  # act-order: every group kept, the columns' own group indices
        lo, hi, g_idx = 0, qw.scale.shape[1], qw.g_idx[a:b].clone()
    elif qw.block is not None:
        lo, hi = _aligned(a, b, inp, qw.block[1], "column blocks", "input columns")
    elif qw.group_size:
        lo, hi = _aligned(a, b, inp, qw.group_size, "groups", "input columns")
    else:  # one group per row
        lo, hi = 0, qw.scale.shape[1]

    def cols(t):
        return None if t is None else t[:, lo:hi].clone()

    return dataclasses.replace(qw, shape=(qw.shape[0], b - a), weight=weight, scale=cols(qw.scale),
                               zero=cols(qw.zero), g_idx=g_idx)
