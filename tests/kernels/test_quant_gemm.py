"""The quantized GEMM kernels (loom.kernels.quant_gemm: W4A16 / W8A16 / FP8 weight-only; loom.kernels.fp8_gemm: FP8
W8A8) against their references, on QuantizedWeight inputs built by harness.quant_checkpoints' packers (GPTQ packing
read by loom's GPTQ reader; fine-grained FP8 packing): on CPU under the Triton interpreter in float32, float16 and
bfloat16 (the last with the GPU's bf16 numerics patched in, harness.interpreter_bf16); with LOOM_TEST_DEVICE=cuda
compiled on the GPU.

Under the interpreter the float32 -> float8e4nv cast is patched too (`gpu_fp8_casts`): triton 3.6's interpreter
rounds it wrong (its mantissa round-up does not carry into the exponent, so 124.3 becomes 64 instead of 128, and
ties round up instead of to even), where the GPU's cvt.rn.satfinite rounds to nearest even and saturates. The
interpreter's fp8 -> float casts and its fp8 dot (exact products, float32 sums) are right and left alone.
"""
import contextlib
import dataclasses

import numpy as np
import pytest
import torch

import harness.kernel_cases as kcases
from harness.interpreter_bf16 import gpu_bf16, interpreting
from harness.quant_checkpoints import fp8_weight, int_weight
from harness.suite_device import DEVICE, kernel_dtypes
from loom.kernels.fp8_gemm import (
    FP8_MAX,
    check_w8a8,
    fp8_gemm_ref,
    fp8_gemm_triton,
    quantize_activation_fp8_ref,
    quantize_activation_fp8_triton,
)
from loom.kernels.quant_gemm import quant_gemm_ref, quant_gemm_triton
from loom.models.quant.shard import take_cols, take_rows
from loom.models.quant.weight import QuantizedWeight

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning


@contextlib.contextmanager
def gpu_fp8_casts():
    """Within the block (interpreter only), a cast to float8e4nv rounds as the GPU does: to nearest even, saturating
    at +-448 (torch's float8_e4m3fn cast of the clamped value). Other casts go to the interpreter unchanged."""
    if not interpreting():
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    orig = InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16):
            return orig(self, src, dst_type, rounding_mode)
        x = torch.from_numpy(np.asarray(src.data, dtype=np.float32)).clamp(-FP8_MAX, FP8_MAX)
        return TensorHandle(x.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)

    InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    try:
        yield
    finally:
        InterpreterBuilder.create_fp_to_fp = orig


@contextlib.contextmanager
def gpu_numerics(dtype):
    with gpu_bf16(dtype == torch.bfloat16), gpu_fp8_casts():
        yield


def needs_fp8_tensor_cores():
    """W8A8 runs under the interpreter and on GPUs of capability 8.9+; skip it on older GPUs (it is refused there)."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 W8A8 needs compute capability 8.9+ (refused below; test_w8a8_refusal)")


def on_device(qw):
    return dataclasses.replace(qw, **{f.name: getattr(qw, f.name).to(DEVICE) for f in dataclasses.fields(qw)
                                      if isinstance(getattr(qw, f.name), torch.Tensor)})


def float_weight(N, K):
    """A random weight whose input columns differ in magnitude (log-uniform over 1/8 .. 8, as activation-outlier
    channels make them): scale groups then differ, so a kernel reading the wrong group (act-order) fails."""
    return torch.randn(N, K) * torch.exp2(torch.rand(K) * 6 - 3) * K ** -0.5


def per_tensor(qw):
    """A symmetric per-channel integer weight with one scale for every row instead (compressed-tensors' tensor
    strategy): scale [1, 1]."""
    assert qw.zero is None and qw.scale.shape[1] == 1
    return dataclasses.replace(qw, scale=qw.scale.float().amax().reshape(1, 1))


# ---------------------------------------------------------------------------------------------
# cases: (M, N, K) with K not a multiple of the K tile (the table's 128 / 64 / 32), N not one of the N tile

INT_CASES = [
    dict(M=1, N=72, K=296, bits=4, group_size=128, sym=True, bias=True),  # decode, groups constant per K tile
    dict(M=5, N=72, K=296, bits=4, group_size=128, sym=False, desc_act=True),  # act-order: per-column gather
    dict(M=33, N=136, K=296, bits=8, group_size=-1, sym=False, bias=True),  # prefill tile, per channel
    dict(M=5, N=40, K=300, bits=4, group_size=-1, sym=True),  # K not a multiple of 8: a part-filled last word
    dict(M=33, N=72, K=296, bits=8, group_size=32, sym=True),  # groups narrower than the K tile: gathered
    dict(M=33, N=72, K=296, bits=8, group_size=128, sym=False, desc_act=True, tiles=(16, 32, 32)),  # 3 M tiles
    dict(M=5, N=72, K=296, bits=8, group_size=-1, sym=True, tensor=True),  # one scale for the whole weight
]
FP8_CASES = [
    dict(M=1, N=200, K=296, granularity="block", bias=True),  # part-filled 128 x 128 blocks in both dims
    dict(M=5, N=200, K=296, granularity="block", tiles=(16, 32, 32)),  # 4 K tiles per 128-column block
    dict(M=33, N=72, K=296, granularity="channel", bias=True),
    dict(M=5, N=72, K=298, granularity="tensor"),  # rows of 298 bytes: no int32 view, one uint8 a weight
    dict(M=33, N=136, K=256, granularity="block", block=(64, 128)),
]


def _params(cases):
    seed = 0
    for i, case in enumerate(cases):
        for dt in kernel_dtypes():
            seed += 1
            yield pytest.param(case, dt, seed, id=f"{i}-{str(dt).split('.')[-1]}-seed{seed}")


def _inputs(M, K, N, dtype, bias, seed):
    torch.manual_seed(seed)
    x = kcases.rnd(M, K, dtype=dtype, device=DEVICE)
    b = kcases.rnd(N, dtype=dtype, device=DEVICE, scale=0.1) if bias else None
    out = kcases.poison(M, N, dtype=dtype, device=DEVICE)  # an unwritten element stays NaN
    return x, b, out


@pytest.mark.parametrize("case,dtype,seed", list(_params(INT_CASES)))
def test_int_gemm(case, dtype, seed):
    c = dict(case)
    M, N, K, tiles = c.pop("M"), c.pop("N"), c.pop("K"), c.pop("tiles", None)
    bias, tensor = c.pop("bias", False), c.pop("tensor", False)
    x, b, out = _inputs(M, K, N, dtype, bias, seed)
    qw = int_weight(float_weight(N, K), seed=seed, **c)
    qw = on_device(per_tensor(qw) if tensor else qw)
    with gpu_numerics(dtype):
        quant_gemm_triton(x, qw, b, out=out, tiles=tiles)
    ref = quant_gemm_ref(x, qw, b, out_dtype=torch.float32)
    kcases.assert_close(out.float(), ref, dtype, f"quant_gemm {case}")


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: str(d).split(".")[-1])
def test_int_gemm_on_a_tensor_parallel_shard_of_an_act_order_weight(dtype):
    """A rank's output rows and input columns of an act-order weight (models/quant/shard.py): its columns' own g_idx
    entries over every group's scales, some groups not read at all, some partly."""
    qw = int_weight(float_weight(72, 296), bits=4, group_size=32, sym=False, desc_act=True, seed=9)
    qw = on_device(take_rows(take_cols(qw, 96, 296), 8, 72))
    x, b, out = _inputs(5, 200, 64, dtype, True, 9)
    with gpu_numerics(dtype):
        quant_gemm_triton(x, qw, b, out=out)
    ref = quant_gemm_ref(x, qw, b, out_dtype=torch.float32)
    kcases.assert_close(out.float(), ref, dtype, "quant_gemm on a shard")


@pytest.mark.parametrize("w8a8", [False, True], ids=["a16", "w8a8"])
@pytest.mark.parametrize("case,dtype,seed", list(_params(FP8_CASES)))
def test_fp8_gemm(case, dtype, seed, w8a8):
    if w8a8:
        needs_fp8_tensor_cores()
    c = dict(case)
    M, N, K, tiles, bias = c.pop("M"), c.pop("N"), c.pop("K"), c.pop("tiles", None), c.pop("bias", False)
    x, b, out = _inputs(M, K, N, dtype, bias, seed)
    qw = on_device(fp8_weight(float_weight(N, K), **c))
    with gpu_numerics(dtype):
        fp8_gemm_triton(x, qw, b, out=out, w8a8=w8a8, tiles=tiles)
    ref = fp8_gemm_ref(x, qw, b, out_dtype=torch.float32, w8a8=w8a8)
    kcases.assert_close(out.float(), ref, dtype, f"fp8_gemm w8a8={w8a8} {case}")


def test_fp8_w8a8_is_not_weight_only():
    """The two FP8 references differ by the activations' quantisation (~2**-4 relative per element): the W8A8
    comparisons above could not pass against the weight-only reference, nor the reverse."""
    torch.manual_seed(0)
    x, qw = torch.randn(5, 296), fp8_weight(float_weight(72, 296), "channel")
    err = kcases.rel_err(fp8_gemm_ref(x, qw, out_dtype=torch.float32),
                         fp8_gemm_ref(x, qw, out_dtype=torch.float32, w8a8=False))
    assert 2 ** -8 < err < 2 ** -3, err


# ---------------------------------------------------------------------------------------------
# the activation quantisation, bit for bit


def _ties(K, dtype):
    """A row whose amax is 448 (scale exactly 1), holding values on e4m3 rounding ties and edges, each exactly
    representable in float16 and bfloat16, with what round-to-nearest-even must make of them."""
    pairs = [(448.0, 448.0), (1.0625, 1.0), (1.1875, 1.25), (124.0, 128.0), (125.0, 128.0), (-1.0625, -1.0),
             (-3.25, -3.25), (2.0 ** -10, 0.0), (3 * 2.0 ** -10, 2.0 ** -8), (5 * 2.0 ** -10, 2.0 ** -8),
             (2.0 ** -9, 2.0 ** -9), (0.0, 0.0), (-240.0, -240.0), (232.0, 224.0), (248.0, 256.0)]
    x, want = torch.zeros(K), torch.full((K,), float("nan"))
    x[:len(pairs)] = torch.tensor([a for a, _ in pairs])
    want[:len(pairs)] = torch.tensor([b for _, b in pairs])
    return x.to(dtype), want


@pytest.mark.parametrize("group", [None, 128], ids=["per_token", "group128"])
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: str(d).split(".")[-1])
def test_activation_quant_exact(dtype, group):
    torch.manual_seed(7)
    K = 296  # a part-filled last group of 40 columns
    ties, want = _ties(K, dtype)
    x = torch.cat([ties[None], torch.zeros(1, K, dtype=dtype),  # a zero row: the EPS floor, no 0 / 0
                   (torch.randn(6, K) * torch.exp2(torch.rand(6, 1) * 20 - 10)).to(dtype)]).to(DEVICE)
    with gpu_numerics(dtype):
        q, s = quantize_activation_fp8_triton(x, group)
    q_ref, s_ref = quantize_activation_fp8_ref(x, group)
    assert torch.equal(s, s_ref), (s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), \
        f"{int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())} of {q.numel()} fp8 values differ"
    # the reference itself: the tie row's scale is 1 and its values round to nearest even ...
    assert s[0, 0] == 1.0
    known = ~torch.isnan(want)
    assert torch.equal(q[0].float().cpu()[known], want[known])
    assert torch.equal(q[1].float(), torch.zeros(K, device=DEVICE))
    # ... and every value is within half an e4m3 step of x / scale (2**-4 relative; 2**-10 absolute below 2**-6)
    g = group or K
    xs = x.float() / s.repeat_interleave(g, 1)[:, :K]
    assert xs.abs().max() <= FP8_MAX * (1 + 2 ** -20)
    assert ((q.float() - xs).abs() <= torch.maximum(xs.abs() * 2 ** -4, torch.full_like(xs, 2 ** -10))).all()


# ---------------------------------------------------------------------------------------------
# the refusal below sm_89


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 7)])
def test_w8a8_refusal(capability):
    with pytest.raises(ValueError, match=rf"8\.9 or newer.*sm_{capability[0]}{capability[1]}"):
        check_w8a8(capability)
    qw = fp8_weight(torch.randn(64, 128), "channel")
    with pytest.raises(ValueError, match="weight-only FP8 path"):
        fp8_gemm_triton(torch.randn(2, 128), qw, capability=capability)


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_w8a8_allowed(capability):
    check_w8a8(capability)  # returns: no exception


def test_fp8_gemm_refuses_other_weights():
    qw = int_weight(torch.randn(64, 128), bits=8, group_size=-1)
    with pytest.raises(ValueError, match="FP8 weights"):
        fp8_gemm_triton(torch.randn(2, 128), qw, w8a8=False)


def test_fp8_weight_decode_exact():
    """Every finite e4m3 code (subnormals, zeros, +-448) decodes exactly in the weight-only path (integer
    arithmetic, no float8 type): x = I (float32, so the product is exact) makes y the dequantised weight's transpose."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]  # 0x7f, 0xff: NaN, never a weight
    K = 256
    weight = torch.zeros(16, K, dtype=torch.uint8)
    weight[:, :len(codes)] = codes.roll(1)  # every code in every row, the row's columns shifted by its index below
    weight = torch.stack([r.roll(i) for i, r in enumerate(weight)]).view(torch.float8_e4m3fn)
    qw = on_device(QuantizedWeight(shape=(16, K), kind="fp8", bits=8, weight=weight, scale=torch.ones(1, 1)))
    y = quant_gemm_triton(torch.eye(K, device=DEVICE), qw)
    assert torch.equal(y.t().cpu(), weight.float())
