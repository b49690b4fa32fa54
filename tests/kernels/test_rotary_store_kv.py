"""The fused rope + KV store (kernels/rotary.py: one launch rotates q and k in place and writes k and v into the
paged cache) against its reference, on strided views of a q|k|v projection as the model passes them: full and
partial rotary, a head dim that is not a power of two, tokens whose slot is -1. On CPU under the Triton interpreter
in float32 and float16; with LOOM_TEST_DEVICE=cuda compiled on the GPU."""
import pytest
import torch

import harness.kernel_cases as kcases
from harness.interpreter_bf16 import gpu_bf16
from harness.suite_device import DEVICE, kernel_dtypes
from loom.kernels import dispatch, rotary
from loom.kernels.kv_layout import block_size_of, kv_cache_shape, read_slots

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning

CASES = [dict(), dict(heads=4, kvh=4, d=32, rot=16), dict(heads=6, kvh=2, d=48, rot=32, block_size=8)]


def _inputs(dtype, T=7, heads=9, kvh=3, d=64, rot=None, block_size=16, num_blocks=3, max_pos=100):
    qkv = kcases.rnd(T, (heads + 2 * kvh) * d, dtype=dtype, device=DEVICE)
    q = qkv[:, :heads * d].view(T, heads, d)
    k = qkv[:, heads * d:(heads + kvh) * d].view(T, kvh, d)
    v = qkv[:, (heads + kvh) * d:].view(T, kvh, d)
    pos = torch.randint(0, max_pos, (T,), dtype=torch.int64).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:T].to(DEVICE)
    slots[T // 2] = -1  # not stored
    cache = kcases.rnd(2, *kv_cache_shape(num_blocks, block_size, kvh, d), dtype=dtype, device=DEVICE)  # slots not
    # written keep these
    cs = kcases.cos_sin_cache(max_pos, rot or d, DEVICE)
    return qkv, (q, k, v), pos, slots, (cache[0], cache[1]), cs


def _copies(qkv, views, cache, dtype=None):
    """The same views into a copy of qkv (cast to dtype), and copies of the caches."""
    qkv2 = qkv.to(dtype or qkv.dtype, copy=True)
    return tuple(qkv2.as_strided(t.shape, t.stride(), t.storage_offset()) for t in views), \
        tuple(c.to(dtype or c.dtype, copy=True) for c in cache)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", kernel_dtypes())
def test_rotary_store_kv_vs_reference(case, dtype):
    torch.manual_seed(0)
    qkv, (q, k, v), pos, slots, (kc, vc), cs = _inputs(dtype, **case)
    (qf, kf, vf), (kcf, vcf) = _copies(qkv, (q, k, v), (kc, vc), torch.float32)
    (qs, ks, vs), (kcs, vcs) = _copies(qkv, (q, k, v), (kc, vc))
    with gpu_bf16(dtype == torch.bfloat16):  # the interpreter's bf16 casts truncate; the GPU rounds to nearest
        rotary.rotary_store_kv_triton(pos, q, k, v, cs, kc, vc, slots)
    rotary.rotary_store_kv_ref(pos, qf, kf, vf, cs, kcf, vcf, slots)  # the oracle: float32 on the same inputs
    rotary.rotary_store_kv_ref(pos, qs, ks, vs, cs, kcs, vcs, slots)  # in dtype: what must be bit-equal
    kcases.assert_close(q.float(), qf, dtype, "rotated q")
    kcases.assert_close(k.float(), kf, dtype, "rotated k")
    kcases.assert_close(kc.float(), kcf, dtype, "k cache")
    assert torch.equal(vc, vcs), "v cache: v copied into the written slots, the others untouched"
    all_slots = torch.arange(kc.shape[0] * block_size_of(kc), device=DEVICE)
    kept = torch.ones_like(all_slots, dtype=torch.bool)
    kept[slots[slots >= 0]] = False
    assert torch.equal(read_slots(kc, all_slots[kept]), read_slots(kcs, all_slots[kept])), \
        "a k cache slot not written changed"
    stored = slots >= 0
    assert torch.equal(read_slots(kc, slots[stored]), k[stored]), "the k cache holds the rotated k"
    d, rot = q.shape[-1], cs.shape[-1]
    if rot < d:  # partial rotary: the dims past rotary_dim are the projection's own
        assert torch.equal(q[..., rot:], qs[..., rot:]) and torch.equal(k[..., rot:], ks[..., rot:])
    v_untouched = qkv[:, -v.shape[1] * d:].view_as(v)
    assert torch.equal(v_untouched, vs), "v is read, never written"


@pytest.mark.parametrize("case", CASES)
def test_dispatch_paths_agree(case, monkeypatch):
    """dispatch.rotary_store_kv on CPU (the C++ kernels, partial rotary on views of the leading dims) and forced onto
    the Triton kernel (one launch) give the same q, k and caches; so does rotary_embedding alone."""
    torch.manual_seed(1)
    qkv, (q, k, v), pos, slots, (kc, vc), cs = _inputs(torch.float32, **case)
    (q2, k2, v2), (kc2, vc2) = _copies(qkv, (q, k, v), (kc, vc))
    (q3, k3, _), _ = _copies(qkv, (q, k, v), (kc, vc))
    (q4, k4, _), _ = _copies(qkv, (q, k, v), (kc, vc))
    monkeypatch.delenv("LOOM_FORCE_TRITON", raising=False)
    dispatch.rotary_store_kv(pos, q, k, v, cs, kc, vc, slots)
    dispatch.rotary_embedding(pos, q3, k3, cs)
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    dispatch.rotary_store_kv(pos, q2, k2, v2, cs, kc2, vc2, slots)
    dispatch.rotary_embedding(pos, q4, k4, cs)
    for a, b, what in ((q, q2, "q"), (k, k2, "k"), (kc, kc2, "k cache"), (q3, q4, "q alone"), (k3, k4, "k alone"),
                       (q, q3, "q fused / alone")):
        kcases.assert_close(a, b, torch.float32, what)
    assert torch.equal(vc, vc2)
