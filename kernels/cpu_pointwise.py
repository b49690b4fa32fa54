"""The pointwise work between the GEMMs on CPU, one C++ call each (kernels/cpu_ext.py) instead of about ten
small torch ops: fused_add_rms_norm, rotary_embedding (in place), silu_and_mul, gelu_tanh_and_mul. Same signatures
and float32 math as the references (norm.py, rotary.py, activation.py), which run for anything else - and under
torch.compile, where inductor fuses them into its own loops (ctypes calls cannot be traced)."""
from __future__ import annotations

import torch

from loom.kernels import cpu_ext
from loom.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from loom.kernels.norm import fused_add_rms_norm_ref
from loom.kernels.rotary import rotary_embedding_ref


def _lib():
    return None if torch.compiler.is_compiling() else cpu_ext.load()


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(-1) == 1


def fused_add_rms_norm_cpu(x, residual, weight, eps):
    lib = _lib()
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if lib is None or not cpu_ext.usable(*tensors) or not _rows(x) or (residual is not None and not _rows(residual)) \
            or not weight.is_contiguous():
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    T, N = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    if T:
        lib.loom_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                          0 if residual is None else residual.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                          out.stride(0), res_out.data_ptr(), res_out.stride(0), T, N, cpu_ext.nthreads())
    return out, res_out


def _heads(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(-1) == 1


def rotary_embedding_cpu(positions, q, k, cos_sin_cache):
    lib = _lib()
    if lib is None or not cpu_ext.usable(q, k, cos_sin_cache) or not (_heads(q) and _heads(k)) \
            or not cos_sin_cache.is_contiguous() or positions.dtype != torch.int64 or not positions.is_contiguous():
        return rotary_embedding_ref(positions, q, k, cos_sin_cache)
    T = q.shape[0]
    if T:
        lib.loom_rotary(positions.data_ptr(), cos_sin_cache.data_ptr(), q.shape[2], q.data_ptr(), q.stride(0),
                        q.stride(1), q.shape[1], k.data_ptr(), k.stride(0), k.stride(1), k.shape[1], T,
                        cpu_ext.nthreads())


def _act_and_mul(x, kernel: str, ref):
    lib = _lib()
    if lib is None or not cpu_ext.usable(x) or not _rows(x):
        return ref(x)
    T, two_i = x.shape
    out = torch.empty((T, two_i // 2), dtype=x.dtype)
    if T:
        getattr(lib, kernel)(x.data_ptr(), x.stride(0), out.data_ptr(), T, two_i // 2, cpu_ext.nthreads())
    return out


def silu_and_mul_cpu(x):
    return _act_and_mul(x, "loom_silu_mul", silu_and_mul_ref)


def gelu_tanh_and_mul_cpu(x):
    return _act_and_mul(x, "loom_gelu_tanh_mul", gelu_tanh_and_mul_ref)
