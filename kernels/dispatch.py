"""The one place that picks an implementation: Triton for CUDA tensors, or everywhere when
LOOM_FORCE_TRITON=1 (with TRITON_INTERPRET=1 on CPU, for engine parity tests); on CPU, the C++ kernels
(kernels/cpu_*.py: they run the reference themselves for what they do not take, and everywhere with
LOOM_CPU_KERNELS=0); the reference otherwise."""
from __future__ import annotations

import os

import torch

from loom.kernels.activation import (  # noqa: F401  (tests reach silu_and_mul_ref here)
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from loom.kernels.cpu_argmax import argmax_cpu
from loom.kernels.cpu_lora import lora_apply_cpu
from loom.kernels.cpu_paged_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu, store_kv_cpu
from loom.kernels.cpu_pointwise import (
    fused_add_rms_norm_cpu,
    gelu_tanh_and_mul_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
)
from loom.kernels.kv_store import store_kv_triton
from loom.kernels.lora import lora_expand_triton, lora_shrink_triton
from loom.kernels.moe import fused_moe_lora_ref, fused_moe_ref, fused_moe_triton
from loom.kernels.norm import fused_add_rms_norm_triton
from loom.kernels.paged_decode_attention import paged_decode_attention_triton
from loom.kernels.paged_prefill_attention import paged_prefill_attention_triton
from loom.kernels.rotary import rotary_embedding_triton, rotary_store_kv_triton


def use_triton(t: torch.Tensor) -> bool:
    # env read per call (a dict lookup) so tests may flip it after import
    return t.is_cuda or os.environ.get("LOOM_FORCE_TRITON") == "1"


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    return (store_kv_triton if use_triton(k) else store_kv_cpu)(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, sliding_window=None,
                           softcap=None):
    fn = paged_decode_attention_triton if use_triton(q) else paged_decode_attention_cpu
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out, sliding_window=sliding_window,
              softcap=softcap)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale,
                            out=None, sliding_window=None, softcap=None):
    fn = paged_prefill_attention_triton if use_triton(q) else paged_prefill_attention_cpu
    return fn(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, out=out,
              sliding_window=sliding_window, softcap=softcap)


def fused_add_rms_norm(x, residual, weight, eps):
    return (fused_add_rms_norm_triton if use_triton(x) else fused_add_rms_norm_cpu)(x, residual, weight, eps)


def rotary_embedding(positions, q, k, cos_sin_cache):
    """Neox rope on the leading cos_sin_cache.shape[1] dims of each head of q [T, H, D] and k [T, KVH, D], in
    place (the rows may be strided views into the q|k|v projection)."""
    if use_triton(q):
        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    rot = cos_sin_cache.shape[-1]  # the CPU kernel rotates all the dims of the views it is given
    rotary_embedding_cpu(positions, q[..., :rot], k[..., :rot], cos_sin_cache)


def rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """rotary_embedding(positions, q, k, cos_sin_cache), then store_kv(k, v, ...): one Triton launch."""
    if use_triton(q):
        return rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv_cpu(k, v, k_cache, v_cache, slot_mapping)


def silu_and_mul(x):
    return (silu_and_mul_triton if use_triton(x) else silu_and_mul_cpu)(x)


def argmax(x):
    """x [T, V] -> int64 [T], torch.argmax(x, dim=-1): one C++ pass per row on CPU."""
    return x.argmax(dim=-1) if x.is_cuda else argmax_cpu(x)


def gelu_tanh_and_mul(x):
    return (gelu_tanh_and_mul_triton if use_triton(x) else gelu_tanh_and_mul_cpu)(x)


def fused_moe(x, w13, w2, topk_weights, topk_ids, out=None):
    return (fused_moe_triton if use_triton(x) else fused_moe_ref)(x, w13, w2, topk_weights, topk_ids, out=out)


def fused_moe_lora(x, w13, w2, topk_weights, topk_ids, lora, meta, out=None):
    # PyTorch on every device: the expert-LoRA path has no Triton kernel yet
    return fused_moe_lora_ref(x, w13, w2, topk_weights, topk_ids, lora, meta, out=out)


def lora_apply(x, y, lora_a, lora_b, slice_offsets, meta):
    """y += the LoRA deltas of meta's adapter groups, in place: Triton's shrink then expand launches, or one C++
    pass on CPU."""
    if not use_triton(x):
        return lora_apply_cpu(x, y, lora_a, lora_b, slice_offsets, meta)
    return lora_expand_triton(lora_shrink_triton(x, lora_a, meta), lora_b, slice_offsets, meta, y)
