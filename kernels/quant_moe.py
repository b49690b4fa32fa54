"""Mixture-of-experts MLP over experts whose weights a quantized checkpoint stores (int8 / int4 / FP8 with scales):
fused_moe_ref's loop - per expert that received tokens: gather its tokens, gate|up GEMM, SiLU-and-mul, down GEMM,
scale by the routing weight, add into float32 sums in expert order - with each GEMM the weight-only quantized one
(kernels/dispatch.quant_linear: the C++ kernel over weights re-laid out at start on CPU, Triton's quant_gemm on CUDA,
dequantize + F.linear otherwise), so no expert is ever dequantised whole.

Which tokens an expert got is read on the host (one bincount a layer). While a CUDA graph is being captured no host
read may happen: there every expert runs over every token and its output is weighted by a routing weight that is 0
for the tokens it did not get (exactly 0 added: the same sums), the expert weights read once each as a decode step
reads them anyway once its tokens reach most experts; compute grows by experts / top-k, which decode batches have to
spare. No fused grouped quantized GEMM yet (one launch per expert and GEMM).

An expert's gate|up is a list of parts, (first output row, weight), as QuantLinear's (gate and up concatenated into
one weight where their quantization matches, else one GEMM each); its down is one weight.
"""
from __future__ import annotations

import torch

from loom.kernels.dispatch import quant_linear, quant_linear_parts
from loom.kernels.moe import _expert_pairs, _silu_mul


def _expert(x: torch.Tensor, gate_up: list, down, inter: int) -> torch.Tensor:
    return quant_linear(_silu_mul(quant_linear_parts(x, gate_up), inter), down)


def quant_moe(x: torch.Tensor, gate_up: list[list], down: list, inter: int, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, every_token: bool | None = None) -> torch.Tensor:
    """x [T, H], gate_up[e] the parts of expert e's [2I, H] weight, down[e] its [H, I] weight, topk_weights [T, K]
    (float32), topk_ids [T, K] -> [T, H] in x.dtype. every_token: each expert over every token (None: while a CUDA
    graph is captured)."""
    T, H = x.shape
    E = len(down)
    acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if every_token is None:
        every_token = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if every_token:
        routed = torch.zeros((T, E), dtype=torch.float32, device=x.device)
        routed.scatter_(1, topk_ids.long(), topk_weights.float())  # [T, E]: 0 where not routed
        for e in range(E):
            acc += _expert(x, gate_up[e], down[e], inter).float() * routed[:, e:e + 1]
        return acc.to(x.dtype)
    tw = topk_weights.reshape(-1).float()
    for e, pairs, tok in _expert_pairs(topk_ids, E):
        y = _expert(x.index_select(0, tok), gate_up[e], down[e], inter)
        acc.index_add_(0, tok, y.float() * tw[pairs, None])
    return acc.to(x.dtype)
