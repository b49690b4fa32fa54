"""Each op's implementation: Triton, loom's C++ CPU kernels or the PyTorch reference, as kernels/policy.py decides for
the call's tensors (for an engine's tensors, the engine's decision); a C++ kernel only for tensors its module's
`takes_*` accepts, the reference otherwise. What an engine sets up around the ops (weights packed for the C++ GEMM,
the C++ layer pass: engine/worker/cpu.py) follows the same decision.

k_scale / v_scale are an fp8 KV cache's per-tensor scales (kernels/kv_fp8.py; 1.0 and unused for a cache in the
activations' dtype). The C++ kernels take float32 / bfloat16 caches only, so an fp8 cache runs the references on CPU
(their takes_* refuse it)."""
from __future__ import annotations

import torch

from loom.kernels import cpu_argmax, cpu_lora, cpu_paged_attention, cpu_pointwise
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
from loom.kernels.cpu_quant import PackedQuantWeight, quant_linear_ref
from loom.kernels.cpu_quant_bf16 import PackedQuantBf16
from loom.kernels.kv_store import store_kv_ref, store_kv_triton
from loom.kernels.lora import lora_apply_triton, lora_expand_ref, lora_shrink_ref
from loom.kernels.moe import fused_moe_lora_ref, fused_moe_ref, fused_moe_triton
from loom.kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton
from loom.kernels.paged_decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
from loom.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton
from loom.kernels.policy import CPU, TRITON, for_tensor
from loom.kernels.quant_gemm import quant_gemm_triton
from loom.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton, rotary_store_kv_triton


def use_triton(t: torch.Tensor) -> bool:
    return for_tensor(t).ops == TRITON


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    ops = for_tensor(k).ops
    if ops == TRITON:
        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if ops == CPU and cpu_paged_attention.takes_store_kv(k, v, k_cache, v_cache, slot_mapping):
        return store_kv_cpu(k, v, k_cache, v_cache, slot_mapping)
    return store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _attention(q, k_cache, v_cache, out, sliding_window, softcap, k_scale, v_scale, triton, cpu, ref):
    """The implementation, and the keyword arguments it takes beyond the common ones (the C++ kernels: no scales)."""
    ops = for_tensor(q).ops
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if ops == TRITON:
        return triton, scales
    if ops == CPU and cpu_paged_attention.takes_attention(q, k_cache, v_cache, out, sliding_window, softcap):
        return cpu, {}
    return ref, scales


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, sliding_window=None,
                           softcap=None, k_scale=1.0, v_scale=1.0):
    fn, kw = _attention(q, k_cache, v_cache, out, sliding_window, softcap, k_scale, v_scale,
                        paged_decode_attention_triton, paged_decode_attention_cpu, paged_decode_attention_ref)
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out, sliding_window=sliding_window,
              softcap=softcap, **kw)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale,
                            out=None, sliding_window=None, softcap=None, k_scale=1.0, v_scale=1.0):
    fn, kw = _attention(q, k_cache, v_cache, out, sliding_window, softcap, k_scale, v_scale,
                        paged_prefill_attention_triton, paged_prefill_attention_cpu, paged_prefill_attention_ref)
    return fn(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, out=out,
              sliding_window=sliding_window, softcap=softcap, **kw)


def rope_store_decode_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                                seq_lens, scale, out=None, sliding_window=None, softcap=None, k_scale=1.0,
                                v_scale=1.0, split_counters=None):
    """Decode rows (one token per sequence): rotary_store_kv, then paged_decode_attention; on Triton one launch
    (flash-decoding included: it merges its partitions in that launch, with split_counters' tickets), which leaves q
    and k as they were (only the caches and out are written). k_scale, v_scale: an fp8 cache's scales."""
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
                                             sliding_window=sliding_window, softcap=softcap,
                                             rope_store=(positions, k, v, cos_sin_cache, slot_mapping),
                                             k_scale=k_scale, v_scale=v_scale, split_counters=split_counters)
    rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
                                  sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)


def fused_add_rms_norm(x, residual, weight, eps):
    ops = for_tensor(x).ops
    if ops == TRITON:
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if ops == CPU and cpu_pointwise.takes_rms_norm(x, residual, weight):
        return fused_add_rms_norm_cpu(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary_embedding(positions, q, k, cos_sin_cache):
    """Neox rope on the leading cos_sin_cache.shape[1] dims of each head of q [T, H, D] and k [T, KVH, D], in
    place (the rows may be strided views into the q|k|v projection)."""
    ops = for_tensor(q).ops
    if ops == TRITON:
        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    rot = cos_sin_cache.shape[-1]  # the CPU kernel rotates all the dims of the views it is given
    q, k = q[..., :rot], k[..., :rot]
    if ops == CPU and cpu_pointwise.takes_rotary(positions, q, k, cos_sin_cache):
        rotary_embedding_cpu(positions, q, k, cos_sin_cache)
    else:
        rotary_embedding_ref(positions, q, k, cos_sin_cache)


def rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """rotary_embedding(positions, q, k, cos_sin_cache), then store_kv(k, v, ...): one Triton launch."""
    if use_triton(q):
        return rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale,
                                      v_scale)
    rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _act_and_mul(x, triton, cpu, ref):
    ops = for_tensor(x).ops
    if ops == TRITON:
        return triton(x)
    return (cpu if ops == CPU and cpu_pointwise.takes_act_and_mul(x) else ref)(x)


def silu_and_mul(x):
    return _act_and_mul(x, silu_and_mul_triton, silu_and_mul_cpu, silu_and_mul_ref)


def gelu_tanh_and_mul(x):
    return _act_and_mul(x, gelu_tanh_and_mul_triton, gelu_tanh_and_mul_cpu, gelu_tanh_and_mul_ref)


def argmax(x):
    """x [T, V] -> int64 [T], torch.argmax(x, dim=-1) (the reference: there is no Triton argmax); one C++ pass per
    row on CPU."""
    if for_tensor(x).argmax == CPU and cpu_argmax.takes_argmax(x):
        return argmax_cpu(x)
    return x.argmax(dim=-1)


def fused_moe(x, w13, w2, topk_weights, topk_ids, out=None):
    # the C++ experts run over packed weights (kernels/cpu_moe.py), not through here
    return (fused_moe_triton if use_triton(x) else fused_moe_ref)(x, w13, w2, topk_weights, topk_ids, out=out)


def fused_moe_lora(x, w13, w2, topk_weights, topk_ids, lora, meta, out=None):
    # PyTorch on every device: the expert-LoRA path has no Triton kernel yet
    return fused_moe_lora_ref(x, w13, w2, topk_weights, topk_ids, lora, meta, out=out)


def lora_apply(x, y, lora_a, lora_b, slice_offsets, meta):
    """y += the LoRA deltas of meta's adapter groups, in place: on Triton one fused launch for few tokens per adapter
    (decode), else shrink then expand; one C++ pass on CPU."""
    ops = for_tensor(x).ops
    if ops == TRITON:
        return lora_apply_triton(x, y, lora_a, lora_b, slice_offsets, meta)
    if ops == CPU and cpu_lora.takes(x, lora_a, lora_b, y):
        return lora_apply_cpu(x, y, lora_a, lora_b, slice_offsets, meta)
    if ops == CPU and cpu_lora.takes_bf16(x, lora_a, lora_b, y):
        return cpu_lora.lora_apply_cpu_bf16(x, y, lora_a, lora_b, slice_offsets, meta)
    return lora_expand_ref(lora_shrink_ref(x, lora_a, meta), lora_b, slice_offsets, meta, y)


def quant_linear(x, w, bias=None):
    """x @ dequant(w)^T + bias for a weight kept quantized (layers/quant_linear.py): w a QuantizedWeight (Triton's
    weight-only kernel on CUDA) or a cpu_quant.PackedQuantWeight / cpu_quant_bf16.PackedQuantBf16 (re-laid out at
    start where a C++ kernel runs); the reference, dequantize + F.linear, otherwise."""
    path = for_tensor(x).quant
    if path == TRITON and not isinstance(w, (PackedQuantWeight, PackedQuantBf16)):
        return quant_gemm_triton(x, w, bias)
    if path == CPU and isinstance(w, (PackedQuantWeight, PackedQuantBf16)):
        return w(x, bias)
    return quant_linear_ref(x, w, bias)


def quant_linear_parts(x, parts, bias=None):
    """x @ W^T (+ bias) for a weight kept quantized as parts along the output dimension ((first row, weight) pairs in
    order): one quant_linear each, concatenated."""
    if len(parts) == 1:
        return quant_linear(x, parts[0][1], bias)
    y = torch.cat([quant_linear(x, w, None) for _, w in parts], dim=-1)
    return y if bias is None else y + bias.to(y.dtype)
