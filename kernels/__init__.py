"""OpenAI Triton kernels for loom's hot paths, each beside a plain-PyTorch reference of the same signature.

`kernels.dispatch` is the one place that decides which implementation runs: the Triton kernel for CUDA
tensors; on CPU loom's C++ kernels (kernels/cpu_*.py) where they apply, the reference otherwise (or the Triton
kernel under TRITON_INTERPRET=1 when forced for tests).
"""

from loom.kernels.dispatch import (
    argmax,
    fused_add_rms_norm,
    fused_moe,
    fused_moe_lora,
    gelu_tanh_and_mul,
    lora_apply,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_embedding,
    silu_and_mul,
    store_kv,
)

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "fused_moe",
    "fused_moe_lora",
    "lora_apply",
    "argmax",
]
