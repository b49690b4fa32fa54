"""Multi-LoRA serving: PEFT adapter loading, device pools of rank rows, the adapter registry.

Engine-facing API (see adapter_registry.py for the request flow):
  AdapterRegistry(config, model, device, dtype)
  AdapterRef, build_lora_meta(refs, num_tokens, device)

Modules: adapter_registry (names, requests, the background loader), adapter_version (a version's record and
AdapterRef), residency (device rows per space, LRU eviction, host tier), batch_meta (per-step LoraBatchMeta),
lora_pool (the pools and their row allocator), peft_config (adapter_config.json and its refusals), peft_targets
(which modules a config selects, as PEFT matches them), peft_loader (the weights), model_spec (the model's LoRA
modules), adapter_paths (names and paths under the adapter roots), adapter_sources (adapters fetched on first use
from URI prefixes) and adapter_cache (their local disk cache), lora_stats (what the registry reports for metrics).
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
