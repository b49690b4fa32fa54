"""The C++ CPU kernels on bfloat16 activations and KV caches (kernels/csrc: bfloat16 storage, float32 math, each result
rounded once), on every instruction-set build this host runs, against float64 math on the same bfloat16 inputs
(widening is exact), within bounds derived from bfloat16's rounding and float32's accumulation:

  |out - exact| <= U16 |exact| + c n U32 s,

U16 = 2^-8 (round to nearest, one rounding of the result), U32 = 2^-24, n the length of the float32 accumulation and
s the size of what it sums (sum of |terms|); c covers the few float32 operations per term (and the ~1 ulp exp)."""
import math

import pytest
import torch

import harness.kernel_cases as kcases
from loom.kernels import dispatch, policy
from loom.kernels.cpu_paged_attention import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    store_kv_cpu,
)
from loom.kernels.cpu_pointwise import (
    fused_add_rms_norm_cpu,
    gelu_tanh_and_mul_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
)
from loom.kernels.kv_layout import kv_cache_shape, read_slots

U16, U32 = 2.0 ** -8, 2.0 ** -24
BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("cpu_build")  # every test once per C++ build (conftest.py)


def within(out: torch.Tensor, exact: torch.Tensor, acc: torch.Tensor | float, what: str) -> None:
    """|out - exact| <= U16 |exact| + acc (acc: the float32 accumulation's share, per element or one bound)."""
    err = (out.double() - exact).abs()
    bound = U16 * exact.abs() + acc
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3g} (max error {err.max().item():.3g})"


def test_bf16_rounding_matches_torch():
    """The C++ float32 -> bfloat16 rounding (vector body and scalar tail) is torch's round to nearest even, bit for
    bit, also at ties, inf, NaN and subnormals: the norm of a row of ones by a float32 weight w is exactly w before
    its one rounding (mean of squares 1, eps 0)."""
    torch.manual_seed(0)
    x = (torch.randn(2040) * 3).float()
    ties = ((x.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)  # halfway between two bfloat16 values
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-39, 3.38e38])
    w = torch.cat((x, ties, special, torch.ones(4096 - 4088), torch.randn(3)))  # 4,099: a scalar tail too
    n = w.numel()
    out, _ = fused_add_rms_norm_cpu(torch.ones(1, n, dtype=BF16), None, w, 0.0)
    want = w.to(BF16).view(1, n)
    same = (out.view(torch.int16) == want.view(torch.int16)) | (out.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {n} roundings differ from torch's"


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("f32_weight", [False, True])
def test_rms_norm(residual, f32_weight):
    torch.manual_seed(0)
    T, N = 37, 576
    x = torch.randn(T, N).to(BF16)
    res = torch.randn(T, N).to(BF16) if residual else None
    w = (torch.rand(N) + 0.5)
    w = w if f32_weight else w.to(BF16)
    out, res_out = fused_add_rms_norm_cpu(x, res, w, 1e-6)
    s = x.double() + (res.double() if residual else 0)
    assert torch.equal(res_out, s.float().to(BF16) if residual else x)  # one rounding of an exact float32 sum
    r = res_out.double()  # the rounded sum, as the reference normalises it
    exact = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    # float32 sum of N squares (relative N U32), then sqrt / divide / two products: a few U32 more, relative
    within(out, exact, (N + 8) * U32 * exact.abs(), "rms_norm")
    assert dispatch.fused_add_rms_norm(x, res, w, 1e-6)[0].equal(out)  # dispatch takes bfloat16 to the C++ kernel


@pytest.mark.parametrize("rot", [64, 32])
def test_rotary(rot):
    torch.manual_seed(1)
    T, H, KVH, D = 11, 9, 3, 64
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(BF16)
    q = qkv[:, :H * D].view(T, H, D)[..., :rot]
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)[..., :rot]
    pos = torch.randint(0, 100, (T,), dtype=torch.int64)
    cs = kcases.cos_sin_cache(100, rot, "cpu")
    q0, k0 = q.double(), k.double()
    rotary_embedding_cpu(pos, q, k, cs)
    c, s = cs[pos].double()[:, None, :rot // 2], cs[pos].double()[:, None, rot // 2:]
    for name, before, after in (("q", q0, q), ("k", k0, k)):
        x1, x2 = before[..., :rot // 2], before[..., rot // 2:]
        exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        within(after, exact, 4 * U32 * (x1.abs() + x2.abs()).repeat(1, 1, 2), f"rotary {name}")
    assert torch.equal(qkv[:, (H + KVH) * D:], qkv[:, (H + KVH) * D:])  # v untouched (sanity)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("inter", [1536, 100])  # 100: vector body and scalar tail
def test_act_and_mul(gelu, inter):
    torch.manual_seed(2)
    x = (torch.randn(9, 2 * inter) * 3).to(BF16)
    out = (gelu_tanh_and_mul_cpu if gelu else silu_and_mul_cpu)(x)
    a, b = x[:, :inter].double(), x[:, inter:].double()
    act = torch.nn.functional.gelu(a, approximate="tanh") if gelu else torch.nn.functional.silu(a)
    exact = act * b
    # z (a few ops), exp (~1 ulp, Cephes), 1 + e, divide, two products: ~16 U32 relative to |a b|
    within(out, exact, 16 * U32 * (a * b).abs(), "gelu_tanh_and_mul" if gelu else "silu_and_mul")
    assert (dispatch.gelu_tanh_and_mul if gelu else dispatch.silu_and_mul)(x).equal(out)


def test_store_kv_exact():
    torch.manual_seed(3)
    T, KVH, D, bs = 10, 3, 64, 16
    qkv = torch.randn(T, 5 * KVH * D).to(BF16)
    k, v = qkv[:, :KVH * D].view(T, KVH, D), qkv[:, KVH * D:2 * KVH * D].view(T, KVH, D)
    kc, vc = (torch.zeros(kv_cache_shape(4, bs, KVH, D), dtype=BF16) for _ in range(2))
    slots = torch.randperm(4 * bs)[:T]
    slots[3] = -1
    store_kv_cpu(k, v, kc, vc, slots)
    keep = slots >= 0
    assert torch.equal(read_slots(kc, slots[keep]), k[keep])
    assert torch.equal(read_slots(vc, slots[keep]), v[keep])
    assert int((kc != 0).any(-1).sum()) == int(keep.sum()) * KVH


def attention_bound(q, kc, vc, exact, scale, lens, softcap):
    """U16 |exact| + the float32 share: scores (D products and sums, error ~D U32 |q||k| scale), which move the
    softmax weights by that much relative, and the weighted sum over L values (~L U32 max |v|)."""
    D = q.shape[-1]
    L = max(lens)
    qk = q.double().abs().sum(-1, keepdim=True) * kc.double().nan_to_num().abs().amax() * scale
    vmax = vc.double().nan_to_num().abs().amax()
    return 8 * (D * qk + L + 32) * U32 * vmax


OPTIONS = [(None, None), (5, None), (None, 2.0)]


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("group", [1, 3])
def test_decode_attention(window, softcap, group):
    torch.manual_seed(group)
    lens = [3, 16, 0, 41, 1, 70, 130]  # 130: two key tiles of the online softmax
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 2, 64, BF16, "cpu")
    q = torch.randn(len(lens), 2 * group, 64).to(BF16)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_cpu(q, kc, vc, bt, sl, 0.125, out=out, sliding_window=window, softcap=softcap)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context -> zeros
    keep = [i for i, n in enumerate(lens) if n]
    cu = torch.arange(len(keep) + 1, dtype=torch.int32)
    exact = kcases.naive_attention(q[keep], kc, vc, cu, sl[keep], bt[keep], 0.125, window, softcap)
    within(out[keep], exact, attention_bound(q[keep], kc, vc, exact, 0.125, lens, softcap), "decode attention")
    via = dispatch.paged_decode_attention(q, kc, vc, bt, sl, 0.125, sliding_window=window, softcap=softcap)
    assert torch.equal(via, out)  # dispatch runs the C++ kernel on a bfloat16 cache


@pytest.mark.parametrize("window,softcap", OPTIONS)
def test_prefill_attention(window, softcap):
    torch.manual_seed(7)
    q_and_lens = [(5, 5), (20, 37), (1, 9), (33, 33)]  # prompts, a chunk over a cached prefix, a decode-like row
    lens = [n for _, n in q_and_lens]
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 3, 64, BF16, "cpu")
    cu = torch.tensor([0] + list(itertools_accumulate([ql for ql, _ in q_and_lens])), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 9, 64).to(BF16)
    out = paged_prefill_attention_cpu(q, kc, vc, cu, sl, bt, 33, 0.125, sliding_window=window, softcap=softcap)
    exact = kcases.naive_attention(q, kc, vc, cu, sl, bt, 0.125, window, softcap)
    within(out, exact, attention_bound(q, kc, vc, exact, 0.125, lens, softcap), "prefill attention")


def test_decode_equals_prefill_bitwise():
    """A decode row and a one-row prefill chunk of the same sequence go through the same float32 arithmetic (the
    same key tiles, the same groups of query heads): the same bits."""
    torch.manual_seed(9)
    lens = [17, 64, 150]
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 3, 64, BF16, "cpu")
    q = torch.randn(len(lens), 9, 64).to(BF16)
    dec = paged_decode_attention_cpu(q, kc, vc, bt, sl, 0.125)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    pre = paged_prefill_attention_cpu(q, kc, vc, cu, sl, bt, 1, 0.125)
    assert torch.equal(dec, pre)


def test_policy_takes_bf16_on_cpu():
    """bfloat16 is a dtype of the C++ path (policy's dtype dimension); float16 stays on the references."""
    path = policy.decide("cpu", BF16)
    assert path.ops == policy.CPU
    # MoE experts go over packed bfloat16 panels exactly when loom's bfloat16 GEMM runs the dense layers (oneDNN's
    # prepacked weights have no experts form: fused_moe_ref's matmuls run them)
    assert path.packed_experts == (path.gemm == policy.GEMM_LOOM_BF16)
    assert path.layer_pass == (path.gemm == policy.GEMM_LOOM_BF16)  # the one-call layer needs loom's GEMM
    assert policy.decide("cpu", torch.float16).ops == policy.REFERENCE
    assert policy.decide("cpu", BF16, compiled=True).gemm == ""  # a compiled forward: inductor's own GEMMs
    assert "bfloat16" in path.describe(BF16)


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def test_bounds_are_not_vacuous():
    """The attention bound is a small fraction of the values it bounds (else the tests above would prove little)."""
    lens = [70]
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 2, 64, BF16, "cpu")
    q = torch.randn(1, 2, 64).to(BF16)
    exact = kcases.naive_attention(q, kc, vc, torch.tensor([0, 1], dtype=torch.int32), sl, bt, 0.125)
    bound = attention_bound(q, kc, vc, exact, 0.125, lens, None)
    worst = float(bound.max())
    assert math.isfinite(worst) and worst < 0.01 * float(vc.double().nan_to_num().abs().amax())


@pytest.mark.parametrize("num_tokens,ranks", [(30, [1, 8, 16, 4]), (6, [16] * 6)])
def test_lora_bf16(num_tokens, ranks):
    """Multi-LoRA on bfloat16 rows (kernels/cpu_lora.py lora_apply_cpu_bf16, which kernels/dispatch.py runs for them):
    y + scaling (x A^T) B against float64 on the same bfloat16 x, y and pools, one rounding of the result, the float32
    shrink over K and expand over R terms; rows without an adapter stay exactly as they were."""
    from loom.kernels import lora

    torch.manual_seed(4)
    meta, R, owner = kcases.make_lora_meta(num_tokens, ranks, "cpu")
    offs, K = [0, 24, 32, 300], 48
    x, y0 = torch.randn(num_tokens, K).to(BF16), torch.randn(num_tokens, offs[-1]).to(BF16)
    a, b = torch.randn(3, R, K).to(BF16), torch.randn(R, offs[-1]).to(BF16)
    got = dispatch.lora_apply(x, y0.clone(), a, b, offs, meta)
    exact, size = y0.double().clone(), y0.double().abs()
    for first, end, row, rank, scaling in lora.groups(meta):
        t = meta.token_indices[first:end]
        for s in range(3):
            c0, c1 = offs[s], offs[s + 1]
            coef = x[t].double() @ a[s, row:row + rank].double().T
            exact[t, c0:c1] += scaling * coef @ b[row:row + rank, c0:c1].double()
            size[t, c0:c1] += scaling * (x[t].double().abs() @ a[s, row:row + rank].double().abs().T) \
                @ b[row:row + rank, c0:c1].double().abs()
    within(got, exact, 2 * (K + max(ranks) + 4) * U32 * size, "lora bf16")
    untouched = owner == -1
    assert torch.equal(got[untouched], y0[untouched])


@pytest.mark.parametrize("num_tokens,ranks,pool", [(30, [1, 8, 16, 4], BF16), (7, [16, 3], torch.float32),
                                                   (32, [16] * 32, BF16)])
def test_lora_bf16_is_the_widened_float32_pass(num_tokens, ranks, pool):
    """The bfloat16 pass (kernels/csrc/lora.cpp run_pass_bf16: the Python layers' and the bfloat16 C++ layer's LoRA)
    widens only the adapter tokens' rows: bitwise what widening all of x and y, the float32 pass and rounding y back
    give, for adapters of several ranks (rank 1 to 16; slices of 16-wide parts and tails), padded pool rows, a strided
    y and tokens without an adapter."""
    from loom.kernels.cpu_lora import lora_apply_cpu, lora_apply_cpu_bf16

    torch.manual_seed(5)
    meta, R, _ = kcases.make_lora_meta(num_tokens, ranks, "cpu")
    offs, K = [0, 40, 56, 131], 72
    x = torch.randn(num_tokens, K).to(BF16)
    y0 = torch.randn(num_tokens, offs[-1] + 9).to(BF16)[:, :offs[-1]]  # rows 140 apart
    a = torch.randn(3, R, K + 8).to(pool)[:, :, :K]  # pool rows padded, as kernels/cpu_lora.py pool_row makes them
    b = torch.randn(R, offs[-1] + 16).to(pool)[:, :offs[-1]]
    got = lora_apply_cpu_bf16(x, y0.clone(), a, b, offs, meta)
    y32 = y0.float()
    want = lora_apply_cpu(x.float(), y32, a, b, offs, meta).to(BF16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# (tokens, ranks) for kernel_cases.make_lora_meta (scattered tokens), or (runs, ranks) for contiguous_lora_meta
# (prefill chunks: a group of 300 tokens has its A rows packed, gemm.cpp's PACK_MIN_TOKENS); fuse_min
GEMM_BF16_LORA_CASES = [
    ((9, [1, 8, 16, 4]), BF16, 16), ((5, [16, 3]), torch.float32, 16), ((32, [16] * 32), BF16, 16),  # decode
    ((9, [1, 8, 16, 4]), BF16, 2), ((200, [16, 4, 8]), BF16, 16), ((200, [16, 5]), torch.float32, 16),
    (([(0, 40), (-1, 5), (1, 3), (2, 300), (-1, 2), (3, 1), (0, 7)], [16, 8, 12, 4]), BF16, 16),
    (([(1, 9), (0, 301), (2, 17)], [3, 16, 8]), torch.float32, 16),
]


@pytest.mark.parametrize("case,pool,fuse_min", GEMM_BF16_LORA_CASES)
def test_gemm_bf16_lora_is_the_gemm_then_the_pass(cpu_build, case, pool, fuse_min):
    """loom's bfloat16 GEMM with the adapter tokens' LoRA (the C++ layer's linears): groups all under fuse_min tokens
    with their pass items interleaved with its panels, each token's delta added to its output row after; else the
    groups of at least fuse_min tokens with their deltas added to each output tile (their A rows packed from 256
    tokens on) and the others' pass after; where the CPU lacks avx512_bf16 the GEMM's plain loop, then the pass.
    Bitwise the GEMM, then the bfloat16 pass on its output, over slices with 16-wide parts and tails, panels across
    slice boundaries, a bias, padded pool rows, ranks 1 to 16, 16-bit and float32 pools and tokens without an
    adapter."""
    from loom.kernels import cpu_ext
    from loom.kernels.cpu_lora import group_arrays, lora_apply_cpu_bf16, offsets_tensor

    torch.manual_seed(6)
    if isinstance(case[0], int):
        meta, R, _ = kcases.make_lora_meta(*case, "cpu")
        num_tokens = case[0]
    else:
        meta, R, _ = kcases.contiguous_lora_meta(*case)
        num_tokens = sum(n for _, n in case[0])
    offs, K = [0, 40, 56, 131], 71
    N, nr = offs[-1], cpu_build.loom_gemm_bf16_panel_width()
    x, w, bias = torch.randn(num_tokens, K).to(BF16), torch.randn(N, K).to(BF16), torch.randn(N)
    panels = torch.empty(-(-N // nr) * nr * (-(-K // 2) * 2), dtype=BF16)
    cpu_build.loom_gemm_bf16_pack(w.data_ptr(), N, K, panels.data_ptr())
    a = torch.randn(3, R, K + 9).to(pool)[:, :, :K]
    b = torch.randn(R, N + 16).to(pool)[:, :N]
    want = torch.empty(num_tokens, N, dtype=BF16)
    cpu_build.loom_gemm_bf16(x.data_ptr(), K, num_tokens, K, panels.data_ptr(), N, bias.data_ptr(), want.data_ptr(), N,
                             0, cpu_ext.nthreads())
    lora_apply_cpu_bf16(x, want, a, b, offs, meta)
    got = torch.empty(num_tokens, N, dtype=BF16)
    o = offsets_tensor(tuple(offs))
    tok, seg, rows, rk, scal = group_arrays(meta)
    cpu_build.loom_gemm_bf16_lora(x.data_ptr(), K, num_tokens, K, panels.data_ptr(), N, bias.data_ptr(),
                                  got.data_ptr(), N, a.data_ptr(), cpu_ext.ADAPTER_TYPES[pool], 3, R, a.stride(1),
                                  b.data_ptr(), b.stride(0), o.data_ptr(), tok.data_ptr(), seg.data_ptr(),
                                  rows.data_ptr(), rk.data_ptr(), scal.data_ptr(), meta.num_groups, fuse_min,
                                  cpu_ext.nthreads())
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
