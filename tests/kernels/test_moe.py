"""kernels/moe.py: the reference against a float64 per-token loop, the Triton launcher (interpreter) against the
reference in float32 / float16 / bfloat16 (bf16 with the interpreter's bf16 dot and casts patched to the GPU's
numerics: harness.interpreter_bf16), and the align step's invariants."""
import pytest
import torch
import torch.nn.functional as F

import harness.kernel_cases as kcases
from harness.interpreter_bf16 import gpu_bf16
from harness.kernel_cases import assert_close
from loom.kernels import dispatch
from loom.kernels.moe import _block_sizes, fused_moe_lora_ref, fused_moe_ref, fused_moe_triton, moe_align

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (id, T, E, K, H, I, routing, extra); H/I deliberately not multiples of the 64-wide blocks
CASES = [
    ("top1", 37, 8, 1, 96, 80, "random", {}),
    ("top2", 37, 8, 2, 96, 80, "random", {}),
    ("top8-E8", 20, 8, 8, 96, 80, "random", {"block_m": 32}),
    ("top8-E64", 11, 64, 8, 40, 24, "random", {}),  # 88 pairs over ~50 experts, most tiles nearly empty
    ("decode-T1-E64", 1, 64, 2, 96, 80, "random", {}),
    ("T0", 0, 8, 2, 96, 80, "random", {}),
    ("empty-experts", 37, 8, 2, 96, 80, "skip", {}),  # experts 2 and 5 get nothing
    ("one-expert", 37, 8, 1, 96, 80, "one", {}),  # 37 pairs over 3 tiles of one expert
    ("one-expert-dup-k2", 19, 8, 2, 96, 80, "one", {}),  # both k slots of every token on the same expert
    ("uneven", 37, 8, 2, 96, 80, "skewed", {}),
    ("E1", 9, 1, 1, 96, 80, "random", {}),
    ("small-HI", 13, 4, 2, 40, 24, "random", {}),  # BLOCK_N 32 for I, H below one K block
    ("block_m64", 37, 8, 2, 96, 80, "skewed", {"block_m": 64}),
]


def make_routing(T, E, K, kind, gen):
    if kind == "one":
        ids = torch.full((T, K), E - 2 if E > 1 else 0, dtype=torch.long)
    else:
        logits = torch.rand(T, E, generator=gen)
        if kind == "skip":
            logits[:, [2, 5]] = -1.0
        elif kind == "skewed":  # expert 0 takes almost everything, a few others a little
            logits += torch.linspace(3.0, 0.0, E)
        ids = logits.topk(K, dim=1).indices
    weights = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    return weights, ids


def make_inputs(T, E, K, H, I, kind, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype)
    weights, ids = make_routing(T, E, K, kind, gen)
    ids = ids.to(torch.int32 if seed % 2 else torch.int64)  # both index dtypes
    return x, w13, w2, weights, ids


def naive(x, w13, w2, weights, ids):
    """float64, every (token, k) with its own gathered expert weights: no sorting, no grouping."""
    I = w2.shape[2]
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        e = ids[:, k].long()
        gu = torch.einsum("tnh,th->tn", w13[e], x)
        out += weights[:, k, None] * torch.einsum("thi,ti->th", w2[e], F.silu(gu[:, :I]) * gu[:, I:])
    return out


def _params():
    for i, (name, T, E, K, H, I, kind, extra) in enumerate(CASES):
        for dt in DTYPES:
            yield pytest.param(T, E, K, H, I, kind, extra, dt, 1000 + 3 * i + DTYPES.index(dt),
                               id=f"{name}-{str(dt).split('.')[-1]}")


@pytest.mark.parametrize("T,E,K,H,I,kind,extra,dtype,seed", list(_params()))
def test_ref_vs_naive(T, E, K, H, I, kind, extra, dtype, seed):
    x, w13, w2, tw, ids = make_inputs(T, E, K, H, I, kind, dtype, seed)
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    assert ref.dtype == dtype and ref.shape == (T, H)
    if T:
        assert_close(ref.float(), naive(x, w13, w2, tw, ids).float(), dtype, "ref vs naive")


@pytest.mark.parametrize("T,E,K,H,I,kind,extra,dtype,seed", list(_params()))
def test_triton_vs_ref(T, E, K, H, I, kind, extra, dtype, seed, monkeypatch):
    x, w13, w2, tw, ids = make_inputs(T, E, K, H, I, kind, dtype, seed)
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    # poison every float scratch buffer the launcher allocates, and the output
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    with gpu_bf16(dtype == torch.bfloat16):
        res = fused_moe_triton(x, w13, w2, tw, ids, out=out, **extra)
    monkeypatch.undo()
    assert res.data_ptr() == out.data_ptr()
    if T == 0:
        assert out.shape == (0, H)
        assert fused_moe_triton(x, w13, w2, tw, ids).shape == (0, H)
        return
    assert_close(out.float(), ref.float(), dtype, "triton vs ref")


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_packed_experts_vs_ref(case, monkeypatch):
    """The CPU experts over packed weights (kernels/cpu_moe.py) against the reference in float32, every routing case
    (tokens on one expert, experts with none, no tokens, strided routing ids); the same bits on 1, 2 and 3 threads,
    and into one arena as the engine packs them."""
    from loom.kernels import cpu_ext
    from loom.kernels.cpu_moe import PackedExperts

    name, T, E, K, H, I, kind, _ = next(c for c in CASES if c[0] == case)
    x, w13, w2, tw, ids = make_inputs(T, E, K, H, I, kind, torch.float32, 7)
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    arena = torch.full((PackedExperts.numel(w13.shape, w2.shape) + 5,), float("nan"))
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_ext, "nthreads", lambda threads=threads: threads)
        runs += [PackedExperts(w13, w2)(x, tw, ids), PackedExperts(w13, w2, out=arena)(x, tw, ids)]
    assert runs[0].shape == (T, H) and runs[0].dtype == torch.float32
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    if T:
        assert_close(runs[0], ref, torch.float32, "packed experts vs ref")


@pytest.mark.parametrize("T,E,K,H,I,kind", [(400, 4, 2, 200, 80, "random"), (400, 8, 2, 200, 80, "one"),
                                             (6000, 2, 1, 384, 80, "random")])
def test_packed_experts_large_batches(T, E, K, H, I, kind, monkeypatch):
    """Prefill-sized batches: an expert's rows gathered and added in parallel (both k slots of a token on one expert
    included), and x above the GEMM's row-block threshold: the same bits on 1, 2 and 3 threads, the reference's
    result."""
    from loom.kernels import cpu_ext
    from loom.kernels.cpu_moe import PackedExperts

    x, w13, w2, tw, ids = make_inputs(T, E, K, H, I, kind, torch.float32, 8)
    experts = PackedExperts(w13, w2)
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_ext, "nthreads", lambda threads=threads: threads)
        runs.append(experts(x, tw, ids))
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    assert_close(runs[0], fused_moe_ref(x, w13, w2, tw, ids), torch.float32, "packed experts vs ref")


@pytest.mark.parametrize("kind,E,K,block_m", [("random", 64, 8, 16), ("skip", 8, 2, 32), ("one", 8, 1, 16),
                                              ("skewed", 8, 2, 64), ("random", 1, 1, 16)])
def test_align(kind, E, K, block_m):
    T = 37
    _, ids = make_routing(T, E, K, kind, torch.Generator().manual_seed(7))
    P = T * K
    sorted_ids, bexp = moe_align(ids.to(torch.int32), E, block_m)
    assert sorted_ids.numel() == bexp.numel() * block_m
    real = sorted_ids[sorted_ids < P]
    assert torch.equal(real.sort().values, torch.arange(P, dtype=torch.int32))  # every pair exactly once
    assert (sorted_ids[sorted_ids >= P] == P).all()
    flat = ids.reshape(-1).long()
    used = bexp >= 0
    assert used.sum() == ((torch.bincount(flat, minlength=E) + block_m - 1) // block_m).sum()
    assert (bexp[used].diff() >= 0).all() and not used[used.sum():].any()  # tiles in expert order, then -1
    for b in range(int(used.sum())):
        tile = sorted_ids[b * block_m:(b + 1) * block_m]
        tile = tile[tile < P].long()
        assert tile.numel() > 0 and (flat[tile] == bexp[b]).all()
    assert (sorted_ids[int(used.sum()) * block_m:] == P).all()


def test_block_sizes():
    assert _block_sizes(2, 64, 4096, 1408)[0] == 16  # decode
    assert _block_sizes(8192 * 8, 64, 4096, 1408)[0] == 64  # prefill
    assert _block_sizes(10, 8, 40, 24)[1:3] == (32, 64)


@pytest.mark.parametrize("kind,K", [("random", 2), ("skip", 1), ("one", 2)])
def test_lora_ref_vs_naive(kind, K):
    """fused_moe_lora_ref against a float64 per-(token, k) loop: gate, up and down of each routed expert get
    scaling * (x A^T) B for the token's adapter; tokens without an adapter get exactly fused_moe_ref's result."""
    T, E, H, I = 29, 8, 40, 24
    x, w13, w2, tw, ids = make_inputs(T, E, K, H, I, kind, torch.float32, 5)
    meta, R, owner = kcases.make_lora_meta(T, [1, 4, 3], "cpu")
    g = torch.Generator().manual_seed(3)
    a13, b13 = torch.randn(E, 2, R, H, generator=g) / H ** 0.5, torch.randn(E, R, 2 * I, generator=g)
    a2, b2 = torch.randn(E, 1, R, I, generator=g) / I ** 0.5, torch.randn(E, R, H, generator=g)
    out = fused_moe_lora_ref(x, w13, w2, tw, ids, (a13, b13, a2, b2), meta)
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        grp = int(owner[t])
        for k in range(K):
            e = int(ids[t, k])
            gu = w13d[e] @ xd[t]
            if grp >= 0:
                r0, rk, s = meta.row_start_cpu[grp], meta.ranks_cpu[grp], meta.scalings_cpu[grp]
                for si in range(2):
                    d = (a13[e, si, r0:r0 + rk].double() @ xd[t]) @ b13[e, r0:r0 + rk, si * I:(si + 1) * I].double()
                    gu[si * I:(si + 1) * I] += s * d
            h = F.silu(gu[:I]) * gu[I:]
            y = w2d[e] @ h
            if grp >= 0:
                y += s * ((a2[e, 0, r0:r0 + rk].double() @ h) @ b2[e, r0:r0 + rk].double())
            want[t] += float(tw[t, k]) * y
    assert_close(out, want.float(), torch.float32, "fused_moe_lora_ref vs naive")
    plain = (owner < 0).nonzero().squeeze(1)
    assert plain.numel() > 0
    assert torch.equal(out[plain], fused_moe_ref(x, w13, w2, tw, ids)[plain])


def test_dispatch_picks_triton_when_forced(monkeypatch):
    x, w13, w2, tw, ids = make_inputs(9, 4, 2, 40, 24, "random", torch.float32, 3)
    calls = []
    monkeypatch.setattr(dispatch, "fused_moe_triton", lambda *a, **k: calls.append("triton") or fused_moe_ref(*a))
    monkeypatch.delenv("LOOM_FORCE_TRITON", raising=False)
    dispatch.fused_moe(x, w13, w2, tw, ids)
    assert calls == []
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    dispatch.fused_moe(x, w13, w2, tw, ids)
    assert calls == ["triton"]
