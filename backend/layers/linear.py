"""A linear layer whose output may be several merged projections (q|k|v, gate|up), with batched LoRA.

LoRA pools (`lora_a`, `lora_b`) are allocated and attached by the adapter registry; the per-step
grouping of tokens by adapter comes from the forward context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import lora_expand, lora_shrink
from loom.layers.forward_context import get_forward_context


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_a is not None:
            meta = get_forward_context().lora
            if meta is not None and meta.token_indices.numel() > 0 and \
                    (meta.module_groups is None or self.lora_group in meta.module_groups):
                buf = lora_shrink(x, self.lora_a, meta)
                lora_expand(buf, self.lora_b, self.slice_offsets, meta, y)
        return y
