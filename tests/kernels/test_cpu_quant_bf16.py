"""The bfloat16-activation weight-only GEMM (kernels/cpu_quant_bf16.py, csrc/quant_gemm_bf16.cpp) against float64
math on the dequantised weights, in every C++ build this host runs: int4 / int8, groups of 128 and 32, per channel,
symmetric and asymmetric, act-order, K not a multiple of the pair / quad unit, N cutting the last panel; M = 1 and 2
(register tiles over the packed bytes), 5 and 9 (decoded panels, a partial row tile). Both the
VDPBF16PS kernel (where the CPU has avx512_bf16) and its plain C++ build (emulate, every CPU) run."""
import functools

import pytest
import torch

from harness.quant_checkpoints import fp8_weight, int_weight
from loom.kernels import cpu_quant_bf16
from loom.kernels.cpu_quant import _columns, _rows
from loom.kernels.cpu_quant_bf16 import PackedQuantBf16, takes
from loom.models.quant import dequantize
from loom.models.quant.weight import unpack_int32

pytestmark = pytest.mark.usefixtures("cpu_build")  # every test once per C++ build (conftest.py)

N = 104  # three panels of 48, the last one of 8 columns (GPTQ packing wants N a multiple of 8)
WEIGHTS = {  # name: (make, K)
    "int4-g128-sym": (lambda w: int_weight(w, 4, 128, sym=True), 384),
    "int4-g128-asym": (lambda w: int_weight(w, 4, 128, sym=False), 384),
    "int4-channel-sym-odd-k": (lambda w: int_weight(w, 4, -1, sym=True), 261),
    "int4-channel-asym-odd-k": (lambda w: int_weight(w, 4, -1, sym=False), 263),
    "int4-g32-act-order-asym": (lambda w: int_weight(w, 4, 32, sym=False, desc_act=True, seed=3), 256),
    "int8-g128-sym": (lambda w: int_weight(w, 8, 128, sym=True), 384),
    "int8-g128-asym-tail-group": (lambda w: int_weight(w, 8, 128, sym=False), 300),
    "int8-channel-asym-odd-k": (lambda w: int_weight(w, 8, -1, sym=False), 259),
    "int8-g128-act-order-sym": (lambda w: int_weight(w, 8, 128, sym=True, desc_act=True, seed=5), 256),
}
PATHS = ["emulated", "vdpbf16ps"]


@functools.lru_cache(maxsize=None)  # the GPTQ packing is most of a case's time
def weight(name: str):
    make, k = WEIGHTS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return make(torch.randn(N, k, generator=g) * 0.05)


def packed(qw, path: str) -> PackedQuantBf16:
    if path == "vdpbf16ps" and not cpu_quant_bf16.runs_here():
        pytest.skip("the VDPBF16PS kernel needs avx512_bf16 (the emulated build of the same algorithm runs here)")
    return PackedQuantBf16(qw, emulate=path == "emulated")


def float64_bound(qw, x: torch.Tensor, bias, out_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ dequant(W)^T + bias in float64, the bound on the kernel's error): every term x_k q_k, x_k zero and the
    group and bias sums pass at most K + G + 4 float32 roundings (a group's dot chains and their sum, its x sum, the
    zero-point and scale fmas, the sum over groups), so gamma_(K + G + 4) sum_k |x_k| |scale| (|q_k| + |zero|), plus
    the bias's rounding; then the output's bfloat16 rounding (2**-8 relative)."""
    n, k = qw.shape
    cols = _columns(qw)
    scale = _rows(qw, qw.scale)[:, cols].double()
    zero = _rows(qw, qw.zero)[:, cols].double() if qw.zero is not None else torch.full((n, k), 2.0 ** (qw.bits - 1),
                                                                                      dtype=torch.float64)
    q = unpack_int32(qw.weight, qw.bits, k).double()
    w = dequantize(qw).double()
    assert torch.equal(((q - zero) * scale).float(), w.float())  # what the checkpoint's numbers mean
    x64 = x.double()
    want = x64 @ w.T
    u, terms = 2.0 ** -24, k + int(cols.max()) + 1 + 4
    bound = terms * u / (1 - terms * u) * (x64.abs() @ (scale.abs() * (q.abs() + zero.abs())).T) * 1.01
    if bias is not None:
        want = want + bias.double()
        bound = bound + u * (want.abs() + bias.double().abs())
    if out_bf16:
        bound = bound + 2.0 ** -8 * (want.abs() + bound)
    return want, bound + 1e-30


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M, bias", [(1, False), (2, True), (5, True), (9, False)],
                         ids=["M1", "M2-bias", "M5-bias", "M9"])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_vs_float64_on_dequantised_weights(name, M, bias, path):
    qw = weight(name)
    assert takes(qw)
    p = packed(qw, path)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, qw.shape[1], generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g) if bias else None
    y = p(x, b)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    want, bound = float64_bound(qw, x, b, out_bf16=True)
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("path", PATHS)
def test_float32_out_and_rows_independent(path):
    """float32 x is rounded to bfloat16 and y left float32; a row's result does not depend on the rows beside it
    (M = 1 straight over the packed bytes, M = 9 over decoded panels)."""
    qw = weight("int4-g128-asym")
    p = packed(qw, path)
    x = torch.randn(9, qw.shape[1], generator=torch.Generator().manual_seed(1))
    y = p(x)
    assert y.dtype == torch.float32
    want, bound = float64_bound(qw, x.to(torch.bfloat16), None, out_bf16=False)
    assert bool(((y.double() - want).abs() <= bound).all())
    for i in (0, 4, 8):
        assert torch.equal(p(x[i:i + 1]), y[i:i + 1])


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_packing_keeps_the_weight(name):
    qw = weight(name)
    assert torch.equal(PackedQuantBf16(qw, emulate=True).dequantize(), dequantize(qw))


def test_refusals():
    w = torch.randn(N, 256) * 0.05
    assert not takes(fp8_weight(w, "channel"))
    with pytest.raises(ValueError, match="int8 or int4"):
        PackedQuantBf16(fp8_weight(w, "channel"), emulate=True)
