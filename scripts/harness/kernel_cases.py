"""Shared kernel test cases: build fresh random inputs, run a Triton kernel and its reference, compare.

Used by the pytest files here (CPU, TRITON_INTERPRET=1, float32/float16/bfloat16, the last with the interpreter's
bf16 numerics patched: harness.interpreter_bf16) and by scripts/gpu_check.py (CUDA, float16/bfloat16). Each
check_* takes (dtype, device, **case) and returns the relative error; it raises AssertionError when the error is
over tolerance or the output is not finite.
The oracle is always the reference evaluated in float32 on the same (rounded) inputs.
"""
from __future__ import annotations

import math

import torch

from loom.kernels import activation, kv_store, lora, norm, rotary
from loom.kernels.kv_fp8 import KV_FP8_STORAGE, encode_ref
from loom.kernels.kv_layout import block_size_of, kv_cache_shape, kv_heads_of, read_slots, write_slots

# the attention modules share their names with the dispatch functions exported by kernels/__init__
from loom.kernels.paged_decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
from loom.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton
from loom.layers.forward_context import LoraBatchMeta

# relative error of the norm: ||out - ref|| / ||ref||. Every kernel accumulates in float32 and the oracle gets the
# same rounded inputs, so a 16-bit result differs by the roundings to the 16-bit type (intermediates such as P
# before P@V, the output): a fraction of its eps (measured: <= 0.28 eps in fp16 and in bf16, interpreter and
# casts rounding to nearest), whatever the accumulation length (its float32 sums add ~sqrt(K) * 6e-8). Hence 2 eps
# for both 16-bit types; float32: the summation order over lengths up to ~1e3 plus exp/tanh approximations.
TOL = {torch.float32: 1e-5, torch.float16: 2 * torch.finfo(torch.float16).eps,
       torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype, what=""):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten element?)"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: rel err {err:.3g} > {TOL[dtype]:.3g} ({dtype})"
    return err


def rnd(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def poison(*shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# paged KV cache fixtures


def make_paged_cache(seq_lens, block_size, kvh, d, dtype, device, spare_blocks=3, top_of=0):
    """Random K/V for each sequence in shuffled blocks; every slot not holding a token is NaN.

    top_of > 0: the cache holds at least that many elements per tensor and the sequences' blocks are its
    highest-numbered ones (offsets past 2^31 elements when top_of is larger: int64 address arithmetic).
    The values are drawn on `device` (serving-sized caches would take seconds on the host).
    """
    nblk = [math.ceil(n / block_size) for n in seq_lens]
    used = sum(nblk) + spare_blocks
    num_blocks = max(used, math.ceil(top_of / (block_size * kvh * d)))
    ids = (torch.randperm(used) + (num_blocks - used)).tolist()  # the top `used` ids, shuffled
    width = max(nblk + [1]) + 1  # one padding column more than needed
    bt = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    kc = torch.full(kv_cache_shape(num_blocks, block_size, kvh, d), float("nan"), dtype=dtype, device=device)
    vc = torch.full_like(kc, float("nan"))
    for s, n in enumerate(seq_lens):
        blocks = torch.tensor([ids.pop() for _ in range(nblk[s])], dtype=torch.int64)
        bt[s, :len(blocks)] = blocks.to(torch.int32)
        pos = torch.arange(n)
        slots = (blocks[pos // block_size] * block_size + pos % block_size).to(device)
        write_slots(kc, slots, torch.randn(n, kvh, d, device=device))
        write_slots(vc, slots, torch.randn(n, kvh, d, device=device))
    return kc, vc, bt.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def compact_cache(kc, vc, bt, seq_lens):
    """The blocks the tables use, copied into a small cache with renumbered tables: references then run on a
    float32 copy of what matters instead of converting a cache of billions of elements."""
    width = max(1, math.ceil(int(seq_lens.max()) / block_size_of(kc))) if seq_lens.numel() else 1
    used = bt[:, :width].long()
    ids, inv = torch.unique(used, return_inverse=True)
    return kc[ids], vc[ids], inv.to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# checks


def check_store_kv(dtype, device, T=10, kvh=3, d=64, block_size=16, num_blocks=4):
    qkv = rnd(T, (2 + 2 * kvh) * d, dtype=dtype, device=device)  # k/v as strided views of a fused output
    k = qkv[:, 2 * d:(2 + kvh) * d].view(T, kvh, d)
    v = qkv[:, (2 + kvh) * d:].view(T, kvh, d)
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[torch.randperm(T)[:3]] = -1
    slots = slots.to(device)
    kc = rnd(*kv_cache_shape(num_blocks, block_size, kvh, d), dtype=dtype, device=device)
    vc = rnd(*kv_cache_shape(num_blocks, block_size, kvh, d), dtype=dtype, device=device)
    kc2, vc2 = kc.clone(), vc.clone()
    kv_store.store_kv_triton(k, v, kc, vc, slots)
    kv_store.store_kv_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "store_kv mismatch"
    return 0.0


def hide_before_window(kc, bt, first_q_pos, window):
    """Point every block-table entry wholly before the window of a sequence's first query at an all-NaN block: an
    implementation that reads such a block (the contract says it must not) returns NaN."""
    if window is None:
        return bt
    used = set(bt.flatten().tolist())
    nan_block = next(b for b in range(kc.shape[0]) if b not in used and bool(torch.isnan(kc[b].float()).all()))
    bt = bt.clone()
    bs = block_size_of(kc)
    for s, p in enumerate(first_q_pos):
        n_hidden = max(0, p - window + 1) // bs  # blocks whose every position is < p - window + 1
        bt[s, :n_hidden] = nan_block
    return bt


def widen_table(kc, bt, width):
    """The block table at `width` columns, the new ones pointing at an all-NaN block: the engine's persistent
    tables are as wide as max_model_len and hold stale ids past each sequence's blocks, which are never read."""
    if width is None or width <= bt.shape[1]:
        return bt
    used = set(bt.flatten().tolist())
    nan_block = next(b for b in range(kc.shape[0]) if b not in used and bool(torch.isnan(kc[b].float()).all()))
    wide = torch.full((bt.shape[0], width), nan_block, dtype=bt.dtype, device=bt.device)
    wide[:, :bt.shape[1]] = bt
    return wide


def check_decode(dtype, device, seq_lens, heads, kvh, d, block_size, num_splits=None, block_n=None,
                 sliding_window=None, softcap=None, top_of=0, table_width=None):
    kc, vc, bt, sl = make_paged_cache(seq_lens, block_size, kvh, d, dtype, device, top_of=top_of)
    bt = hide_before_window(kc, bt, [n - 1 for n in seq_lens], sliding_window)
    bt = widen_table(kc, bt, table_width)
    q = rnd(len(seq_lens), heads, d, dtype=dtype, device=device, scale=3.0 if softcap else 1.0)
    scale = d ** -0.5
    opts = dict(sliding_window=sliding_window, softcap=softcap)
    out = poison(len(seq_lens), heads, d, dtype=dtype, device=device)
    counters = torch.zeros(len(seq_lens) * kvh, dtype=torch.int32, device=device)  # flash-decoding's tickets
    opts.update(num_splits=num_splits, block_n=block_n, split_counters=counters)
    paged_decode_attention_triton(q, kc, vc, bt, sl, scale, out=out, **opts)
    assert not counters.any(), f"a launch left ticket counters non-zero: {counters.tolist()}"
    # the counters serve the next launch as they served this one (a graph replay); split launches only use them
    if num_splits != 1 and (dtype == torch.float32 or torch.device(device).type != "cpu"):
        again = poison(len(seq_lens), heads, d, dtype=dtype, device=device)
        paged_decode_attention_triton(q, kc, vc, bt, sl, scale, out=again, **opts)
        assert torch.equal(again, out) and not counters.any(), "a second launch over the same counters differs"
    kc, vc, bt = compact_cache(kc, vc, bt, sl)
    ref = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), bt, sl, scale, **opts)
    return assert_close(out.float(), ref, dtype, "paged_decode_attention")


def check_decode_rope_store(dtype, device, seq_lens, heads, kvh, d, block_size, rot=None, num_splits=None,
                            block_n=None, sliding_window=None, softcap=None):
    """The decode kernel with this step's rope and K/V store inside (each sequence's last position is its new token,
    slot -1 for an empty one) on strided q|k|v views: the caches exactly as rotary_store_kv's kernel leaves them, q, k
    and v untouched, the output within tolerance of the reference in float32. The new tokens' slots start NaN: a
    read before the store shows."""
    kc, vc, bt, sl = make_paged_cache(seq_lens, block_size, kvh, d, dtype, device)
    B = len(seq_lens)
    qkv = rnd(B, (heads + 2 * kvh) * d, dtype=dtype, device=device, scale=3.0 if softcap else 1.0)
    q, k, v = (qkv[:, a * d:b * d].view(B, -1, d) for a, b in ((0, heads), (heads, heads + kvh),
                                                                 (heads + kvh, heads + 2 * kvh)))
    pos = (sl.long() - 1).clamp_min(0)
    blocks = bt.long()[torch.arange(B, device=device), pos // block_size]
    slots = torch.where(sl > 0, blocks * block_size + pos % block_size, -1)
    new = slots[slots >= 0]
    write_slots(kc, new, torch.full((new.shape[0], kvh, d), float("nan"), device=device))
    write_slots(vc, new, torch.full((new.shape[0], kvh, d), float("nan"), device=device))
    cs = cos_sin_cache(max(seq_lens) + 1, rot or d, device)
    scale = d ** -0.5
    opts = dict(sliding_window=sliding_window, softcap=softcap, num_splits=num_splits, block_n=block_n)
    qkv0, kc2, vc2, kcf, vcf = qkv.clone(), kc.clone(), vc.clone(), kc.float(), vc.float()
    out = poison(B, heads, d, dtype=dtype, device=device)
    paged_decode_attention_triton(q, kc, vc, bt, sl, scale, out=out, rope_store=(pos, k, v, cs, slots), **opts)
    assert torch.equal(qkv, qkv0), "the fused kernel wrote into q, k or v"
    q2, k2, v2 = (qkv0.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k, v))  # the same views
    rotary.rotary_store_kv_triton(pos, q2, k2, v2, cs, kc2, vc2, slots)
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)), "k cache differs from rotary_store_kv's"
    assert torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0)), "v cache differs from rotary_store_kv's"
    ref = paged_decode_attention_ref(q.float(), kcf, vcf, bt, sl, scale, sliding_window=sliding_window,
                                     softcap=softcap, rope_store=(pos, k.float(), v.float(), cs, slots))
    return assert_close(out.float(), ref, dtype, "paged_decode_attention rope_store")


def prefill_inputs(q_and_seq_lens, heads, kvh, d, block_size, dtype, device, top_of=0):
    q_lens = [a for a, _ in q_and_seq_lens]
    kc, vc, bt, sl = make_paged_cache([b for _, b in q_and_seq_lens], block_size, kvh, d, dtype, device,
                                      top_of=top_of)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    q = rnd(sum(q_lens), heads, d, dtype=dtype, device=device)
    return q, kc, vc, cu, sl, bt, max(q_lens)


def check_prefill(dtype, device, q_and_seq_lens, heads, kvh, d, block_size, block_m=None, block_n=None,
                  sliding_window=None, softcap=None, top_of=0, table_width=None):
    q, kc, vc, cu, sl, bt, max_q = prefill_inputs(q_and_seq_lens, heads, kvh, d, block_size, dtype, device, top_of)
    bt = hide_before_window(kc, bt, [n - ql for ql, n in q_and_seq_lens], sliding_window)
    bt = widen_table(kc, bt, table_width)
    if softcap:
        q = q * 3.0  # scores well past the cap
    scale = d ** -0.5
    opts = dict(sliding_window=sliding_window, softcap=softcap)
    out = poison(*q.shape, dtype=dtype, device=device)
    paged_prefill_attention_triton(q, kc, vc, cu, sl, bt, max_q, scale, out=out, block_m=block_m, block_n=block_n,
                                   **opts)
    kc, vc, bt = compact_cache(kc, vc, bt, sl)
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), cu, sl, bt, max_q, scale, **opts)
    return assert_close(out.float(), ref, dtype, "paged_prefill_attention")


def check_fp8_kv(dtype, device, seq_lens, q_lens, heads, kvh, d, block_size, k_scale=0.25, v_scale=0.5):
    """kv_cache_dtype fp8: e4m3 codes in a uint8 cache. The decode kernel's rope + store and the plain store write the
    reference's codes; decode and prefill attention over the codes within tolerance of the references in float32
    (power-of-two scales: the dequantised values are exact in every dtype, so both read the same K/V)."""
    kc, vc, bt, sl = make_paged_cache(seq_lens, block_size, kvh, d, torch.float32, device)
    kc, vc = encode_ref(kc * 2, k_scale), encode_ref(vc * 2, v_scale)  # NaN slots stay NaN codes
    s = dict(k_scale=k_scale, v_scale=v_scale)
    B = len(seq_lens)
    q, k, v = (rnd(B, n, d, dtype=dtype, device=device) for n in (heads, kvh, kvh))
    pos = sl.long() - 1
    slots = bt.long()[torch.arange(B, device=device), pos // block_size] * block_size + pos % block_size
    cs = cos_sin_cache(max(seq_lens) + 1, d, device)
    kc2, vc2 = kc.clone(), vc.clone()
    out = poison(B, heads, d, dtype=dtype, device=device)
    paged_decode_attention_triton(q, kc, vc, bt, sl, d ** -0.5, out=out, rope_store=(pos, k, v, cs, slots), **s)
    q2 = q.clone()  # rope and store by the reference in dtype (rounded as the kernel rounds), attention in float32
    rotary.rotary_store_kv_ref(pos, q2, k.clone(), v, cs, kc2, vc2, slots, **s)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "fp8 rope_store codes differ from the reference's"
    ref = paged_decode_attention_ref(q2.float(), kc2, vc2, bt, sl, d ** -0.5, **s)
    assert_close(out.float(), ref, dtype, "fp8 paged_decode_attention rope_store")
    kc2, vc2 = kc.clone(), vc.clone()
    kv_store.store_kv_triton(k, v, kc, vc, slots, **s)
    kv_store.store_kv_ref(k, v, kc2, vc2, slots, **s)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "fp8 store_kv codes differ from the reference's"
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    qp = rnd(sum(q_lens), heads, d, dtype=dtype, device=device)
    out = poison(*qp.shape, dtype=dtype, device=device)
    paged_prefill_attention_triton(qp, kc, vc, cu, sl, bt, max(q_lens), d ** -0.5, out=out, **s)
    ref = paged_prefill_attention_ref(qp.float(), kc, vc, cu, sl, bt, max(q_lens), d ** -0.5, **s)
    assert KV_FP8_STORAGE == kc.dtype
    return assert_close(out.float(), ref, dtype, "fp8 paged_prefill_attention")


def check_store_kv_top(dtype, device, T=10, kvh=2, d=64, block_size=16, top_of=1 << 16):
    """store_kv into the highest slots of a cache of at least top_of elements: every token lands in its slot and
    nothing else is written (the cache starts NaN, so a stray write shows up in the count of finite elements)."""
    num_blocks = max(T // block_size + 2, math.ceil(top_of / (block_size * kvh * d)))
    kc = torch.full(kv_cache_shape(num_blocks, block_size, kvh, d), float("nan"), dtype=dtype, device=device)
    vc = torch.full_like(kc, float("nan"))
    slots = num_blocks * block_size - 1 - torch.randperm(2 * block_size)[:T]  # shuffled, in the top two blocks
    slots[torch.randperm(T)[:2]] = -1
    slots = slots.to(device)
    k, v = rnd(T, kvh, d, dtype=dtype, device=device), rnd(T, kvh, d, dtype=dtype, device=device)
    kv_store.store_kv_triton(k, v, kc, vc, slots)
    keep = slots >= 0
    for cache, src, what in ((kc, k, "k"), (vc, v, "v")):
        assert torch.equal(read_slots(cache, slots[keep]), src[keep]), f"store_kv {what}: wrong values in the top slots"
        written = int(torch.isfinite(cache).sum())
        assert written == int(keep.sum()) * kvh * d, f"store_kv {what}: {written} elements written, " \
            f"{int(keep.sum()) * kvh * d} expected"
    return 0.0


def check_norm(dtype, device, T=7, n=96, residual=True):
    x = rnd(T, n, dtype=dtype, device=device)
    res = rnd(T, n, dtype=dtype, device=device) if residual else None
    w = rnd(n, dtype=dtype, device=device, scale=0.5) + 1
    out, res_out = norm.fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref, ref_res = norm.fused_add_rms_norm_ref(x.float(), None if res is None else res.float(), w.float(), 1e-6)
    # the residual sum is rounded to dtype before normalising: compare against the rounded sum
    ref = norm.fused_add_rms_norm_ref(ref_res.to(dtype).float(), None, w.float(), 1e-6)[0]
    assert_close(res_out.float(), ref_res, dtype, "fused_add_rms_norm residual")
    return assert_close(out.float(), ref, dtype, "fused_add_rms_norm")


def cos_sin_cache(max_pos, d, device, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1).to(device)


def check_rotary(dtype, device, T=9, heads=9, kvh=3, d=64, max_pos=100):
    qkv = rnd(T, (heads + 2 * kvh) * d, dtype=dtype, device=device)
    q = qkv[:, :heads * d].view(T, heads, d)  # strided views, as the model passes them
    k = qkv[:, heads * d:(heads + kvh) * d].view(T, kvh, d)
    pos = torch.randint(0, max_pos, (T,), dtype=torch.int64).to(device)
    cs = cos_sin_cache(max_pos, d, device)
    qr, kr = q.float().clone(), k.float().clone()
    rotary.rotary_embedding_triton(pos, q, k, cs)
    rotary.rotary_embedding_ref(pos, qr, kr, cs)
    assert_close(k.float(), kr, dtype, "rotary k")
    return assert_close(q.float(), qr, dtype, "rotary q")


def check_rotary_store_kv(dtype, device, T=9, heads=9, kvh=3, d=64, rot=None, block_size=16, max_pos=100):
    """The fused rope + KV store on strided q|k|v views (slot -1: not stored) against its reference in float32."""
    qkv = rnd(T, (heads + 2 * kvh) * d, dtype=dtype, device=device)
    q, k, v = (qkv[:, a * d:b * d].view(T, -1, d) for a, b in ((0, heads), (heads, heads + kvh),
                                                                 (heads + kvh, heads + 2 * kvh)))
    pos = torch.randint(0, max_pos, (T,), dtype=torch.int64).to(device)
    slots = torch.randperm(3 * block_size)[:T].to(device)
    slots[T // 2] = -1
    kc, vc = (torch.zeros(kv_cache_shape(3, block_size, kvh, d), dtype=dtype, device=device) for _ in range(2))
    cs = cos_sin_cache(max_pos, rot or d, device)
    qr, kr, vr = q.float().clone(), k.float().clone(), v.float().clone()
    kcr, vcr = kc.float(), vc.float()
    rotary.rotary_store_kv_triton(pos, q, k, v, cs, kc, vc, slots)
    rotary.rotary_store_kv_ref(pos, qr, kr, vr, cs, kcr, vcr, slots)
    assert_close(kc.float(), kcr, dtype, "rotary_store_kv k cache")
    assert_close(vc.float(), vcr, dtype, "rotary_store_kv v cache")
    assert_close(k.float(), kr, dtype, "rotary_store_kv k")
    return assert_close(q.float(), qr, dtype, "rotary_store_kv q")


def check_silu(dtype, device, T=5, inter=100):
    x = rnd(T, 2 * inter, dtype=dtype, device=device)
    return assert_close(activation.silu_and_mul_triton(x).float(), activation.silu_and_mul_ref(x.float()), dtype,
                        "silu_and_mul")


def check_gelu_tanh(dtype, device, T=5, inter=100):
    x = rnd(T, 2 * inter, dtype=dtype, device=device, scale=2.0)
    return assert_close(activation.gelu_tanh_and_mul_triton(x).float(), activation.gelu_tanh_and_mul_ref(x.float()),
                        dtype, "gelu_tanh_and_mul")


def make_lora_meta(num_tokens, ranks, device, spare_rows=5):
    """Adapters at shuffled places in the pool with gaps; random tokens per group; some tokens unused."""
    G = len(ranks)
    owner = torch.randint(-1, G, (num_tokens,))  # -1: no adapter
    for g in range(G):  # every group gets at least one token
        owner[g] = g
    segs, idx = [0], []
    for g in range(G):
        toks = (owner == g).nonzero().squeeze(1)
        idx.append(toks[torch.randperm(len(toks))])  # unsorted gather order
        segs.append(segs[-1] + len(toks))
    order = torch.randperm(G).tolist()
    row_start, r = [0] * G, 0
    for g in order:
        r += int(torch.randint(0, spare_rows + 1, ()))
        row_start[g] = r
        r += ranks[g]
    scal = (torch.rand(G) + 0.5).tolist()
    meta = LoraBatchMeta(
        token_indices=torch.cat(idx).to(device), seg_starts=torch.tensor(segs, dtype=torch.int32, device=device),
        row_start=torch.tensor(row_start, dtype=torch.int32, device=device),
        ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        scalings=torch.tensor(scal, dtype=torch.float32, device=device),
        max_rank=max(ranks), max_seg_len=max(segs[g + 1] - segs[g] for g in range(G)),
        seg_starts_cpu=segs, row_start_cpu=row_start, ranks_cpu=list(ranks), scalings_cpu=scal)
    return meta, r + spare_rows, owner


def contiguous_lora_meta(runs, ranks):
    """Groups over consecutive tokens (prefill chunks), in token order; runs: (group or -1, tokens) in order."""
    owner = torch.tensor([g for g, n in runs for _ in range(n)])
    idx = [(owner == g).nonzero().squeeze(1) for g in range(len(ranks))]
    segs = [0]
    for t in idx:
        segs.append(segs[-1] + len(t))
    rows = [sum(ranks[:g]) + 2 * g for g in range(len(ranks))]
    scal = (torch.rand(len(ranks)) + 0.5).tolist()
    meta = LoraBatchMeta(
        token_indices=torch.cat(idx), seg_starts=torch.tensor(segs, dtype=torch.int32),
        row_start=torch.tensor(rows, dtype=torch.int32), ranks=torch.tensor(ranks, dtype=torch.int32),
        scalings=torch.tensor(scal), max_rank=max(ranks), max_seg_len=max(len(t) for t in idx),
        seg_starts_cpu=segs, row_start_cpu=rows, ranks_cpu=list(ranks), scalings_cpu=scal)
    return meta, rows[-1] + ranks[-1] + 2, owner


def rank_mask(meta, n_slices):
    m = torch.zeros(n_slices, meta.token_indices.shape[0], meta.max_rank, dtype=torch.bool)
    for g, rk in enumerate(meta.ranks_cpu):
        m[:, meta.seg_starts_cpu[g]:meta.seg_starts_cpu[g + 1], :rk] = True
    return m


def _pool_dtype(dtype, pool16: bool):
    """pool16: float16 adapter pools under float32 activations (lora_dtype), widened where read; else the
    activations' dtype."""
    return torch.float16 if pool16 and dtype == torch.float32 else dtype


def check_lora_shrink(dtype, device, num_tokens=40, ranks=(1, 8, 16, 64), k_in=128, n_slices=3, split_k=None,
                      pool16=False):
    meta, R, _ = make_lora_meta(num_tokens, list(ranks), device)
    x = rnd(num_tokens, k_in, dtype=dtype, device=device)
    a = rnd(n_slices, R, k_in, dtype=_pool_dtype(dtype, pool16), device=device, scale=k_in ** -0.5)
    out = poison(n_slices, meta.token_indices.shape[0], meta.max_rank, dtype=torch.float32, device=device)
    lora.lora_shrink_triton(x, a, meta, out=out, split_k=split_k)
    ref = lora.lora_shrink_ref(x.float(), a.float(), meta)
    m = rank_mask(meta, n_slices).to(device)
    return assert_close(out[m], ref[m], dtype, "lora_shrink")


def check_lora_expand(dtype, device, num_tokens=40, ranks=(1, 8, 16, 64), out_sizes=(64, 32, 32), pool16=False):
    meta, R, owner = make_lora_meta(num_tokens, list(ranks), device)
    offs = [0] + torch.tensor(out_sizes).cumsum(0).tolist()
    buf = rnd(len(out_sizes), meta.token_indices.shape[0], meta.max_rank, dtype=torch.float32, device=device)
    b = rnd(R, offs[-1], dtype=_pool_dtype(dtype, pool16), device=device, scale=0.3)
    y0 = rnd(num_tokens, offs[-1], dtype=dtype, device=device, scale=0.1)
    y = y0.clone()
    lora.lora_expand_triton(buf, b, offs, meta, y)
    y_ref = lora.lora_expand_ref(buf.to(dtype).float(), b.float(), offs, meta, y0.float().clone())
    no_adapter = (owner == -1).to(device)
    assert torch.equal(y[no_adapter], y0[no_adapter]), "lora_expand touched a token without adapter"
    assert_close(y.float(), y_ref, dtype, "lora_expand y")
    return assert_close((y.float() - y0.float()), y_ref - y0.float(), dtype, "lora_expand delta")


def check_lora_fused(dtype, device, num_tokens=12, ranks=(1, 8, 16, 64), k_in=128, out_sizes=(64, 32, 32),
                     pool16=False, exact=False):
    """lora_apply_triton's fused shrink + expand (few tokens per adapter): tokens without adapter untouched, within
    tolerance of the reference in float32; exact: also bit-equal to shrink then expand without split K (their
    variants are compiled for it: tests/kernels, not gpu_check's grid)."""
    meta, R, owner = make_lora_meta(num_tokens, list(ranks), device)
    assert meta.max_seg_len <= lora.FUSED_MAX_TOKENS
    offs = [0] + torch.tensor(out_sizes).cumsum(0).tolist()
    x = rnd(num_tokens, k_in, dtype=dtype, device=device)
    a = rnd(len(out_sizes), R, k_in, dtype=_pool_dtype(dtype, pool16), device=device, scale=k_in ** -0.5)
    b = rnd(R, offs[-1], dtype=_pool_dtype(dtype, pool16), device=device, scale=0.3)
    y0 = rnd(num_tokens, offs[-1], dtype=dtype, device=device, scale=0.1)
    y = y0.clone()
    lora.lora_apply_triton(x, y, a, b, offs, meta)
    if exact:
        y2 = lora.lora_expand_triton(lora.lora_shrink_triton(x, a, meta, split_k=1), b, offs, meta, y0.clone())
        assert torch.equal(y, y2), "the fused kernel differs from shrink then expand"
    no_adapter = (owner == -1).to(device)
    assert torch.equal(y[no_adapter], y0[no_adapter]), "the fused kernel touched a token without adapter"
    ref = lora.lora_shrink_ref(x.float(), a.float(), meta)
    y_ref = lora.lora_expand_ref(ref.to(dtype).float(), b.float(), offs, meta, y0.float().clone())
    return assert_close(y.float(), y_ref, dtype, "lora fused y")


# name -> (check, list of cases); the pytest files parametrize over these, gpu_check runs them all
CASES = {
    "store_kv": (check_store_kv, [dict(), dict(kvh=1, d=128, block_size=32)]),
    "decode": (check_decode, [
        # group 3 (SmolLM2: 9 q heads / 3 kv heads), lengths: empty, < 1 block, 1 block, many blocks
        dict(seq_lens=[0, 3, 16, 50], heads=9, kvh=3, d=64, block_size=16, num_splits=1),
        dict(seq_lens=[5, 32, 70], heads=4, kvh=4, d=128, block_size=32, num_splits=1),  # group 1
        dict(seq_lens=[1, 17, 45], heads=8, kvh=2, d=64, block_size=16, num_splits=1, block_n=16),  # group 4
        dict(seq_lens=[0, 3, 40, 77], heads=9, kvh=3, d=64, block_size=16, num_splits=4, block_n=16),  # split
        dict(seq_lens=[33, 64], heads=8, kvh=2, d=128, block_size=32, num_splits=3, block_n=16),  # split
        dict(seq_lens=[20, 9], heads=4, kvh=2, d=32, block_size=8),  # auto, block size < tile
        # sliding window: shorter than, equal to and longer than the context; blocks before it are NaN
        dict(seq_lens=[0, 3, 24, 25, 70], heads=9, kvh=3, d=64, block_size=16, num_splits=1, sliding_window=24),
        dict(seq_lens=[5, 40, 77], heads=8, kvh=2, d=64, block_size=16, num_splits=3, block_n=16, sliding_window=20),
        dict(seq_lens=[3, 50], heads=4, kvh=2, d=32, block_size=8, num_splits=1, softcap=5.0),
        dict(seq_lens=[1, 33, 60], heads=4, kvh=2, d=32, block_size=8, num_splits=2, block_n=16, softcap=5.0,
             sliding_window=17),
        # many partitions (the last program merges 40); per-sequence partition counts differ
        dict(seq_lens=[700, 5, 0, 290], heads=4, kvh=2, d=32, block_size=16, num_splits=40, block_n=16),
        # a table as wide as a long max_model_len (automatic splits sized by it, >= 256-token partitions)
        dict(seq_lens=[600, 5, 0, 300], heads=4, kvh=2, d=64, block_size=16, table_width=128),
        dict(seq_lens=[3, 40], heads=4, kvh=2, d=8, block_size=16, num_splits=1),  # head_dim < 16 (tl.dot K)
        dict(seq_lens=[3, 90], heads=4, kvh=1, d=8, block_size=16, num_splits=3, block_n=16),
    ]),
    "decode_rope_store": (check_decode_rope_store, [  # the heads of the rotary_store_kv cases (the same variants)
        # a tile per 2 blocks, an empty sequence, softcap
        dict(seq_lens=[0, 3, 16, 50], heads=9, kvh=3, d=64, block_size=16, num_splits=1, softcap=5.0),
        # a tile in a block, split (the last partition stores), partial rotary, head dim padded, window
        dict(seq_lens=[5, 40, 77], heads=8, kvh=2, d=96, rot=48, block_size=16, num_splits=3, block_n=16,
             sliding_window=20),
    ]),
    "prefill": (check_prefill, [
        # (q_len, seq_len): decode-like, full prompt of < 1 block, chunk starting mid-block, long prompt
        dict(q_and_seq_lens=[(1, 5), (7, 7), (5, 23), (20, 40), (1, 33)], heads=9, kvh=3, d=64, block_size=16,
             block_m=16, block_n=16),
        dict(q_and_seq_lens=[(32, 32), (3, 35), (1, 1)], heads=4, kvh=4, d=128, block_size=32, block_m=16),
        dict(q_and_seq_lens=[(16, 16), (9, 50), (1, 17)], heads=8, kvh=2, d=64, block_size=16),  # group 4
        # sliding window: a prompt longer than it, a chunk after it, a decode-like row past it
        dict(q_and_seq_lens=[(40, 40), (7, 60), (1, 45), (5, 5)], heads=9, kvh=3, d=64, block_size=16,
             block_m=16, block_n=16, sliding_window=12),
        dict(q_and_seq_lens=[(33, 33), (1, 20)], heads=4, kvh=2, d=32, block_size=8, softcap=5.0),
        dict(q_and_seq_lens=[(30, 50), (20, 20)], heads=4, kvh=2, d=32, block_size=8, block_m=16, softcap=5.0,
             sliding_window=9),
        dict(q_and_seq_lens=[(9, 20), (1, 3)], heads=4, kvh=2, d=8, block_size=16, table_width=40),  # head_dim 8
    ]),
    # the sequences' blocks at the top of the cache (the GPU check uses caches of more than 2^31 elements)
    "top_blocks": (check_decode, [dict(seq_lens=[5, 40], heads=8, kvh=2, d=64, block_size=16, top_of=1 << 16)]),
    "top_blocks_prefill": (check_prefill, [dict(q_and_seq_lens=[(7, 7), (9, 40)], heads=8, kvh=2, d=64,
                                                block_size=16, top_of=1 << 16)]),
    "top_slots_store_kv": (check_store_kv_top, [dict()]),
    "fp8_kv": (check_fp8_kv, [dict(seq_lens=[3, 20, 45], q_lens=[3, 4, 1], heads=9, kvh=3, d=64, block_size=16)]),
    "norm": (check_norm, [dict(), dict(residual=False, n=128)]),
    "rotary": (check_rotary, [dict(), dict(heads=4, kvh=4, d=128)]),
    "rotary_store_kv": (check_rotary_store_kv, [dict(), dict(heads=8, kvh=2, d=96, rot=48)]),
    "silu_and_mul": (check_silu, [dict()]),
    "gelu_tanh_and_mul": (check_gelu_tanh, [dict(), dict(T=3, inter=1100)]),
    "lora_shrink": (check_lora_shrink, [dict(), dict(split_k=2, n_slices=2), dict(ranks=(100, 3), n_slices=1),
                                        dict(pool16=True)]),
    "lora_expand": (check_lora_expand, [dict(), dict(out_sizes=(96, 96)), dict(ranks=(100, 3), out_sizes=(40,)),
                                        dict(pool16=True)]),
    "lora_fused": (check_lora_fused, [dict(pool16=True), dict(num_tokens=3, ranks=(100, 3), out_sizes=(40,))]),
}


def naive_attention(q, kc, vc, cu, seq_lens, bt, scale, window=None, softcap=None):
    """The float64 oracle of paged attention, per (token, head): the keys at positions max(0, pos - window + 1)
    .. pos, scores capped as c*tanh(s/c)."""
    q, kc, vc = q.double(), kc.double(), vc.double()
    bs, kvh = block_size_of(kc), kv_heads_of(kc)
    group = q.shape[1] // kvh
    out = torch.zeros_like(q)
    for s in range(len(seq_lens)):
        q_len, n = int(cu[s + 1] - cu[s]), int(seq_lens[s])
        for i in range(q_len):
            t, pos = int(cu[s]) + i, n - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(q.shape[1]):
                keys = torch.stack([kc[bt[s, p // bs], h // group, p % bs] for p in range(first, pos + 1)])
                vals = torch.stack([vc[bt[s, p // bs], h // group, p % bs] for p in range(first, pos + 1)])
                scores = keys @ q[t, h] * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                w = torch.softmax(scores, 0)
                out[t, h] = w @ vals
    return out
