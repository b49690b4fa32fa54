"""The pointwise work between the GEMMs on CPU, one C++ call each (kernels/cpu_ext.py) instead of about ten
small torch ops: fused_add_rms_norm, rotary_embedding (in place), silu_and_mul, gelu_tanh_and_mul. Same signatures
and float32 math as the references (norm.py, rotary.py, activation.py), on float32 or bfloat16 rows (bfloat16: widened,
float32 math, each result rounded once to bfloat16, as the references round). kernels/dispatch.py runs them where
kernels/policy.py chose the C++ kernels (never while torch.compile traces: ctypes calls cannot be traced, and
inductor fuses the references into its own loops) and the takes_* below say they take the call's tensors."""
from __future__ import annotations

import torch

from loom.kernels import cpu_ext


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(-1) == 1


def _heads(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(-1) == 1


def takes_rms_norm(x, residual, weight) -> bool:
    dt = cpu_ext.act_dtype(x) if residual is None else cpu_ext.act_dtype(x, residual)
    return (dt is not None and weight.is_cpu and weight.dtype in (dt, torch.float32) and _rows(x)
            and (residual is None or _rows(residual)) and weight.is_contiguous())


def takes_rotary(positions, q, k, cos_sin_cache) -> bool:
    return (cpu_ext.act_dtype(q, k) is not None and cpu_ext.usable(cos_sin_cache) and _heads(q) and _heads(k)
            and cos_sin_cache.is_contiguous() and positions.dtype == torch.int64 and positions.is_contiguous())


def takes_act_and_mul(x) -> bool:
    return cpu_ext.act_dtype(x) is not None and _rows(x)


def fused_add_rms_norm_cpu(x, residual, weight, eps):
    """float32 or bfloat16 rows (the weight in their dtype or float32); bfloat16: the sum rounded first, then
    normalised in float32, as the reference."""
    T, N = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    if T:
        args = (x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                0 if residual is None else residual.stride(0), weight.data_ptr())
        tail = (eps, out.data_ptr(), out.stride(0), res_out.data_ptr(), res_out.stride(0), T, N, cpu_ext.nthreads())
        if x.dtype == torch.float32:
            cpu_ext.built().loom_rms_norm(*args, *tail)
        else:
            cpu_ext.built().loom_rms_norm_bf16(*args, int(weight.dtype == torch.float32), *tail)
    return out, res_out


def rotary_embedding_cpu(positions, q, k, cos_sin_cache):
    T = q.shape[0]
    if T:
        fn = getattr(cpu_ext.built(), "loom_rotary" + cpu_ext.ACT_SUFFIX[q.dtype])
        fn(positions.data_ptr(), cos_sin_cache.data_ptr(), q.shape[2], q.data_ptr(), q.stride(0), q.stride(1),
           q.shape[1], k.data_ptr(), k.stride(0), k.stride(1), k.shape[1], T, cpu_ext.nthreads())


def _act_and_mul(x, kernel: str):
    T, two_i = x.shape
    out = torch.empty((T, two_i // 2), dtype=x.dtype)
    if T:
        getattr(cpu_ext.built(), kernel + cpu_ext.ACT_SUFFIX[x.dtype])(x.data_ptr(), x.stride(0), out.data_ptr(), T,
                                                                      two_i // 2, cpu_ext.nthreads())
    return out


def silu_and_mul_cpu(x):
    return _act_and_mul(x, "loom_silu_mul")


def gelu_tanh_and_mul_cpu(x):
    return _act_and_mul(x, "loom_gelu_tanh_mul")
