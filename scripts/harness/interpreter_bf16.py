"""Run the bfloat16 kernel paths under the Triton interpreter (TRITON_INTERPRET=1): a test-only patch of two of its
builder methods, the GPU's bf16 numerics in place of the interpreter's broken ones.

Why: the interpreter (triton 3.6) stores bfloat16 as the raw uint16 bit patterns, and
- its `create_dot` calls np.matmul on them: a bf16 tl.dot multiplies the bit patterns as integers (results ~1e10;
  `python -m harness.interpreter_bf16` runs the repro below);
- its float32 -> bfloat16 cast (`cast_impl`: x.to(tl.bfloat16), a store of float32 values to a bf16 pointer) drops
  the low 16 bits, i.e. rounds toward zero, where the GPU's cvt.rn rounds to nearest even: twice the rounding error,
  and biased; casts between bf16 and float16 reinterpret the bits as integers.
  (Element-wise bf16 arithmetic, a * b on two bf16 tensors, is also integer arithmetic on the bits; the kernels
  do none, they widen to float32 first, and this module does not patch it.)

What the patch does: a dot with a bfloat16 operand widens both operands to float32 (exact: a bf16 value is a
float32 with the low 16 bits zero) and multiplies/accumulates in float32, then adds the accumulator. That is what a
GPU's bf16 MMA computes (bf16 x bf16 products are exact in fp32, accumulation in fp32) up to the order of the sums.
A cast to bfloat16 from a float type goes through float32 and rounds to nearest even; one from bf16 widens exactly.

The limit: a bf16 run under the patch checks the kernels' indexing, masking, tiling, dtype plumbing (what is cast
to bf16 before a dot or a store, e.g. P before P@V) and the online-softmax bookkeeping against the reference; it
does not check the MMA unit's rounding or summation order, nor codegen (that is scripts/kernel_compile_check.py),
nor performance. Other dots (fp16, fp32, fp8) and casts go to the interpreter's own implementation unchanged.

The kernels themselves are untouched: the patch lives on the interpreter's builder class, for the duration of
`gpu_bf16()`, and only when the interpreter is in use.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 bit patterns -> float32, exactly (the bf16 bits are the float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def _make_dot(orig):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar != tl.bfloat16 and b.dtype.scalar != tl.bfloat16:
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

        def f32(h):
            return _bf16_to_f32(h.data) if h.dtype.scalar == tl.bfloat16 else h.data.astype(np.float32)

        out = np.matmul(f32(a), f32(b), dtype=np.float32) + f32(d)
        if d.dtype.scalar == tl.bfloat16:  # a bf16 accumulator (out_dtype=tl.bfloat16): rounded once, at the end
            return TensorHandle(_f32_to_bf16(out), tl.bfloat16)
        return TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)

    return create_dot


def _make_cast(orig):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == d or tl.bfloat16 not in (s, d) or not (s.is_floating() and d.is_floating()):
            return orig(self, src, dst_type)
        x = _bf16_to_f32(src.data) if s == tl.bfloat16 else src.data.astype(np.float32)
        if d == tl.bfloat16:
            return TensorHandle(_f32_to_bf16(x), tl.bfloat16)
        return TensorHandle(x.astype(_get_np_dtype(d)), d)

    return cast_impl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def gpu_bf16(enable: bool = True):
    """Within the block, the interpreter's bf16 tl.dot widens to float32 and its casts to bf16 round to nearest even
    (see the module doc). A no-op when not interpreting (compiled kernels on a GPU use the real MMA) or when enable
    is False; nests, and restores the builder's methods on the way out."""
    if not (enable and interpreting()):
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder

    orig = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl
    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = _make_dot(orig[0]), _make_cast(orig[1])
    try:
        yield
    finally:
        InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = orig


def repro() -> float:
    """The interpreter's own bf16 dot on a 16x16 product: returns the max abs error against the float32 product
    of the same bf16 values (huge without the patch, ~1e-6 with it). Run under TRITON_INTERPRET=1."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(c_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=g).bfloat16(), torch.randn(16, 16, generator=g).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16)
    return (c - a.float() @ b.float()).abs().max().item()


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by repro()
    print(f"interpreter bf16 dot, max abs error: {repro():.3g}")
    with gpu_bf16():
        print(f"with gpu_bf16():                 {repro():.3g}")
