"""loom: an LLM serving engine for NVIDIA Triton Inference Server (paged KV cache, continuous batching, multi-LoRA).

Layers, imports pointing one way: `serving` (the Triton-facing front) -> `engine` (scheduler, KV blocks,
model runner, sampler; the offline API in `engine.llm`) -> `lora`, `models`, `layers` -> `kernels`.
`model.py` is the Triton Python-backend entry point. Importing this package has no side effects.
"""
