"""Gated activations of the MLP, computed in float32: act(x[:, :I]) * x[:, I:] for x [T, 2I].

silu_and_mul: SiLU (Llama, Mistral, Qwen, Phi-3, the MoE experts); gelu_tanh_and_mul: GELU with the tanh
approximation (Gemma's gelu_pytorch_tanh), written as x * sigmoid(2u) = 0.5 x (1 + tanh(u)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, I, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    a = tl.load(x_ptr + t * stride_xt + cols, mask=mask).to(tl.float32)
    b = tl.load(x_ptr + t * stride_xt + I + cols, mask=mask).to(tl.float32)
    if GELU_TANH:  # u = sqrt(2/pi) * (a + 0.044715 a^3)
        y = a * tl.sigmoid(2.0 * 0.7978845608028654 * (a + 0.044715 * a * a * a)) * b
    else:
        y = a * tl.sigmoid(a) * b
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul_triton(x, gelu_tanh):
    T, two_i = x.shape
    inter = two_i // 2
    assert x.stride(-1) == 1
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(T, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block,
                                                         GELU_TANH=gelu_tanh)
    return out


def silu_and_mul_triton(x):
    return _act_and_mul_triton(x, False)


def gelu_tanh_and_mul_triton(x):
    return _act_and_mul_triton(x, True)


def silu_and_mul_ref(x):
    inter = x.shape[-1] // 2
    if x.dtype == torch.float32:
        return F.silu(x[:, :inter]) * x[:, inter:]
    return (F.silu(x[:, :inter].float()) * x[:, inter:].float()).to(x.dtype)


def gelu_tanh_and_mul_ref(x):
    inter = x.shape[-1] // 2
    if x.dtype == torch.float32:
        return F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]
    return (F.gelu(x[:, :inter].float(), approximate="tanh") * x[:, inter:].float()).to(x.dtype)
