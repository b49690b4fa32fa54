"""Speculative decoding: prompt-lookup (n-gram) proposals verified by the target model in one forward.

`SpeculativeConfig` (EngineConfig.speculative_config) turns it on; `SpecDecoder` is the engine's side: it drafts
while the scheduler walks the running decodes, and verifies the drafted rows after the forward.
"""
from loom.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
