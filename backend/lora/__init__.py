"""Multi-LoRA serving: PEFT adapter loading, device pools of rank rows, the adapter registry.

Engine-facing API (see adapter_registry.py for the request flow):
  AdapterRegistry(config, model, device, dtype)
  AdapterRef, build_lora_meta(refs, num_tokens, device)
"""
from loom.lora.adapter_paths import resolve_adapter_path, validate_adapter_name
from loom.lora.adapter_registry import AdapterRef, AdapterRegistry, build_lora_meta
from loom.lora.lora_pool import LoraPool, RowAllocator
from loom.lora.peft_loader import (
    SUPPORTED_PROJS,
    AdapterLoadError,
    AdapterWeights,
    LoraGroupSpec,
    LoraModelSpec,
    load_peft_adapter,
    read_adapter_config,
)

__all__ = [
    "AdapterLoadError",
    "AdapterRef",
    "AdapterRegistry",
    "AdapterWeights",
    "LoraGroupSpec",
    "LoraModelSpec",
    "LoraPool",
    "RowAllocator",
    "SUPPORTED_PROJS",
    "build_lora_meta",
    "load_peft_adapter",
    "read_adapter_config",
    "resolve_adapter_path",
    "validate_adapter_name",
]
