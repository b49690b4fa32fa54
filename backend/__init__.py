"""loom: an LLM serving engine for NVIDIA Triton Inference Server (paged KV cache, continuous batching, multi-LoRA).

Layers, imports pointing one way: `serving` (the Triton-facing front) -> `engine` (scheduler, KV blocks,
model runner, sampler; the offline API in `engine.llm`) -> `lora`, `models`, `layers` -> `kernels`.
`model.py` is the Triton Python-backend entry point. Importing this package has no side effects: the offline
API (`from loom import LLM, SamplingParams`, as vLLM's) is imported on first use (PEP 562), so torch loads then.
"""
import importlib

# name -> the module that defines it
_LAZY = {
    "LLM": "loom.engine.llm",
    "RequestOutput": "loom.engine.llm",
    "CompletionOutput": "loom.engine.llm",
    "SamplingParams": "loom.engine.sampling_params",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'loom' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
