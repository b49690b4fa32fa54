"""Sparse mixture-of-experts block (Mixtral, Qwen3-MoE): router, top-k routing, fused experts, expert LoRA.

Routing is transformers': softmax over the router logits in float32, top-k of the probabilities, then (Mixtral
always, Qwen3-MoE with norm_topk_prob) division by their sum; Qwen3-MoE rounds the weights to the model dtype.
The experts run in `kernels.fused_moe` (one grouped GEMM launch for gate/up, one for down; on CPU the engine packs
them for the C++ GEMM instead, kernels/cpu_moe.py), or where a quantized checkpoint stores them, kept quantized in a
layers/quant_experts.QuantExperts in place of Experts; a step in which some adapter carries expert LoRA
(`LoraBatchMeta.experts`, the expert rows of those adapters' tokens) runs `kernels.fused_moe_lora` instead (PyTorch,
on every device).

Parameter names follow transformers 5: mlp.gate.weight [E, H], mlp.experts.gate_up_proj [E, 2I, H] (gate rows,
then up rows) and mlp.experts.down_proj [E, H, I].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import fused_moe, fused_moe_lora
from loom.layers.forward_context import get_forward_context
from loom.layers.linear import ALL, LoraShard, Piece


class ExpertLoRA(nn.Module):
    """Where the adapter registry attaches one layer's expert LoRA pools: lora_a [E, S, R, in], lora_b [E, R, out];
    lora_shard (tensor parallelism): the part of an adapter this rank's experts hold (layers.linear.LoraShard)."""

    def __init__(self, num_experts: int, in_features: int, output_sizes: list[int],
                 lora_shard: LoraShard | None = None):
        super().__init__()
        self.num_experts, self.in_features, self.output_sizes = num_experts, in_features, list(output_sizes)
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.lora_group: str | None = None
        self.lora_shard = lora_shard


class Experts(nn.Module):
    """`shard` (tensor parallelism): this rank's slice [start, stop) of each expert's intermediate features, of
    `full_intermediate`; None = all of them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 shard: tuple[int, int, int] | None = None):
        super().__init__()
        self.full_intermediate, start, stop = shard or (intermediate_size, 0, intermediate_size)
        self.shard = slice(start, stop)
        intermediate_size = stop - start
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        # expert LoRA sharded as the experts (S-LoRA): gate|up's B by this rank's intermediate columns of each half,
        # down's A by its intermediate inputs; the partial down deltas join the block's one all-reduce
        full, gu, dn = self.full_intermediate, None, None
        if intermediate_size < full:
            gu = LoraShard(hidden_size, (full, full), None, ((start, stop), (full + start, full + stop)))
            dn = LoraShard(full, (hidden_size,), (start, stop), None)
        self.lora_gate_up = ExpertLoRA(num_experts, hidden_size, [intermediate_size] * 2, gu)
        self.lora_down = ExpertLoRA(num_experts, intermediate_size, [hidden_size], dn)
        # set by the engine on CPU: the experts over packed copies of their weights, dense(x, weights, ids)
        self.dense = None

    def checkpoint_pieces(self, kind: str, expert: int | None = None, half: int | None = None) -> list[Piece]:
        """Where a checkpoint tensor goes: one expert's gate (half 0) / up (half 1) [I, H] or down [H, I], or the
        stacked tensors of every expert as transformers 5 saves them (gate_up [E, 2I, H], down [E, H, I])."""
        n, full, a, b = self.intermediate_size, self.full_intermediate, self.shard.start, self.shard.stop
        every = slice(None)
        if kind == "down_proj":
            return [((expert,), (every, self.shard))] if expert is not None else [(ALL, (every, every, self.shard))]
        if expert is not None:
            return [((expert, slice(half * n, (half + 1) * n)), (self.shard,))]
        return [((every, slice(h * n, (h + 1) * n)), (every, slice(h * full + a, h * full + b))) for h in (0, 1)]


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 round_weights: bool, tp=None, shard: tuple[int, int, int] | None = None):
        """tp (tensor parallelism): the rank group; `shard` its experts' intermediate slice (Experts). The router is
        replicated; each rank's experts give a partial output, summed by one all-reduce."""
        super().__init__()
        self.top_k, self.renormalize, self.round_weights = top_k, renormalize, round_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, shard)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._experts(x)
        return y if self.tp is None else self.tp.all_reduce(y)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, K] float32, expert ids [T, K])."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return weights, ids

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        e = self.experts
        if e.lora_gate_up.lora_a is not None:  # expert pools attached: this step may carry expert LoRA
            meta = get_forward_context().lora
            experts = meta.experts if meta is not None else None
            if experts is not None and experts.token_indices.numel() > 0:
                lora = (e.lora_gate_up.lora_a, e.lora_gate_up.lora_b, e.lora_down.lora_a, e.lora_down.lora_b)
                w13, w2 = (e.gate_up_proj, e.down_proj) if isinstance(e, Experts) else e.dequantized(x.dtype)
                return fused_moe_lora(x, w13, w2, weights, ids, lora, experts)
        if e.dense is not None:
            return e.dense(x, weights, ids)
        if not isinstance(e, Experts):  # layers/quant_experts.QuantExperts: the quantized experts' own path
            return e(x, weights, ids)
        return fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids)
