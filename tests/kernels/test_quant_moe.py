"""kernels/quant_moe.py: MoE experts over quantized weights (int4 groups, int8 channels, FP8 blocks; gate and up
one weight or two parts), both ways it runs - the experts that got tokens over their tokens, and (as while a CUDA
graph is captured) every expert over every token weighted 0 where not routed - through the C++ weight-only GEMM and
the Triton kernel (the interpreter), against fused_moe_ref on the dequantised weights in float64."""
from __future__ import annotations

import pytest
import torch

from harness.quant_checkpoints import fp8_weight, int_weight
from loom.kernels import cpu_ext
from loom.kernels.cpu_quant import PackedQuantWeight, takes
from loom.kernels.moe import fused_moe_ref
from loom.kernels.quant_moe import quant_moe
from loom.models.quant.weight import dequantize
from tests.oracle import assert_float32_close, float32_error_scale

E, H, I, T, K = 4, 128, 64, 7, 2
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning


def _experts(kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = [], []
    for e in range(E):
        w13, w2 = torch.randn(2 * I, H, generator=g) * 0.1, torch.randn(H, I, generator=g) * 0.1
        if kind == "int4":  # gate and up quantized apart with act-order: two parts
            parts = [(0, int_weight(w13[:I], 4, 32, sym=False, desc_act=True, seed=e)),
                     (I, int_weight(w13[I:], 4, 32, sym=False, desc_act=True, seed=e + 9))]
            w = int_weight(w2, 4, 32, sym=True)
        elif kind == "int8":
            parts, w = [(0, int_weight(w13, 8, -1, sym=True))], int_weight(w2, 8, -1, sym=False)
        else:
            parts, w = [(0, fp8_weight(w13, "block", (64, 64)))], fp8_weight(w2, "channel")
        gate_up.append(parts)
        down.append(w)
    return gate_up, down


def _dense(gate_up, down):
    w13 = torch.stack([torch.cat([dequantize(w) for _, w in parts]) for parts in gate_up])
    return w13, torch.stack([dequantize(w) for w in down])


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_quant_moe_equals_fused_moe_on_dequantised_weights(monkeypatch, path, kind):
    gate_up, down = _experts(kind, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g)
    probs = torch.softmax(torch.randn(T, E - 1, generator=g), -1)
    weights, ids = torch.topk(probs, K, -1)  # the last expert gets no token: it must add nothing
    w13, w2 = _dense(gate_up, down)
    ref32 = fused_moe_ref(x, w13, w2, weights, ids)
    ref64 = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    scale = float32_error_scale(ref32, ref64)
    if path == "cpu":
        assert cpu_ext.load() is not None, "the C++ CPU kernels failed to build (a compiler is part of the set-up)"
        assert all(takes(w) for parts in gate_up for _, w in parts)
        gate_up = [[(s, PackedQuantWeight(w)) for s, w in parts] for parts in gate_up]
        down = [PackedQuantWeight(w) for w in down]
    else:
        monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    for every in (False, True):
        got = quant_moe(x, gate_up, down, I, weights, ids, every_token=every)
        assert_float32_close(got, ref64, scale, f"{path} {kind} every_token={every}")
