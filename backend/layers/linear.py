"""A linear layer whose output may be several merged projections (q|k|v, gate|up), with batched LoRA.

LoRA pools (`lora_a`, `lora_b`) are allocated and attached by the adapter registry; the per-step
grouping of tokens by adapter comes from the forward context (under torch.compile, through the opaque op
`loom::apply_lora`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import cpu_lora, lora_apply, torch_ops
from loom.layers.forward_context import get_forward_context

# How a layer reads a checkpoint tensor (loom.models.loader): (index into its parameter, index into the checkpoint
# tensor, or None: those rows are zeros). ALL is the whole of either.
ALL = (slice(None),)
Piece = tuple[tuple, Optional[tuple]]


@dataclass(frozen=True)
class LoraShard:
    """Tensor parallelism: which part of an adapter's full A [.., in] and B^T [.., out] a rank's module holds (S-LoRA):
    a column-parallel layer takes all of A and its own output columns of B, slice by slice; a row-parallel one its
    own input columns of A and all of B (its rank-r partial product goes through B before the layer's one
    all-reduce: the sum over ranks of (x_r A_r^T) B is (x A^T) B, so LoRA adds no collective). full_in and
    full_sizes are the full model's (what an adapter's checkpoint holds)."""

    full_in: int
    full_sizes: tuple[int, ...]
    in_cols: tuple[int, int] | None = None  # A: [start, stop) of the full input; None: all
    out_cols: tuple[tuple[int, int], ...] | None = None  # B: per slice, [start, stop) of the full output; None: all

    def take_a(self, a: torch.Tensor) -> torch.Tensor:
        return a if self.in_cols is None else a[..., self.in_cols[0]:self.in_cols[1]]

    def take_b(self, b: torch.Tensor) -> torch.Tensor:
        if self.out_cols is None:
            return b
        return torch.cat([b[..., lo:hi] for lo, hi in self.out_cols], dim=-1)


class LoRALinear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.slice_offsets = [0]
        for s in self.output_sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + s)
        out = self.slice_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.lora_a: torch.Tensor | None = None  # [num_slices, R, in]
        self.lora_b: torch.Tensor | None = None  # [R, sum(output_sizes)]
        self.lora_group: str | None = None  # set with the pools: qkv_proj, o_proj, gate_up_proj or down_proj
        self.lora_shard: LoraShard | None = None  # tensor-parallel layers: the part of an adapter this rank holds
        # set by the engine where its kernel path packs weights (engine/worker/cpu.py): a GEMM over a packed copy of the
        # weight, dense(x) and dense.with_lora(...) (kernels/cpu_linear.PackedWeight)
        self.dense = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_a is not None:
            if torch.compiler.is_compiling():
                y = self._base(x)
                torch.ops.loom.apply_lora(x, y, self.lora_a, self.lora_b, self.slice_offsets, self.lora_group)
                return y
            meta = step_lora(self.lora_group)
            if meta is not None:
                if self.dense is not None and cpu_lora.takes(x, self.lora_a, self.lora_b):
                    # the deltas added to the GEMM's output tiles
                    return self.dense.with_lora(x, self.lora_a, self.lora_b, self.slice_offsets, meta)
                y = self._base(x)
                lora_apply(x, y, self.lora_a, self.lora_b, self.slice_offsets, meta)
                return y
        return self._base(x)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.dense is None else self.dense(x)

    def checkpoint_pieces(self, kind: str, slice_index: int | None) -> list[Piece]:
        """Where a checkpoint tensor goes: one slice's tensor (q_proj, ...) into its rows, a whole (fused) one whole.
        kind: weight or bias. Tensor-parallel layers read only their part (layers/parallel_linear.py)."""
        if slice_index is None:
            return [(ALL, ALL)]
        return [((slice(self.slice_offsets[slice_index], self.slice_offsets[slice_index + 1]),), ALL)]


def step_lora(group: Optional[str]):
    """This step's LoRA grouping (LoraBatchMeta) if some token has an adapter targeting `group`, else None."""
    meta = get_forward_context().lora
    if meta is not None and meta.token_indices.numel() > 0 and \
            (meta.module_groups is None or group in meta.module_groups):
        return meta
    return None


def apply_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slice_offsets: list[int],
               group: Optional[str]) -> None:
    """y += this step's LoRA deltas for the tokens that have an adapter targeting `group` (in place)."""
    meta = step_lora(group)
    if meta is not None:
        lora_apply(x, y, lora_a, lora_b, slice_offsets, meta)


# Under torch.compile the LoRA part is one opaque op: it reads the per-step forward context.
torch_ops.define("apply_lora(Tensor x, Tensor(a!) y, Tensor lora_a, Tensor lora_b, SymInt[] slice_offsets, "
                 "str? group) -> ()", apply_lora, lambda *args: None)
