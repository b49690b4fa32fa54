"""The C++ weight-only quantized GEMM (kernels/cpu_quant.py, csrc/quant_gemm.cpp) against float64 math on the
dequantised weights (loom.models.quant.dequantize, itself checked against the formats' own tools in
tests/models/test_quantized.py), in every build this host runs: int4 / int8 with groups of 128 and 32, per channel,
symmetric and asymmetric, act-order g_idx; FP8 with block, channel and tensor scales; M = 1 (decode, the register
tile over the packed bytes), 5, 33 (dequantised panels); panels cut by N."""
import pytest
import torch

from harness.quant_checkpoints import fp8_weight, int_weight
from loom.kernels import dispatch
from loom.kernels.cpu_linear import PackedWeight
from loom.kernels.cpu_quant import PackedQuantWeight, quant_linear_ref, takes
from loom.models.quant import dequantize
from loom.models.quant.shard import take_cols, take_rows

pytestmark = pytest.mark.usefixtures("cpu_build")  # every test once per C++ build (conftest.py)


N, K = 200, 384  # 200: the last panel partial under either panel width (24, 48); 384: three groups of 128

WEIGHTS = {
    "int4-g128-sym": lambda w: int_weight(w, 4, 128, sym=True),
    "int4-g128-asym": lambda w: int_weight(w, 4, 128, sym=False),
    "int4-channel-asym": lambda w: int_weight(w, 4, -1, sym=False),
    "int4-g32-act-order-asym": lambda w: int_weight(w, 4, 32, sym=False, desc_act=True, seed=3),
    "int4-g128-act-order-sym": lambda w: int_weight(w, 4, 128, sym=True, desc_act=True, seed=4),
    "int8-g128-sym": lambda w: int_weight(w, 8, 128, sym=True),
    "int8-channel-asym": lambda w: int_weight(w, 8, -1, sym=False),
    "int8-g128-act-order-asym": lambda w: int_weight(w, 8, 128, sym=False, desc_act=True, seed=5),
    "fp8-block": lambda w: fp8_weight(w, "block"),
    "fp8-channel": lambda w: fp8_weight(w, "channel"),
    "fp8-tensor": lambda w: fp8_weight(w, "tensor"),
}


def weight(name: str, n: int = N, k: int = K):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return WEIGHTS[name](torch.randn(n, k, generator=g) * 0.05)


def float64_bound(x: torch.Tensor, w: torch.Tensor, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w^T + bias in float64, the float32 error bound of a K-long fma chain: gamma_K |x| @ |w|^T, plus the
    bias's rounding)."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T
    u = 2.0 ** -24
    k = x.shape[-1]
    bound = (k * u / (1 - k * u)) * (x64.abs() @ w64.abs().T) * 1.01
    if bias is not None:
        want = want + bias.double()
        bound = bound + u * (want.abs() + bias.double().abs())
    return want, bound + 1e-30


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_vs_float64_on_dequantised_weights(name, M, bias):
    qw = weight(name)
    assert takes(qw)
    packed = PackedQuantWeight(qw)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    y = packed(x, b)
    assert y.shape == (M, N) and y.dtype == torch.float32
    want, bound = float64_bound(x, dequantize(qw), b)
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_the_float_gemms_bits_whatever_the_batch(name):
    """One fma chain over k per element on w = (q - zero) * scale, as dequantize() computes it: the bits of loom's
    float32 GEMM over the dequantised weight (in the packed K order: act-order's permutation applied to both), and a
    row's result does not depend on the rows beside it (M = 1 straight over the packed bytes, M = 33 over panels)."""
    qw = weight(name)
    packed = PackedQuantWeight(qw)
    w = dequantize(qw)
    x = torch.randn(33, K, generator=torch.Generator().manual_seed(7))
    b = torch.randn(N, generator=torch.Generator().manual_seed(8))
    perm = packed.perm if packed.perm is not None else torch.arange(K)
    dense = PackedWeight(w[:, perm].contiguous(), b)
    y = packed(x, b)
    assert torch.equal(y, dense(x[:, perm].contiguous()))
    for m in (0, 4, 32):
        assert torch.equal(packed(x[m:m + 1], b), y[m:m + 1])


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_panels_hold_the_weight(name):
    qw = weight(name)
    assert torch.equal(PackedQuantWeight(qw).dequantize(), dequantize(qw))


def test_bfloat16_activations_and_leading_dims():
    qw = weight("int4-g128-asym")
    packed = PackedQuantWeight(qw)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(9))
    y = packed(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, N)
    assert torch.equal(y, packed(x.bfloat16().float()).bfloat16())


def test_dispatch_runs_the_kernel_and_the_reference():
    qw = weight("int8-g128-sym")
    packed = PackedQuantWeight(qw)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(10))
    assert torch.equal(dispatch.quant_linear(x, packed), packed(x))
    ref = quant_linear_ref(x, qw)
    assert torch.equal(dispatch.quant_linear(x, qw), ref)  # a QuantizedWeight not re-laid out: the reference
    want, bound = float64_bound(x, dequantize(qw), None)
    assert bool(((packed(x).double() - want).abs() <= bound).all())


@pytest.mark.parametrize("name", ["int8-g128-act-order-asym", "int4-g32-act-order-asym", "int4-g128-asym"])
def test_a_tensor_parallel_shard(name):
    """A rank's output rows and input columns (models/quant/shard.py): exactly its slice of the dequantised weight;
    the kernel (where it takes the shard: an act-order int4 shard's groups may have odd lengths on this rank) within
    float32's bound of it."""
    qw = weight(name)
    shard = take_rows(take_cols(qw, 128, 384), 40, 152)
    assert torch.equal(dequantize(shard), dequantize(qw)[40:152, 128:384])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    want, bound = float64_bound(x, dequantize(shard), None)
    y = PackedQuantWeight(shard)(x, None) if takes(shard) else dispatch.quant_linear(x, shard, None)
    assert bool(((y.double() - want).abs() <= bound).all())
    assert takes(shard) or name.startswith("int4-g32-act-order")


def test_odd_k_int4_is_not_taken():
    qw = int_weight(torch.randn(16, 63) * 0.05, 4, -1, sym=True)
    assert not takes(qw)
    with pytest.raises(ValueError):
        PackedQuantWeight(qw)


def test_fused_slices_concatenate_along_the_output_dim():
    """q|k|v slices as the loader fuses them (layers/quant_linear.concat_out): one weight whose dequantisation is
    the slices' stacked; per-tensor FP8 scales become per-row; differing groups or act-order are refused (None)."""
    from loom.layers.quant_linear import concat_out

    g = torch.Generator().manual_seed(11)
    ws = [torch.randn(n, K, generator=g) * 0.05 for n in (96, 48, 48)]
    for make in (lambda w: int_weight(w, 4, 128, sym=False), lambda w: int_weight(w, 8, -1, sym=True),
                 lambda w: fp8_weight(w, "tensor"), lambda w: fp8_weight(w, "block", (48, 128))):
        parts = [make(w) for w in ws]
        fused = concat_out(parts)
        assert fused is not None and fused.shape == (192, K)
        assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
        x = torch.randn(3, K, generator=g)
        want, bound = float64_bound(x, dequantize(fused), None)
        assert bool(((PackedQuantWeight(fused)(x).double() - want).abs() <= bound).all())
    assert concat_out([int_weight(ws[0], 4, 128), int_weight(ws[1], 4, 32)]) is None
    assert concat_out([int_weight(ws[0], 4, 32, desc_act=True, seed=1),
                       int_weight(ws[1], 4, 32, desc_act=True, seed=2)]) is None
