"""harness/interpreter_bf16.py: the interpreter's own bf16 dot is wrong (the reason the patch exists: when a triton
upgrade fixes it, this test says so and the patch can go), the patched dot equals the float32 product of the bf16
values, casts to bf16 round to nearest even as on the GPU, and the builder is restored on exit."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder

from harness.interpreter_bf16 import gpu_bf16, interpreting, repro

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.skipif(not interpreting(), reason="the patch is for the Triton interpreter (CPU runs)")]


def test_interpreter_bf16_dot_is_wrong_and_patched():
    assert repro() > 1.0, "the interpreter's bf16 dot is right now: drop harness/interpreter_bf16.py's dot patch"
    before = (InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl)
    with gpu_bf16():
        assert repro() <= 1e-5
    assert (InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl) == before
    with gpu_bf16(enable=False):
        assert InterpreterBuilder.create_dot is before[0]


@triton.jit
def _cast_kernel(x_ptr, bf_ptr, st_ptr, h_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    tl.store(bf_ptr + r, x.to(tl.bfloat16))
    tl.store(st_ptr + r, x)  # float32 values stored through a bf16 pointer
    tl.store(h_ptr + r, x.to(tl.bfloat16).to(tl.float16))


def test_casts_round_to_nearest_even():
    x = torch.randn(1024) * 10
    x[:6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])  # two ties
    bf, st = torch.empty(1024, dtype=torch.bfloat16), torch.empty(1024, dtype=torch.bfloat16)
    h = torch.empty(1024, dtype=torch.float16)
    with gpu_bf16():
        _cast_kernel[(1,)](x, bf, st, h, N=1024)
    want = x.bfloat16()  # torch rounds to nearest even, as the GPU's cvt.rn.bf16.f32
    assert torch.equal(bf.view(torch.int16), want.view(torch.int16))
    assert torch.equal(st.view(torch.int16), want.view(torch.int16))
    assert torch.equal(h, want.half())
