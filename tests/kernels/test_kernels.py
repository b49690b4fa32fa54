"""Each Triton kernel against its reference in float32, float16 and bfloat16: on CPU under the Triton interpreter
(bfloat16 with the interpreter's bf16 dot and casts replaced by the GPU's numerics, harness.interpreter_bf16: it
checks indexing, masking and dtype handling, not the MMA's rounding); with LOOM_TEST_DEVICE=cuda compiled on the
GPU."""
import pytest
import torch

import harness.kernel_cases as kcases
from harness.interpreter_bf16 import gpu_bf16
from harness.suite_device import DEVICE, kernel_dtypes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning


def _params():
    seed = 0  # a fixed integer per case, so a failure reproduces with its id alone
    for name, (_, cases) in kcases.CASES.items():
        for i, case in enumerate(cases):
            for dt in kernel_dtypes():
                seed += 1
                yield pytest.param(name, case, dt, seed, id=f"{name}-{i}-{str(dt).split('.')[-1]}-seed{seed}")


@pytest.mark.parametrize("name,case,dtype,seed", list(_params()))
def test_triton_vs_ref(name, case, dtype, seed):
    torch.manual_seed(seed)
    with gpu_bf16(dtype == torch.bfloat16):
        kcases.CASES[name][0](dtype, DEVICE, **case)


@pytest.mark.parametrize("case", [dict(), dict(num_tokens=3, ranks=(100, 3), out_sizes=(40,))])
@pytest.mark.parametrize("dtype", kernel_dtypes())
def test_lora_fused_equals_shrink_then_expand(case, dtype):
    torch.manual_seed(5)
    with gpu_bf16(dtype == torch.bfloat16):
        kcases.check_lora_fused(dtype, DEVICE, exact=True, **case)


def test_jit_compile_counter():
    """The counter gpu_check uses for "no compiles after warm-up": a new kernel variant counts once, a cached
    one never; the interpreter compiles nothing; a hook installed before it keeps being called and is restored."""
    from loom.kernels.activation import silu_and_mul_triton
    from loom.kernels.compile_counter import JitCompileCounter, _hook_owner

    x = torch.randn(3, 10, device=DEVICE)  # I=5: a tile width (8) no kernel case uses
    with JitCompileCounter() as first:
        silu_and_mul_triton(x)
    with JitCompileCounter() as again:
        silu_and_mul_triton(x)
    assert again.count == 0
    if DEVICE == "cuda":
        assert first.kernels == ["_silu_and_mul_kernel"]
    else:
        assert first.count == 0

    owner, attr = _hook_owner()
    seen = []
    before = getattr(owner, attr)
    setattr(owner, attr, lambda **kw: seen.append(kw["repr"]))
    try:
        prev = getattr(owner, attr)
        with JitCompileCounter() as c:
            getattr(owner, attr)(key=None, repr="k[num_warps=4]()", fn=None, compile={}, is_manual_warmup=False,
                                 already_compiled=False)
        assert c.kernels == ["k"] and seen == ["k[num_warps=4]()"]
        assert getattr(owner, attr) is prev
    finally:
        setattr(owner, attr, before)


def test_decode_split_counters_must_cover_the_launch():
    """Flash-decoding takes one int32 ticket counter per (sequence, kv head): a buffer too small or of another type
    is refused by name, before anything is launched."""
    from loom.kernels.paged_decode_attention import paged_decode_attention_triton

    kc, vc, bt, sl = kcases.make_paged_cache([40, 9], 16, 2, 16, torch.float32, DEVICE)
    q = torch.randn(2, 4, 16, device=DEVICE)
    for bad in (torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match="split_counters"):
            paged_decode_attention_triton(q, kc, vc, bt, sl, 0.25, num_splits=2, block_n=16, split_counters=bad)
