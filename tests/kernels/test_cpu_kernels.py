"""The C++ CPU kernels (kernels/cpu_ext.py) against float64 naive loops and the PyTorch references: paged
attention reading the cache in place (decode, prefill over cached prefixes, sliding window, softcap) and
multi-LoRA over adapter rows in place, the GEMM over packed weights, the pointwise kernels."""
import pytest
import torch

import harness.kernel_cases as kcases
from loom.kernels import cpu_ext, dispatch, lora
from loom.kernels.cpu_paged_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu
from loom.kernels.kv_layout import kv_cache_shape
from loom.kernels.paged_decode_attention import paged_decode_attention_ref
from loom.kernels.paged_prefill_attention import paged_prefill_attention_ref

pytestmark = pytest.mark.usefixtures("cpu_build")  # every test once per C++ build (conftest.py)


def forget_before_window(kc, vc, bt, seq_lens, window, block_size):
    """Blocks wholly before every query's window may hold anything: make them NaN."""
    for s, n in enumerate(seq_lens.tolist()):
        first_needed = max(0, n - window) if window else 0  # decode: the query sits at n - 1
        for b in range(first_needed // block_size):
            kc[bt[s, b]] = float("nan")
            vc[bt[s, b]] = float("nan")


OPTIONS = [(None, None), (5, None), (None, 2.0), (20, 1.5)]


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("group", [1, 3])
def test_decode_vs_naive(window, softcap, group):
    torch.manual_seed(group)
    lens = [3, 16, 0, 41, 1, 70]
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 2, 32, torch.float32, "cpu")
    forget_before_window(kc, vc, bt, sl, window, 16)
    q = torch.randn(len(lens), 2 * group, 32)
    out = kcases.poison(*q.shape, dtype=torch.float32, device="cpu")
    paged_decode_attention_cpu(q, kc, vc, bt, sl, 0.2, out=out, sliding_window=window, softcap=softcap)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context -> zeros
    keep = [i for i, n in enumerate(lens) if n]
    cu = torch.arange(len(keep) + 1, dtype=torch.int32)
    want = kcases.naive_attention(q[keep], kc, vc, cu, sl[keep], bt[keep], 0.2, window, softcap)
    assert kcases.rel_err(out[keep], want) < 1e-6


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_vs_naive(window, softcap, group):
    # whole prompts, extends over cached prefixes, single-token rows, a query tile boundary (16) crossed
    torch.manual_seed(10 + group)
    lens = [(1, 5), (6, 6), (4, 21), (1, 1), (19, 30), (35, 35)]
    q, kc, vc, cu, sl, bt, max_q = kcases.prefill_inputs(lens, 2 * group, 2, 32, 8, torch.float32, "cpu")
    out = kcases.poison(*q.shape, dtype=torch.float32, device="cpu")
    paged_prefill_attention_cpu(q, kc, vc, cu, sl, bt, max_q, 0.3, out=out, sliding_window=window, softcap=softcap)
    assert kcases.rel_err(out, kcases.naive_attention(q, kc, vc, cu, sl, bt, 0.3, window, softcap)) < 1e-6


def test_same_as_references_on_a_model_sized_batch():
    """SmolLM2's shapes (9 heads over 3, D 64, blocks of 16): the in-place kernels against the gathering
    references, decode and a mixed prefill batch, out= into strided views as the attention layer passes them."""
    torch.manual_seed(0)
    lens = [int(x) for x in torch.randint(1, 300, (32,))]
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 3, 64, torch.float32, "cpu")
    q = torch.randn(32, 9, 64)
    big = torch.full((40, 9, 64), float("nan"))
    out = paged_decode_attention_cpu(q, kc, vc, bt, sl, 0.125, out=big[4:36])
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125)
    assert torch.isnan(big[:4]).all() and torch.isnan(big[36:]).all()
    assert kcases.rel_err(out, ref) < 1e-6
    pairs = [(min(n, int(torch.randint(1, 40, ()))), n) for n in lens]
    q, kc, vc, cu, sl, bt, max_q = kcases.prefill_inputs(pairs, 9, 3, 64, 16, torch.float32, "cpu")
    got = paged_prefill_attention_cpu(q, kc, vc, cu, sl, bt, max_q, 0.125)
    assert kcases.rel_err(got, paged_prefill_attention_ref(q, kc, vc, cu, sl, bt, max_q, 0.125)) < 1e-6


def test_store_kv_vs_reference():
    from loom.kernels.cpu_paged_attention import store_kv_cpu
    from loom.kernels.kv_store import store_kv_ref

    torch.manual_seed(4)
    T, kvh, d = 10, 3, 16
    qkv = torch.randn(T, (2 + 2 * kvh) * d)  # k/v as strided views of a fused output, as the layers pass them
    k, v = qkv[:, 2 * d:(2 + kvh) * d].view(T, kvh, d), qkv[:, (2 + kvh) * d:].view(T, kvh, d)
    slots = torch.randperm(4 * 8)[:T]
    slots[torch.randperm(T)[:3]] = -1
    caches = [torch.full(kv_cache_shape(4, 8, kvh, d), float("nan")) for _ in range(4)]
    store_kv_cpu(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))


def test_other_dtypes_use_the_reference():
    torch.manual_seed(1)
    kc, vc, bt, sl = kcases.make_paged_cache([5, 9], 8, 1, 16, torch.float64, "cpu")
    q = torch.randn(2, 2, 16, dtype=torch.float64)
    got = dispatch.paged_decode_attention(q, kc, vc, bt, sl, 0.25)
    assert torch.equal(got, paged_decode_attention_ref(q, kc, vc, bt, sl, 0.25))


def test_dispatch_picks_the_in_place_kernels_on_cpu(monkeypatch):
    # the two differ in the last bits (summation order), which tells which one ran
    monkeypatch.delenv("LOOM_FORCE_TRITON", raising=False)
    torch.manual_seed(2)
    kc, vc, bt, sl = kcases.make_paged_cache([37, 90, 5], 16, 3, 64, torch.float32, "cpu")
    q = torch.randn(3, 9, 64)
    cpp = paged_decode_attention_cpu(q, kc, vc, bt, sl, 0.125)
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125)
    assert not torch.equal(cpp, ref)
    assert torch.equal(dispatch.paged_decode_attention(q, kc, vc, bt, sl, 0.125), cpp)
    monkeypatch.setenv("LOOM_CPU_KERNELS", "0")
    assert torch.equal(dispatch.paged_decode_attention(q, kc, vc, bt, sl, 0.125), ref)


# ---- LoRA -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_tokens,ranks", [(30, [1, 8, 16, 64, 4, 16]),  # decode-like: a few tokens per group
                                               (70, [16, 3]),  # prefill-like: groups of many tiles and a partial one
                                               (6, [16] * 6)])  # one token per adapter
def test_lora_cpu_vs_reference(threads, num_tokens, ranks, monkeypatch):
    """The one-pass C++ LoRA (tiles of a group's tokens, rank rows read in place, slices of several widths)
    equals the reference's shrink then expand, and leaves tokens without an adapter untouched."""
    from loom.kernels import cpu_lora

    monkeypatch.setattr(lora, "_DENSE_MAX_TOKEN_ROWS", 0)  # the reference's plain group loop
    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    torch.manual_seed(0)
    meta, R, owner = kcases.make_lora_meta(num_tokens, ranks, "cpu")
    offs = [0, 24, 32, 300]  # the last slice is wider than one column chunk
    x, a, b = torch.randn(num_tokens, 48), torch.randn(3, R, 48), torch.randn(R, 300)
    y0 = torch.randn(num_tokens, 300)
    want = lora.lora_expand_ref(lora.lora_shrink_ref(x, a, meta), b, offs, meta, y0.clone())
    got = cpu_lora.lora_apply_cpu(x, y0.clone(), a, b, offs, meta)
    assert kcases.rel_err(got - y0, want - y0) < 1e-5
    untouched = owner == -1  # tokens without an adapter keep y exactly
    assert torch.equal(got[untouched], y0[untouched])
    # rows of x and y that are views into wider tensors (strided rows)
    xw, yw = torch.randn(num_tokens, 64), torch.randn(num_tokens, 320)
    xw[:, :48] = x
    yw[:, :300] = y0
    cpu_lora.lora_apply_cpu(xw[:, :48], yw[:, :300], a, b, offs, meta)
    assert kcases.rel_err(yw[:, :300] - y0, want - y0) < 1e-5


@pytest.mark.parametrize("threads", [1, 2, 3])  # decode groups interleaved with the panels on each thread
@pytest.mark.parametrize("fuse_min", [None, 1])  # None: the default split; 1: every group in the GEMM's tiles
@pytest.mark.parametrize("case", ["prefill chunks", "scattered tokens", "decode", "decode, wide"])
def test_gemm_with_lora_is_gemm_then_lora(threads, fuse_min, case, monkeypatch):
    """The packed GEMM that adds the LoRA deltas to its output tiles gives bitwise the GEMM followed by the one-pass
    LoRA kernel (so also the references' result), for groups of consecutive tokens (whole and partial row tiles,
    tokens without an adapter between them), for scattered tokens and for one token per adapter (decode: tiles of
    one token), slices of widths that are no multiple of the GEMM's panel (24 or 48 columns) or of 16, ranks that
    are no multiple of 4, with a bias. "decode, wide": panels enough that the GEMM's tiles fetch some adapters' rows
    ahead and their tokens' deltas are computed between panels, the rest after them."""
    from loom.kernels import cpu_lora
    from loom.kernels.cpu_linear import PackedWeight

    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    if fuse_min is not None:
        monkeypatch.setattr(cpu_lora, "FUSE_MIN_TOKENS", fuse_min)
    torch.manual_seed(5)
    if case == "prefill chunks":
        runs = [(0, 37), (-1, 3), (1, 20), (2, 2), (1, 1), (3, 260)]  # 260: a group whose A rows are packed
        meta, R, owner = kcases.contiguous_lora_meta(runs, [16, 5, 8, 64])
    elif case == "decode":
        meta, R, owner = kcases.contiguous_lora_meta([(2, 1), (0, 1), (-1, 1), (3, 1), (1, 1)], [16, 5, 8, 64])
    elif case == "decode, wide":
        order = [5, 2, 0, -1, 7, 3, 1, 9, 4, -1, 8, 6]
        meta, R, owner = kcases.contiguous_lora_meta([(g, 1) for g in order], [16, 5, 8, 3, 1, 7, 12, 4, 9, 2])
    else:
        meta, R, owner = kcases.make_lora_meta(90, [16, 5, 8, 64], "cpu")
    T, K, offs = len(owner), 40, [0, 48, 61, 61 + 130]
    if case == "decode, wide":
        K, offs = 263, [0, 517, 650, 650 + 709]
    w, bias = torch.randn(offs[-1], K), torch.randn(offs[-1])
    pw = PackedWeight(w, bias)
    x, a, b = torch.randn(T, K), torch.randn(3, R, K), torch.randn(R, offs[-1])
    got = pw.with_lora(x, a, b, offs, meta)
    want = cpu_lora.lora_apply_cpu(x, pw(x), a, b, offs, meta)
    assert torch.equal(got, want)
    assert torch.equal(pw.with_lora(x.view(1, T, K), a, b, offs, meta), got.view(1, T, -1))  # [batch, tokens, K]
    ref = lora.lora_expand_ref(lora.lora_shrink_ref(x, a, meta), b, offs, meta, torch.nn.functional.linear(x, w, bias))
    assert kcases.rel_err(got, ref) < 1e-5
    assert torch.equal(got[owner == -1], pw(x)[owner == -1])


@pytest.mark.parametrize("rank", [13, 64])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_lora_delta_does_not_depend_on_its_tile(rank, pool_dtype, monkeypatch):
    """Tokens on one adapter give bitwise the same outputs whether they form one group (tiles of many tokens, or the
    GEMM's output tiles) or each is a group of its own (decode tiles of one token, which run other register blocks):
    a request's result does not depend on what else is in the batch."""
    from loom.kernels import cpu_lora
    from loom.kernels.cpu_linear import PackedWeight
    from loom.layers.forward_context import LoraBatchMeta

    monkeypatch.setattr(cpu_ext, "nthreads", lambda: 1)
    torch.manual_seed(3)
    T, K, offs = 260, 43, [0, 48, 61, 61 + 130]  # one group of 260: its A rows packed for the shrink

    def meta(groups: int) -> LoraBatchMeta:
        per = T // groups
        return LoraBatchMeta(token_indices=torch.arange(T), seg_starts=torch.arange(0, T + 1, per, dtype=torch.int32),
                             row_start=torch.full((groups,), 2, dtype=torch.int32),
                             ranks=torch.full((groups,), rank, dtype=torch.int32), scalings=torch.full((groups,), 0.7),
                             max_rank=rank, max_seg_len=per)

    x, y0 = torch.randn(T, K), torch.randn(T, offs[-1])
    a, b = torch.randn(3, rank + 4, K).to(pool_dtype), torch.randn(rank + 4, offs[-1]).to(pool_dtype)
    one, each = meta(1), meta(T)
    got = cpu_lora.lora_apply_cpu(x, y0.clone(), a, b, offs, one)
    assert torch.equal(got, cpu_lora.lora_apply_cpu(x, y0.clone(), a, b, offs, each))
    pw = PackedWeight(torch.randn(offs[-1], K))
    assert torch.equal(pw.with_lora(x, a, b, offs, one), pw.with_lora(x, a, b, offs, each))  # fused / pass


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", ["prefill chunks", "decode"])
def test_16_bit_pools_give_the_bits_of_their_float32_values(pool_dtype, threads, case, monkeypatch):
    """Adapter pools kept in 16 bits (lora_dtype) are widened where the kernels read them: the one-pass LoRA, the
    GEMM with the LoRA in its tiles or beside it, and the references give bitwise what float32 pools holding the same
    values give (widening is exact). K and slice widths leave tails past every vector width; values include float16
    subnormals."""
    from loom.kernels import cpu_lora
    from loom.kernels.cpu_linear import PackedWeight

    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    torch.manual_seed(7)
    runs = [(0, 37), (-1, 3), (1, 20), (2, 2), (3, 260)] if case == "prefill chunks" else \
        [(2, 1), (0, 1), (-1, 1), (3, 1), (1, 1)]
    meta, R, owner = kcases.contiguous_lora_meta(runs, [16, 5, 8, 64])
    T, K, offs = len(owner), 43, [0, 48, 61, 61 + 130]
    x = torch.randn(T, K)
    a16, b16 = torch.randn(3, R, K).to(pool_dtype), torch.randn(R, offs[-1]).to(pool_dtype)
    a16.view(-1)[:7] = torch.tensor([1e-7, -3e-6, 5e-5, 0.0, -0.0, 6e-8, 65504.0]).to(pool_dtype)
    a32, b32 = a16.float(), b16.float()
    assert torch.equal(a32.to(pool_dtype), a16)
    y0 = torch.randn(T, offs[-1])
    got = cpu_lora.lora_apply_cpu(x, y0.clone(), a16, b16, offs, meta)
    assert torch.equal(got, cpu_lora.lora_apply_cpu(x, y0.clone(), a32, b32, offs, meta))
    assert not torch.equal(got, y0)
    pw = PackedWeight(torch.randn(offs[-1], K), torch.randn(offs[-1]))
    for fuse_min in (1, cpu_lora.FUSE_MIN_TOKENS):
        monkeypatch.setattr(cpu_lora, "FUSE_MIN_TOKENS", fuse_min)
        assert torch.equal(pw.with_lora(x, a16, b16, offs, meta), pw.with_lora(x, a32, b32, offs, meta))
    ref16 = lora.lora_expand_ref(lora.lora_shrink_ref(x, a16, meta), b16, offs, meta, y0.clone())
    assert torch.equal(ref16, lora.lora_expand_ref(lora.lora_shrink_ref(x, a32, meta), b32, offs, meta, y0.clone()))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", ["prefill chunks", "decode, wide"])
def test_pools_in_padded_rows_give_the_contiguous_pools_bits(pool_dtype, threads, case, monkeypatch):
    """Pools whose rows are longer than K and N (a CPU LoraPool's pool_row padding; the padding holds NaN, so a read
    of it would show) give bitwise what contiguous pools of the same values give: the one-pass LoRA, and the GEMM
    with the deltas in its tiles (A rows packed, B rows widened) or its pass beside it."""
    from loom.kernels import cpu_lora
    from loom.kernels.cpu_linear import PackedWeight

    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    torch.manual_seed(11)
    if case == "prefill chunks":
        meta, R, owner = kcases.contiguous_lora_meta([(0, 37), (-1, 3), (1, 20), (3, 260)], [16, 5, 8, 64])
        K, offs = 43, [0, 48, 61, 61 + 130]
    else:
        order = [5, 2, 0, -1, 7, 3, 1, 9, 4, -1, 8, 6]
        meta, R, owner = kcases.contiguous_lora_meta([(g, 1) for g in order], [16, 5, 8, 3, 1, 7, 12, 4, 9, 2])
        K, offs = 263, [0, 517, 650, 650 + 709]
    T, N = len(owner), offs[-1]
    a, b = torch.randn(3, R, K).to(pool_dtype), torch.randn(R, N).to(pool_dtype)
    a_wide = torch.full((3, R, K + 16), float("nan"), dtype=pool_dtype)
    b_wide = torch.full((R, N + 32), float("nan"), dtype=pool_dtype)
    a_wide[..., :K], b_wide[:, :N] = a, b
    ap, bp = a_wide[..., :K], b_wide[:, :N]
    assert cpu_ext.adapter_type(ap, bp) is not None and not ap.is_contiguous() and not bp.is_contiguous()
    x, y0 = torch.randn(T, K), torch.randn(T, N)
    got = cpu_lora.lora_apply_cpu(x, y0.clone(), ap, bp, offs, meta)
    assert torch.equal(got, cpu_lora.lora_apply_cpu(x, y0.clone(), a, b, offs, meta)) and not got.isnan().any()
    pw = PackedWeight(torch.randn(N, K), torch.randn(N))
    for fuse_min in (1, cpu_lora.FUSE_MIN_TOKENS):
        monkeypatch.setattr(cpu_lora, "FUSE_MIN_TOKENS", fuse_min)
        assert torch.equal(pw.with_lora(x, ap, bp, offs, meta), pw.with_lora(x, a, b, offs, meta))


def test_pool_rows_do_not_share_l1_sets():
    """CPU pool rows of any whole number of cache lines are stored so that 16 rank rows (what the kernels read
    together) start in 16 different L1 sets (64 sets of 64-byte lines), at most one line longer."""
    from loom.kernels.cpu_lora import pool_row

    for dtype in (torch.float32, torch.bfloat16):
        line = 64 // torch.empty((), dtype=dtype).element_size()
        for n in range(line, 512 * line + 1, line):  # up to 32 KiB rows: hidden sizes, 4 x 8,192 MLPs
            stride = pool_row(n, dtype)
            assert stride - n in (0, line), (dtype, n)
            assert len({r * stride // line % 64 for r in range(16)}) == 16, (dtype, n, stride)


@pytest.mark.parametrize("scal_dtype", [torch.float32, torch.float64])  # float64: the kernel needs a converted copy
def test_lora_cpu_meta_updated_in_place(scal_dtype):
    """A meta reused across steps with its tensors rewritten in place (the CUDA-graph path's static meta) gives
    each call the current groups: what the kernel keeps of a meta is never a stale copy."""
    from loom.kernels import cpu_lora

    torch.manual_seed(1)
    meta, R, _ = kcases.make_lora_meta(20, [4, 16, 8], "cpu")
    meta.scalings = meta.scalings.to(scal_dtype)
    offs = [0, 40]
    x, a, b, y0 = torch.randn(20, 32), torch.randn(1, R, 32), torch.randn(R, 40), torch.randn(20, 40)
    for scale in (1.0, 3.0):
        meta.scalings.copy_(torch.tensor(meta.scalings_cpu) * scale)
        meta.scalings_cpu = meta.scalings.tolist()
        want = lora.lora_expand_ref(lora.lora_shrink_ref(x, a, meta), b, offs, meta, y0.clone())
        got = cpu_lora.lora_apply_cpu(x, y0.clone(), a, b, offs, meta)
        assert kcases.rel_err(got - y0, want - y0) < 1e-5, scale


# ---- GEMM over packed weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
def test_packed_gemm_vs_linear(threads):
    from loom.kernels.cpu_linear import PackedWeight, linear_packed

    torch.manual_seed(3)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k, bias in [(50, 7, True), (24, 64, False), (97, 130, True), (5, 3, False)]:
            w, b = torch.randn(n, k), torch.randn(n) if bias else None
            pw = PackedWeight(w, b)
            for m in (0, 1, 3, 4, 5, 33):  # row tiles of 4 and every remainder
                wide = torch.randn(m, k + 5)
                x = wide[:, 2:2 + k]  # rows with a stride larger than K
                got = pw(x)
                assert got.shape == (m, n)
                if m:
                    assert kcases.rel_err(got, torch.nn.functional.linear(x, w, b)) < 1e-6
            x3 = torch.randn(2, 3, k)
            assert torch.equal(linear_packed(x3, pw.panels, pw.bias, n), pw(x3.reshape(6, k)).view(2, 3, n))
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_gemm_row_blocks_give_the_same_bits(threads, monkeypatch):
    """A long prefill chunk's GEMM takes x in row blocks (kernels/cpu_linear.row_block): with and without LoRA
    deltas in its tiles, any block size (a multiple of the 4-row tile or not, a last block shorter than the others)
    gives bitwise the result of one block, and an x above the size where blocks start is really split (unless its
    rows are so long that a block would hold only a few). A group too small to fuse takes the pass: beside the one
    block's panels, after a blocked GEMM."""
    from loom.kernels import cpu_linear, cpu_lora
    from loom.kernels.cpu_linear import PackedWeight

    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    torch.manual_seed(4)
    K, offs = 576, [0, 48, 61, 61 + 30]
    T = cpu_linear.BLOCK_ABOVE_BYTES // (4 * K) + 37
    assert 0 < cpu_linear.row_block(T, K) < T and cpu_linear.row_block(T - 40, K) == 0
    assert cpu_linear.row_block(1 << 16, 2048) == 0  # blocks of a few rows would re-read the weights too often
    meta, R, owner = kcases.contiguous_lora_meta([(0, T - 707), (-1, 3), (2, 7), (1, 697)], [16, 5, 8])
    w, bias = torch.randn(offs[-1], K), torch.randn(offs[-1])
    pw = PackedWeight(w, bias)
    x, a, b = torch.randn(T, K), torch.randn(3, R, K), torch.randn(R, offs[-1])
    blocked = pw(x), pw.with_lora(x, a, b, offs, meta)
    for rows in (0, 8, 5, 100):  # 0: one block; 5 is taken as 4
        for module in (cpu_linear, cpu_lora):  # the GEMM's and the LoRA GEMM's
            monkeypatch.setattr(module, "row_block", lambda m, k, rows=rows: rows)
        assert torch.equal(pw(x), blocked[0]), rows
        assert torch.equal(pw.with_lora(x, a, b, offs, meta), blocked[1]), rows
    assert kcases.rel_err(blocked[0], torch.nn.functional.linear(x, w, bias)) < 1e-5


def test_packed_weight_in_a_given_buffer():
    from loom.kernels.cpu_linear import PackedWeight

    torch.manual_seed(4)
    w, b = torch.randn(97, 130), torch.randn(97)
    n = PackedWeight.panels_numel(97, 130)
    buf = torch.full((n + 40,), float("nan"))
    own, inside = PackedWeight(w, b), PackedWeight(w, b, out=buf[16:16 + n + 3])
    assert inside.panels.data_ptr() == buf[16:].data_ptr() and inside.panels.numel() == n
    assert torch.equal(inside.panels, own.panels) and buf[:16].isnan().all() and buf[16 + n:].isnan().all()
    x = torch.randn(9, 130)
    assert torch.equal(inside(x), own(x))
    for bad in (buf[:n - 1], buf[:n].double(), torch.empty(2, n)[:, :n // 2 + 1]):  # short, not float32, strided
        with pytest.raises(ValueError, match="out must be"):
            PackedWeight(w, b, out=bad)


# ---- large buffers on huge pages ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_empty_on_huge_pages(dtype, monkeypatch):
    from loom.kernels import cpu_memory

    advised = []
    real = cpu_memory._madvise()
    monkeypatch.setattr(cpu_memory, "_madvise", lambda: lambda addr, n, how: advised.append((addr, n, how)) or 0)
    hp = cpu_memory.HUGE_PAGE
    shape = (3, hp // 16 + 5, 4)  # spans a few huge pages and ends inside one
    t = cpu_memory.empty_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % hp == 0
    nbytes = t.numel() * t.element_size()
    # the whole 2 MiB pages of the buffer, nothing outside it, advised before anything was written
    assert advised == [(t.data_ptr(), nbytes // hp * hp, 14)]
    t.fill_(7)
    assert (t == 7).all()
    advised.clear()
    small = cpu_memory.empty_on_huge_pages((5, 7), dtype)  # under one huge page: plain memory, no advice
    assert small.shape == (5, 7) and not advised
    # no madvise to call (not Linux) or one that refuses: ordinary memory, same tensor
    for fn in (lambda: None, lambda: lambda addr, n, how: -1):
        monkeypatch.setattr(cpu_memory, "_madvise", fn)
        u = cpu_memory.empty_on_huge_pages(shape, dtype).zero_()
        assert u.shape == shape and not u.any()
    if real is not None:  # the real libc call goes through (whether the kernel takes the hint is its THP mode's say)
        monkeypatch.setattr(cpu_memory, "_madvise", lambda: real)
        raw = torch.empty(3 * hp, dtype=torch.uint8)
        assert cpu_memory.advise_huge_pages(raw.data_ptr(), raw.numel()) in (True, False)


def test_large_zeros_on_the_cpu_are_zeros_on_huge_page_boundaries():
    from loom.kernels import cpu_memory

    t = cpu_memory.large_zeros((3, cpu_memory.HUGE_PAGE // 8), torch.float32, torch.device("cpu"))
    assert t.shape == (3, cpu_memory.HUGE_PAGE // 8) and t.data_ptr() % cpu_memory.HUGE_PAGE == 0 and not t.any()


# ---- pointwise ------------------------------------------------------------------------------------------

def test_pointwise_vs_references():
    from loom.kernels import activation, norm, rotary
    from loom.kernels.cpu_pointwise import (
        fused_add_rms_norm_cpu,
        gelu_tanh_and_mul_cpu,
        rotary_embedding_cpu,
        silu_and_mul_cpu,
    )

    torch.manual_seed(5)
    x, r, w = torch.randn(7, 96), torch.randn(7, 96), torch.rand(96) + 0.5
    for res in (None, r):
        got, want = fused_add_rms_norm_cpu(x, res, w, 1e-6), norm.fused_add_rms_norm_ref(x, res, w, 1e-6)
        assert torch.equal(got[1], want[1]) and kcases.rel_err(got[0], want[0]) < 1e-6
    cs = kcases.cos_sin_cache(100, 16, "cpu")
    pos = torch.randint(0, 100, (9,))
    qkv = torch.randn(9, 16 * (6 + 2 + 2))  # q and k as strided views of a fused output
    q, k = qkv[:, :96].view(9, 6, 16), qkv[:, 96:128].view(9, 2, 16)
    q2, k2, v = q.clone(), k.clone(), qkv[:, 128:].clone()
    rotary_embedding_cpu(pos, q, k, cs)
    rotary.rotary_embedding_ref(pos, q2, k2, cs)
    assert kcases.rel_err(q, q2) < 1e-6 and kcases.rel_err(k, k2) < 1e-6
    assert torch.equal(qkv[:, 128:], v)  # v untouched (it shares the storage)
    for t in (torch.randn(5, 2 * 37) * 4, torch.randn(3, 2 * 64 + 8)[:, :128] * 30):
        assert kcases.rel_err(silu_and_mul_cpu(t), activation.silu_and_mul_ref(t)) < 1e-6
        assert kcases.rel_err(gelu_tanh_and_mul_cpu(t), activation.gelu_tanh_and_mul_ref(t)) < 1e-6
    # element by element over GELU's whole range (large negative inputs: exp's clamp; near zero: the cubic); the
    # reference's 0.5 x (1 + tanh(u)) cancels to 0 below about -5 where x sigmoid(2u) keeps ~1e-7: atol
    v = torch.cat([torch.linspace(-40, 40, 4001), torch.linspace(-1e-3, 1e-3, 101)])
    t = torch.stack([v, torch.ones_like(v)], 1).reshape(1, -1)
    t = torch.cat([t[:, 0::2], t[:, 1::2]], 1)  # [1, 2I]: gate values, then ones
    torch.testing.assert_close(gelu_tanh_and_mul_cpu(t), activation.gelu_tanh_and_mul_ref(t), rtol=2e-6, atol=1e-6)


def test_pointwise_rows_in_parallel_give_the_same_bits(monkeypatch):
    """A prefill chunk's rows (past the kernels' parallel threshold) go through the pointwise kernels on several
    threads: the same bits as on one thread, the references' results, and strided rows handled."""
    from loom.kernels import activation, norm, rotary
    from loom.kernels.cpu_pointwise import (
        fused_add_rms_norm_cpu,
        gelu_tanh_and_mul_cpu,
        rotary_embedding_cpu,
        silu_and_mul_cpu,
    )

    torch.manual_seed(7)
    T = 1100  # x T rows of 96 and 160 floats, 2 x 37: above 1 << 16 elements for the norm, rotary and activations
    x, r, w = torch.randn(T, 96), torch.randn(T, 96), torch.rand(96) + 0.5
    cs, pos = kcases.cos_sin_cache(2000, 16, "cpu"), torch.randint(0, 2000, (T,))
    qkv = torch.randn(T, 16 * 12)
    gate_up = torch.randn(T, 2 * 64 + 8)[:, :128] * 30
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu_ext, "nthreads", lambda threads=threads: threads)
        q, k = qkv.clone()[:, :128].view(T, 8, 16), qkv.clone()[:, 128:].view(T, 4, 16)
        rotary_embedding_cpu(pos, q, k, cs)
        runs.append([*fused_add_rms_norm_cpu(x, r, w, 1e-6), q, k, silu_and_mul_cpu(gate_up),
                     gelu_tanh_and_mul_cpu(gate_up)])
    for got in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, runs[0]))
    out, res = norm.fused_add_rms_norm_ref(x, r, w, 1e-6)
    q2, k2 = qkv.clone()[:, :128].view(T, 8, 16), qkv.clone()[:, 128:].view(T, 4, 16)
    rotary.rotary_embedding_ref(pos, q2, k2, cs)
    want = [out, res, q2, k2, activation.silu_and_mul_ref(gate_up), activation.gelu_tanh_and_mul_ref(gate_up)]
    assert torch.equal(runs[0][1], want[1])
    assert all(kcases.rel_err(a, b) < 1e-6 for a, b in zip(runs[0], want))


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_is_torch_argmax(threads, monkeypatch):
    """Greedy sampling's C++ argmax gives torch.argmax's index for every row: ties (the first), a maximum in the
    vector part or in the tail of a row whose length is no multiple of 8, NaNs (torch counts a NaN as the largest:
    the first NaN), rows of -inf, +inf, rows that are views into wider tensors, and rows enough to run in parallel."""
    from loom.kernels.cpu_argmax import argmax_cpu

    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    torch.manual_seed(11)
    for V in (1, 7, 8, 37, 1000):
        x = torch.randn(40, V + 5)[:, :V]  # strided rows
        x[1] = 3.0  # all equal: index 0
        x[2, V // 2:] = 9.0  # a tie from the middle on: its first index
        x[3, V - 1] = 50.0  # in the tail
        x[4] = float("-inf")
        x[5, -1] = float("inf")
        x[6, V // 3] = float("nan")
        x[7, :] = float("nan")
        if V > 2:
            x[8, 1], x[8, V - 1] = float("nan"), float("nan")
            x[9, 0], x[9, 2] = float("inf"), float("nan")
        assert torch.equal(argmax_cpu(x), x.argmax(dim=-1)), V
    big = torch.randn(64, 49152)  # past the parallel threshold
    big[10, 777] = big[10, 40000] = 100.0
    assert torch.equal(argmax_cpu(big), big.argmax(dim=-1))
    assert argmax_cpu(big[:0]).shape == (0,)
    assert torch.equal(dispatch.argmax(big.double()), big.double().argmax(dim=-1))  # other dtypes: torch's
