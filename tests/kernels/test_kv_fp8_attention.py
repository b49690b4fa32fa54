"""Paged attention over an fp8 KV cache (kernels/kv_fp8.py), Triton under the interpreter against the references:
the KV store kernels (plain, fused with rope, inside the decode kernel) write the reference's codes byte for byte;
the decode and prefill kernels read them as the reference's dequantised cache does; and the reference over the fp8
cache is within the e4m3 rounding bound of attention over the unquantised K/V, computed in float64."""
from __future__ import annotations

import math

import pytest
import torch

from harness.kernel_cases import assert_close, make_paged_cache
from loom.kernels import kv_store, rotary
from loom.kernels.kv_fp8 import KV_FP8_STORAGE, decode_ref, encode_ref
from loom.kernels.kv_layout import kv_cache_shape
from loom.kernels.paged_decode_attention import (
    gather_kv,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from loom.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton

KVH, H, D, BS = 2, 4, 32, 16
K_SCALE, V_SCALE = 0.05, 0.125  # checkpoint-like scales: K/V of |x| ~ 4 use the codes' upper range


def _fp8_cache(seq_lens, seed=0):
    """make_paged_cache's random K/V (NaN in unused slots), scaled up by 4 and encoded: (float caches, fp8 caches,
    block tables, seq_lens)."""
    torch.manual_seed(seed)
    kc, vc, bt, sl = make_paged_cache(seq_lens, BS, KVH, D, torch.float32, "cpu")
    kc, vc = kc * 4, vc * 4
    return (kc, vc), (encode_ref(kc, K_SCALE), encode_ref(vc, V_SCALE)), bt, sl


def test_store_kernels_write_the_reference_codes():
    T = 12
    torch.manual_seed(1)
    k, v, q = torch.randn(T, KVH, D) * 3, torch.randn(T, KVH, D) * 3, torch.randn(T, H, D)
    slots = torch.randperm(4 * BS)[:T]
    slots[[2, 7]] = -1
    shape = kv_cache_shape(4, BS, KVH, D)
    caches = [torch.zeros(shape, dtype=KV_FP8_STORAGE) for _ in range(4)]
    kv_store.store_kv_triton(k, v, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    kv_store.store_kv_ref(k, v, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int(caches[0].count_nonzero()) > (T - 2) * KVH * D * 0.9  # the 10 kept rows written (zero codes: rare)
    pos = torch.randint(0, 64, (T,))
    cs = torch.randn(64, D)
    for c in caches:
        c.zero_()
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    rotary.rotary_store_kv_triton(pos, q1, k1, v, cs, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    rotary.rotary_store_kv_ref(pos, q2, k2, v, cs, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _attention_bound(q, k, v, kq, vq, seq_lens, scale):
    """Per query row: |out_fp8 - out| <= max|v'| (e^(2 delta) - 1) + max|v' - v|, delta = max_j |q.(k'_j - k_j)| *
    scale (softmax weights move by a factor within e^(+-2 delta); k', v' the dequantised values)."""
    dk, dv = (kq - k).abs(), (vq - v).abs()
    delta = torch.einsum("bgd,bjd->bgj", q.abs(), dk).amax(-1) * scale  # [B, G]
    return vq.abs().amax((-1, -2))[:, None] * torch.expm1(2 * delta) + dv.amax((-1, -2))[:, None]


@pytest.mark.parametrize("window", [None, 20])
def test_decode_over_fp8_cache(window):
    seq_lens = [1, 17, 40, 33]
    (kf, vf), (kc, vc), bt, sl = _fp8_cache(seq_lens)
    B = len(seq_lens)
    q = torch.randn(B, H, D)
    scale = D ** -0.5
    ref = paged_decode_attention_ref(q, kc, vc, bt, sl, scale, sliding_window=window, k_scale=K_SCALE,
                                     v_scale=V_SCALE)
    for splits in (1, 3):
        out = paged_decode_attention_triton(q, kc, vc, bt, sl, scale, sliding_window=window, num_splits=splits,
                                            k_scale=K_SCALE, v_scale=V_SCALE)
        assert_close(out, ref, torch.float32, f"decode splits={splits}")
    if window is not None:
        return
    # the reference over the fp8 cache against float64 attention over the unquantised K/V, within e4m3's bound
    k, v, _, valid = gather_kv(kf, vf, bt, sl)
    kq = decode_ref(encode_ref(k, K_SCALE), K_SCALE)
    vq = decode_ref(encode_ref(v, V_SCALE), V_SCALE)
    for b, n in enumerate(seq_lens):
        qb = q[b].view(KVH, H // KVH, D).double()
        kb, vb, kqb, vqb = (t[b, :, :n].double() for t in (k, v, kq, vq))
        exact = torch.softmax(qb @ kb.transpose(-1, -2) * scale, -1) @ vb  # [KVH, G, D]
        bound = _attention_bound(qb, kb, vb, kqb, vqb, n, scale)  # [KVH, G]
        err = (ref[b].view(KVH, H // KVH, D).double() - exact).abs().amax(-1)
        assert (err <= bound * 1.001 + 1e-6).all(), (b, err, bound)
        assert err.max() > 0  # quantised: not the float cache by mistake


def test_decode_rope_store_over_fp8_cache():
    """The decode kernel's fused rope + store of this step's token into an fp8 cache, then the attention."""
    seq_lens = [5, 18, 33]
    _, (kc, vc), bt, sl = _fp8_cache(seq_lens, seed=2)
    B = len(seq_lens)
    q, k, v = torch.randn(B, H, D), torch.randn(B, KVH, D) * 3, torch.randn(B, KVH, D) * 3
    last = (sl - 1).long()
    slots = bt.long()[torch.arange(B), last // BS] * BS + last % BS
    cs = torch.randn(64, D)
    kc2, vc2 = kc.clone(), vc.clone()
    args = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_decode_attention_triton(q, kc, vc, bt, sl, D ** -0.5, rope_store=(last, k, v, cs, slots), **args)
    ref = paged_decode_attention_ref(q, kc2, vc2, bt, sl, D ** -0.5, rope_store=(last, k, v, cs, slots), **args)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert_close(out, ref, torch.float32, "decode rope_store")


def test_prefill_over_fp8_cache():
    """Chunked prefill rows (a prefix already cached) and a single-token row, over the fp8 cache."""
    seq_lens = [40, 9, 1, 23]
    q_lens = [24, 9, 1, 5]
    _, (kc, vc), bt, sl = _fp8_cache(seq_lens, seed=3)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), H, D)
    scale = D ** -0.5
    for window in (None, 7):
        args = dict(sliding_window=window, k_scale=K_SCALE, v_scale=V_SCALE)
        ref = paged_prefill_attention_ref(q, kc, vc, cu, sl, bt, max(q_lens), scale, **args)
        out = paged_prefill_attention_triton(q, kc, vc, cu, sl, bt, max(q_lens), scale, **args)
        assert_close(out, ref, torch.float32, f"prefill window={window}")
        assert math.isfinite(float(out.abs().max()))
