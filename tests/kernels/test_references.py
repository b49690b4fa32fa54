"""The references are the engine's CPU kernels and the oracles for the Triton ones: check them against
naive per-token loops in float64, and check the dispatcher picks the intended implementation."""
import pytest
import torch

import harness.kernel_cases as kcases
from loom import kernels
from loom.kernels import dispatch, lora, norm, rotary
from loom.kernels.paged_decode_attention import paged_decode_attention_ref
from loom.kernels.paged_prefill_attention import paged_prefill_attention_ref


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_ref_vs_naive(group):
    torch.manual_seed(group)
    lens = [(1, 5), (6, 6), (4, 21), (1, 1), (9, 30)]
    q, kc, vc, cu, sl, bt, max_q = kcases.prefill_inputs(lens, 3 * group, 3, 16, 8, torch.float32, "cpu")
    out = paged_prefill_attention_ref(q, kc, vc, cu, sl, bt, max_q, 0.3)
    assert kcases.rel_err(out, kcases.naive_attention(q, kc, vc, cu, sl, bt, 0.3)) < 1e-6


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (11, 2.0)])
def test_window_softcap_refs_vs_naive(window, softcap):
    """Both references against the naive loop, with blocks before each window pointing at NaN blocks."""
    torch.manual_seed(7)
    lens = [(1, 5), (6, 6), (4, 21), (1, 1), (9, 30), (1, 40)]
    q, kc, vc, cu, sl, bt, max_q = kcases.prefill_inputs(lens, 6, 3, 16, 4, torch.float32, "cpu")
    q = q * 4
    full_bt = bt
    bt = kcases.hide_before_window(kc, bt, [n - ql for ql, n in lens], window)
    out = paged_prefill_attention_ref(q, kc, vc, cu, sl, bt, max_q, 0.3, sliding_window=window, softcap=softcap)
    want = kcases.naive_attention(q, kc, vc, cu, sl, bt, 0.3, window, softcap)
    assert kcases.rel_err(out, want) < 1e-6
    dec = [0, 3, 5]  # single-token rows, through the decode reference
    out = paged_decode_attention_ref(q[cu[dec].long()], kc, vc, bt[dec], sl[dec], 0.3, sliding_window=window,
                                     softcap=softcap)
    assert kcases.rel_err(out, want[cu[dec].long()]) < 1e-6
    if window is not None:  # the window changes the result (a test that cannot fail otherwise)
        full = kcases.naive_attention(q, kc, vc, cu, sl, full_bt, 0.3, None, softcap)
        assert kcases.rel_err(full, want) > 1e-2


def test_decode_ref_vs_naive():
    torch.manual_seed(0)
    lens = [3, 16, 0, 41]
    kc, vc, bt, sl = kcases.make_paged_cache(lens, 16, 2, 32, torch.float32, "cpu")
    q = torch.randn(4, 6, 32)
    out = paged_decode_attention_ref(q, kc, vc, bt, sl, 0.2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context -> zeros
    cu = torch.arange(5, dtype=torch.int32)
    keep = [0, 1, 3]
    want = kcases.naive_attention(q[keep], kc, vc, cu[:4], sl[keep], bt[keep], 0.2)
    assert kcases.rel_err(out[keep], want) < 1e-6


@pytest.mark.parametrize("path", ["group-loop", "dense-span"])
def test_lora_refs_vs_naive(path, monkeypatch):
    monkeypatch.setattr(lora, "_DENSE_MAX_TOKEN_ROWS", 0 if path == "group-loop" else 10**9)
    torch.manual_seed(0)
    meta, R, owner = kcases.make_lora_meta(30, [1, 8, 16, 64], "cpu")
    offs = [0, 24, 32, 40]
    x, a, b = torch.randn(30, 48), torch.randn(3, R, 48), torch.randn(R, 40)
    y0 = torch.randn(30, 40)
    buf = lora.lora_shrink_ref(x, a, meta)
    y = lora.lora_expand_ref(buf, b, offs, meta, y0.clone())
    want, want_buf = y0.double().clone(), torch.zeros_like(buf, dtype=torch.float64)
    for i, t in enumerate(meta.token_indices.tolist()):
        g = int(owner[t])
        r0, rk, sc = meta.row_start_cpu[g], meta.ranks_cpu[g], meta.scalings_cpu[g]
        for s in range(3):
            h = a[s, r0:r0 + rk].double() @ x[t].double()
            want_buf[s, i, :rk] = h
            want[t, offs[s]:offs[s + 1]] += sc * (h @ b[r0:r0 + rk, offs[s]:offs[s + 1]].double())
    assert kcases.rel_err(buf, want_buf) < 1e-6
    assert kcases.rel_err(y, want) < 1e-6
    assert torch.equal(y[owner == -1], y0[owner == -1])


def test_norm_rotary_silu_refs_vs_naive():
    torch.manual_seed(0)
    x, r, w = torch.randn(3, 10), torch.randn(3, 10), torch.randn(10)
    out, res = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
    s = (x + r).double()
    assert kcases.rel_err(out, s / (s.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()) < 1e-6
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    pos = torch.tensor([0, 5, 2, 9])
    cs = kcases.cos_sin_cache(10, 8, "cpu")
    q2, k2 = q.clone(), k.clone()
    rotary.rotary_embedding_ref(pos, q2, k2, cs)
    for t in range(4):  # neox: pair (j, j + D/2) rotated by angle pos * base^(-2j/D)
        for j in range(4):
            ang = float(pos[t]) * 10000.0 ** (-2 * j / 8)
            c, sn = torch.tensor(ang).cos(), torch.tensor(ang).sin()
            assert torch.allclose(q2[t, :, j], q[t, :, j] * c - q[t, :, j + 4] * sn, atol=1e-5)
            assert torch.allclose(k2[t, :, j + 4], k[t, :, j + 4] * c + k[t, :, j] * sn, atol=1e-5)
    xx = torch.randn(2, 6)
    assert torch.allclose(dispatch.silu_and_mul_ref(xx), xx[:, :3] / (1 + (-xx[:, :3]).exp()) * xx[:, 3:])
    a = xx[:, :3].double()
    gelu = 0.5 * a * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (a + 0.044715 * a ** 3)))
    assert torch.allclose(dispatch.gelu_tanh_and_mul_ref(xx).double(), gelu * xx[:, 3:].double(), atol=1e-6)


def test_dispatch_choice(monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.delenv("LOOM_FORCE_TRITON", raising=False)
    assert not dispatch.use_triton(x)
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    assert dispatch.use_triton(x)
    assert torch.allclose(kernels.silu_and_mul(x), dispatch.silu_and_mul_ref(x))
