"""OpenAI Triton kernels for loom's hot paths, each beside a plain-PyTorch reference of the same signature.

Where they run is decided in `kernels.policy` (Triton on CUDA, or everywhere with LOOM_FORCE_TRITON=1 under
TRITON_INTERPRET=1 for tests; on CPU loom's C++ kernels, kernels/cpu_*.py, where they built; the references
otherwise), once per engine; `kernels.dispatch` applies it to each op, with the C++ kernel only for tensors it takes.

This folder is `loom.kernels`. Python started in the repository's root (`python -c`, a script or notebook there)
finds it as a top-level `kernels` too, the name of the Hugging Face package that transformers (>= 5.25) imports; found
under that name, it hands the import on to the installed package (_hand_over), so the root works like anywhere else.
"""


def _hand_over() -> bool:
    """Imported as `kernels`: load the installed package of that name (found on sys.path without this repository's
    root) in this module's place; False where there is none."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # what `import kernels` returns once this module's code has run
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over():
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
        rotary_store_kv,
        silu_and_mul,
        store_kv,
    )

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "fused_add_rms_norm",
    "rotary_embedding",
    "rotary_store_kv",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "fused_moe",
    "fused_moe_lora",
    "lora_apply",
    "argmax",
]
