"""The experts of a sparse MoE block whose weights a quantized checkpoint stores: kept quantized, one weight (or a
few parts) per expert and projection, in place of layers/moe.Experts' stacked float parameters.

The loader (loom.models.loader) puts one in place of an Experts module once it has read every expert's gate, up and
down weights as QuantizedWeights: gate and up concatenated along the output into one weight per expert where their
quantization matches (layers/quant_linear.concat_out), else kept as two parts. Its forward is kernels/quant_moe.py
(per expert with tokens: the weight-only quantized GEMMs; on CPU over weights re-laid out once at start by
engine/worker/cpu.py). Expert LoRA keeps its pools (ExpertLoRA) and runs fused_moe_lora over the dequantised weights
of the step (correct, not fast: no quantized expert-LoRA kernel).
"""
from __future__ import annotations

import torch
from torch import nn

from loom.kernels.quant_moe import quant_moe
from loom.layers.moe import Experts
from loom.models.quant.weight import QuantizedWeight, dequantize


def _dequantized(w, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w.dequantize(dtype)


class QuantExperts(nn.Module):
    """gate_up[e]: (first output row, weight) parts covering expert e's 2I gate|up rows; down[e]: its [H, I] weight.
    A weight is a QuantizedWeight or, once re-laid out for the C++ kernel, a kernels/cpu_quant.PackedQuantWeight."""

    def __init__(self, base: Experts, gate_up: list[list], down: list):
        super().__init__()
        self.num_experts, self.intermediate_size = base.num_experts, base.intermediate_size
        self.full_intermediate, self.shard = base.full_intermediate, base.shard
        self.lora_gate_up, self.lora_down = base.lora_gate_up, base.lora_down
        self.dense = None
        if len(gate_up) != self.num_experts or len(down) != self.num_experts:
            raise ValueError(f"{len(gate_up)} gate|up and {len(down)} down weights for {self.num_experts} experts")
        hidden = base.down_proj.shape[1]
        for e, (parts, w2) in enumerate(zip(gate_up, down)):
            rows = sum(w.shape[0] for _, w in parts)
            if rows != 2 * self.intermediate_size or any(w.shape[1] != hidden for _, w in parts) or \
                    tuple(w2.shape) != (hidden, self.intermediate_size):
                raise ValueError(f"expert {e}: gate|up {[tuple(w.shape) for _, w in parts]} and down "
                                 f"{tuple(w2.shape)} do not fit hidden {hidden}, intermediate {self.intermediate_size}")
        self.gate_up = [list(p) for p in gate_up]
        self.down = list(down)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return quant_moe(x, self.gate_up, self.down, self.intermediate_size, topk_weights, topk_ids)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) as float (expert LoRA's path, tests; not the forward)."""
        w13 = torch.stack([torch.cat([_dequantized(w, dtype) for _, w in parts]) for parts in self.gate_up])
        return w13, torch.stack([_dequantized(w, dtype) for w in self.down])

    def quantized_weights(self) -> list:
        """The QuantizedWeights (not yet re-laid out): what loom.engine.worker.memory_plan.model_bytes counts."""
        every = [w for parts in self.gate_up for _, w in parts] + self.down
        return [w for w in every if isinstance(w, QuantizedWeight)]

    def map_parts(self, fn) -> None:
        """Replace each weight by fn(weight) (engine/worker/cpu.py: the CPU re-layout)."""
        self.gate_up = [[(start, fn(w)) for start, w in parts] for parts in self.gate_up]
        self.down = [fn(w) for w in self.down]

    def extra_repr(self) -> str:
        w = self.down[0]
        return f"num_experts={self.num_experts}, {getattr(w, 'kind_name', getattr(w, 'kind', '?'))}{w.bits}"
