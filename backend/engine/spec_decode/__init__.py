"""Speculative decoding: prompt-lookup (n-gram) or draft-model proposals verified by the target in one forward.

`SpeculativeConfig` (EngineConfig.speculative_config) turns it on; `SpecDecoder` is the engine's side: it drafts
while the scheduler walks the running decodes (`DraftModel` proposes for the whole step first), verifies the drafted
rows after the forward, and asks `BackOff` whether a step should speculate at all. `DraftAdapters` gives a draft model
the adapters of its own that match the requests' target adapters (draft_adapter_roots).
"""
from loom.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
