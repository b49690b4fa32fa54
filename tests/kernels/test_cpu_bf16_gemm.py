"""loom's bfloat16 GEMM (kernels/csrc/gemm_bf16.cpp: VDPBF16PS over panels packed once, float32 accumulation, one
rounding of each output) on every instruction-set build this host runs, against float64 math on the same bfloat16
inputs (their products are exact in float32 and float64), within

  |out - exact| <= U16 |exact| + 2 (K + 1) U32 (sum_k |x_k w_k| + |b|)

U16 = 2^-8 (the output's one rounding to bfloat16; 0 for float32 output), U32 = 2^-24: K float32 additions of exact
products and the bias, the output rounding applied to a sum already that far off (the factor 2 covers both). The
kernel runs only where the CPU has avx512_bf16 (the policy asks the same flags); elsewhere these tests skip saying so
and the engine takes oneDNN's GEMM."""
import pytest
import torch

from loom.kernels import cpu_ext, policy
from loom.kernels.cpu_linear import PackedBf16, loom_bf16_gemm

U16, U32 = 2.0 ** -8, 2.0 ** -24
BF16 = torch.bfloat16


@pytest.fixture
def needs_bf16(cpu_build):  # once per C++ build (conftest.py)
    if not loom_bf16_gemm(cpu_build):
        pytest.skip("loom's bfloat16 GEMM needs avx512_bf16 (and avx512f/bw/vl), which this CPU lacks: "
                    f"{sorted({'avx512f', 'avx512bw', 'avx512vl', 'avx512_bf16'} - cpu_ext.cpu_flags())}")


def oracle(x, w, b):
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    size = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return exact, size


@pytest.mark.usefixtures("needs_bf16")
@pytest.mark.parametrize("out_f32", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (13, 100, 77), (32, 576, 1536), (9, 50, 1), (3, 48, 2)])
def test_gemm_bf16_vs_float64(M, N, K, out_f32):
    """Row counts of every register tile (1-8 and more), N past a panel's 48 columns, odd K (the pair's tail)."""
    torch.manual_seed(M * 1000 + K)
    w, x, b = torch.randn(N, K).to(BF16), (torch.randn(M, K) * 3).to(BF16), torch.randn(N)
    for bias in (None, b):
        y = PackedBf16(w, bias, out_f32=out_f32)(x)
        assert y.dtype == (torch.float32 if out_f32 else BF16) and y.shape == (M, N)
        exact, size = oracle(x, w, bias)
        bound = (0 if out_f32 else U16) * exact.abs() + 2 * (K + 1) * U32 * size
        worst = ((y.double() - exact).abs() - bound).max().item()
        assert worst <= 0, f"M={M} N={N} K={K} bias={bias is not None}: error exceeds its bound by {worst:.3g}"


@pytest.mark.usefixtures("needs_bf16")
def test_gemm_bf16_rows_and_threads_do_not_change_bits():
    """Each output is one chain over k in order, whatever the row tile or the thread's share of panels: a row alone,
    in a batch of 13, on one thread or two, gives the same bits; leading dims are flattened."""
    torch.manual_seed(5)
    w, x = torch.randn(200, 300).to(BF16), torch.randn(13, 300).to(BF16)
    g = PackedBf16(w, torch.randn(200))
    whole = g(x)
    rows = torch.cat([g(x[i:i + 1]) for i in range(13)])
    assert torch.equal(whole, rows)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if n > 1 else 2)
        assert torch.equal(g(x), whole)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(g(x.view(13, 1, 300)).view(13, 200), whole)
    assert g(x[:0]).shape == (0, 200)


@pytest.mark.usefixtures("needs_bf16")
def test_gemm_bf16_same_bits_in_every_build():
    """The kernel is one target-attributed function compiled into each build: the AVX-512, AVX2 and plain-loop
    libraries give the same bits (what lets an engine on any of them match)."""
    torch.manual_seed(6)
    w, x = torch.randn(100, 77).to(BF16), torch.randn(9, 77).to(BF16)
    outs = []
    for name, flags in [(name, f) for name, _, f in cpu_ext.ISAS if not cpu_ext.missing_flags(name)] + [("none", ())]:
        lib = cpu_ext.build(flags)
        assert lib is not None, f"the {name} build failed"
        panels = torch.empty(-(-100 // 48) * 48 * 78, dtype=BF16)
        lib.loom_gemm_bf16_pack(w.data_ptr(), 100, 77, panels.data_ptr())
        y = torch.empty(9, 100, dtype=BF16)
        lib.loom_gemm_bf16(x.data_ptr(), 77, 9, 77, panels.data_ptr(), 100, None, y.data_ptr(), 100, 0, 1)
        outs.append(y)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_policy_picks_the_bf16_gemm(monkeypatch):
    """avx512_bf16 without AMX: loom's GEMM; LOOM_BF16_GEMM=onednn (where oneDNN takes bfloat16) picks oneDNN's."""
    monkeypatch.setattr(policy, "_bf16_gemms", lambda: (True, True))
    assert policy.decide("cpu", BF16).gemm == policy.GEMM_LOOM_BF16
    assert "VDPBF16PS" in policy.decide("cpu", BF16).describe(BF16)
    monkeypatch.setenv("LOOM_BF16_GEMM", "onednn")
    assert policy.decide("cpu", BF16).gemm == policy.GEMM_ONEDNN
    monkeypatch.setattr(policy, "_bf16_gemms", lambda: (False, True))
    monkeypatch.delenv("LOOM_BF16_GEMM")
    assert policy.decide("cpu", BF16).gemm == policy.GEMM_ONEDNN
    assert policy.decide("cpu", BF16, compiled=True).gemm == ""
    assert policy.decide("cpu", torch.float32).gemm == policy.GEMM_LOOM


@pytest.mark.usefixtures("needs_bf16")
@pytest.mark.parametrize("T,K", [(1, 2), (7, 2), (33, 3)])
def test_moe_experts_bf16_round_where_the_reference_rounds(T, K):
    """kernels/cpu_moe.PackedExpertsBf16 (one C++ call): fused_moe_ref's loop - gather an expert's tokens, gate|up,
    SiLU-and-mul, down, each rounded to bfloat16, weighted sums in float32 in pair order - with the GEMMs on loom's
    bfloat16 kernel (checked against float64 above). The same loop written here in PyTorch around PackedBf16 must give
    the same bits: experts without tokens, a token routed twice to one expert, one token or many."""
    from loom.kernels.cpu_moe import PackedExpertsBf16
    from loom.kernels.moe import _silu_mul

    torch.manual_seed(T * 10 + K)
    E, H, I = 6, 80, 56
    w13, w2 = (torch.randn(E, 2 * I, H) / 8).to(BF16), (torch.randn(E, H, I) / 8).to(BF16)
    x = torch.randn(T, H).to(BF16)
    ids = torch.randint(0, E - 1, (T, K))  # expert E-1 gets no token
    ids[0, 1] = ids[0, 0]  # the first token twice on one expert
    w = torch.rand(T, K)
    moe = PackedExpertsBf16(w13, w2)
    got = moe(x, w, ids)
    want = torch.zeros(T, H)
    for e in range(E):
        pairs = (ids.reshape(-1) == e).nonzero().flatten()  # increasing pair order, as the reference's stable sort
        if pairs.numel():
            h = _silu_mul(moe.gate_up[e](x[pairs // K]), I)
            want.index_add_(0, pairs // K, moe.down[e](h).float() * w.reshape(-1)[pairs, None])
    assert got.dtype == BF16 and torch.equal(got, want.to(BF16))
