"""A linear layer whose weight a quantized checkpoint stores (int8 / int4 / FP8 with scales): kept quantized, never
dequantised whole; a drop-in for LoRALinear, fused q|k|v and gate|up included.

The loader (loom.models.loader) puts one in place of a LoRALinear once it has read every slice of its weight as a
QuantizedWeight: the slices concatenated along the output dimension into one (`concat_out`: the same format, groups
and act-order), else kept as several parts, each its own GEMM into its columns of the output. Its forward is
kernels/dispatch.quant_linear per part (Triton's weight-only kernel on CUDA, the C++ weight-only GEMM on CPU over the
weights re-laid out once at start by engine/worker/cpu.py, the reference dequantize + F.linear otherwise), then the LoRA
deltas as LoRALinear adds them (after the base GEMM, on the PyTorch / C++ LoRA path: there is no packed float `dense`
to fuse them into). Under tensor parallelism it holds a rank's shard (a column-parallel layer's output rows, a
row-parallel one's input columns, whose partial output it all-reduces as RowParallelLinear does).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from loom.kernels.dispatch import quant_linear_parts
from loom.layers.linear import LoRALinear
from loom.layers.parallel_linear import RowParallelLinear
from loom.models.quant.weight import QuantizedWeight, dequantize


class QuantLinear(LoRALinear):
    """parts: (first output column, weight) pairs covering the output columns in order; a weight is a
    QuantizedWeight or, once re-laid out for the C++ kernel, a kernels/cpu_quant.PackedQuantWeight."""

    def __init__(self, base: LoRALinear, parts: list[tuple[int, object]]):
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.output_sizes = list(base.output_sizes)
        self.slice_offsets = list(base.slice_offsets)
        self.bias = base.bias
        self.lora_a = self.lora_b = None
        self.lora_group = base.lora_group
        self.lora_shard = base.lora_shard
        self.dense = None  # the C++ layer pass and the fused LoRA epilogue take float panels only
        # a row-parallel rank's shard (its input columns): its partial output summed over the ranks, as the base did
        self.reduce = base.tp if isinstance(base, RowParallelLinear) else None
        self.parts = list(parts)
        stops = [start for start, _ in self.parts[1:]] + [self.slice_offsets[-1]]
        for (start, w), stop in zip(self.parts, stops):
            if tuple(w.shape) != (stop - start, self.in_features):
                raise ValueError(f"a part of {tuple(w.shape)} at column {start} does not fit [{stop - start}, "
                                 f"{self.in_features}]")

    @property
    def out_features(self) -> int:
        return self.slice_offsets[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.reduce is None else self.reduce.all_reduce(y)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear_parts(x, self.parts, self.bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] (for tests and checks; never used by the forward)."""
        return torch.cat([w.dequantize(dtype) if not isinstance(w, QuantizedWeight) else dequantize(w, dtype)
                          for _, w in self.parts])

    def quantized_weights(self) -> list:
        """The QuantizedWeight parts (not yet re-laid out): what loom.engine.worker.memory_plan.model_bytes counts."""
        return [w for _, w in self.parts if isinstance(w, QuantizedWeight)]

    def map_parts(self, fn) -> None:
        """Replace each part's weight by fn(weight) (engine/worker/cpu.py: the CPU re-layout)."""
        self.parts = [(start, fn(w)) for start, w in self.parts]

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{getattr(w, 'kind_name', getattr(w, 'kind', '?'))}{w.bits}" for _, w in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=[{kinds}]"


def concat_out(weights: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
    """Several quantized weights of the same input dimension stacked along the output dimension as one (the fused
    q|k|v, gate|up): their packed rows, scales and zero points concatenated. None where that is not one weight: a
    different format, bit width, group size, block shape, act-order g_idx, or symmetry, or block-wise scales whose
    row blocks a slice boundary would split."""
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    key = (first.kind, first.bits, first.group_size, first.block, first.zero is None, first.shape[1],
           tuple(first.scale.shape[1:]))
    for w in weights:
        if (w.kind, w.bits, w.group_size, w.block, w.zero is None, w.shape[1], tuple(w.scale.shape[1:])) != key:
            return None
        if (w.g_idx is None) != (first.g_idx is None) or (w.g_idx is not None and w.g_idx is not first.g_idx and (
                w.g_idx.is_meta or not torch.equal(w.g_idx, first.g_idx))):  # meta: act-orders taken as distinct
            # (unless one tensor: the row slices of one fused checkpoint tensor under tensor parallelism)
            return None
    if first.block is not None and any(w.shape[0] % first.block[0] for w in weights[:-1]):
        return None

    scale_dtype = first.scale.dtype if all(w.scale.dtype == first.scale.dtype for w in weights) else torch.float32
    # (meta weights, loom.engine.worker.memory_plan: values unknown, slices' per-tensor scales taken as distinct)
    same_single = first.block is None and not first.scale.is_meta and all(
        w.scale.shape[0] == 1 and torch.equal(w.scale, first.scale) and
        (w.zero is None or torch.equal(w.zero, first.zero)) for w in weights)

    def rows(w: QuantizedWeight, t: torch.Tensor) -> torch.Tensor:
        """Block-wise rows as they are; otherwise a row per output column (a per-tensor one expanded)."""
        if first.block is not None:
            return t
        return t.expand(w.shape[0], -1) if t.shape[0] == 1 else t

    if same_single:  # one scale (and zero point) for every slice: kept as one
        scale, zero = first.scale, first.zero
    else:
        scale = torch.cat([rows(w, w.scale.to(scale_dtype)) for w in weights])
        zero = None if first.zero is None else torch.cat([rows(w, w.zero) for w in weights])
    out = QuantizedWeight(shape=(sum(w.shape[0] for w in weights), first.shape[1]), kind=first.kind, bits=first.bits,
                          weight=torch.cat([w.weight for w in weights]), scale=scale.contiguous(),
                          zero=None if zero is None else zero.contiguous(), group_size=first.group_size,
                          g_idx=first.g_idx, block=first.block)
    out.validate()
    return out
