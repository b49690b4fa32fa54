"""The draft model's adapters ("twins"): a request whose target adapter is `name` runs the draft with the draft's own
PEFT adapter `<root>/<name>` under speculative_config.draft_adapter_roots, when one exists, else without an adapter.

A twin is a draft adapter fine-tuned (or distilled) alongside the target's adapter of the same name, so the draft
proposes what the adapted target would say; without one a request's proposals come from the bare draft and are
accepted less often. Either way the tokens are the target's: a twin changes acceptance, never the output.

The twins live in an adapter registry of the draft's own (loom.lora.adapter_registry: its pools attached to the draft
model, its background loader, LRU rows), small: a quarter of lora_memory_bytes. Each twin is keyed by the target
adapter's version (loom.lora.adapter_version): when a request brings a newer version of `name` (the target adapter
was reloaded), the draft's `name` is unloaded and read again from disk, so a reloaded pair never pairs the new target
with the old twin; requests still on the older target version run the draft without one. A twin is used in a draft
forward only once its load has finished and its rows are placed (activate, never waiting): until then, when its rows
do not fit beside the step's other twins, or when it failed to load, the draft runs without it.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from loom.errors import RequestError
from loom.layers.forward_context import LoraBatchMeta
from loom.lora.adapter_registry import AdapterRef, AdapterRegistry

log = logging.getLogger("loom")

POOL_SHARE = 4  # the twins' pool: lora_memory_bytes / POOL_SHARE (a draft is a fraction of the target's size)


class DraftAdapters:
    def __init__(self, engine_config, runner):
        """runner: the draft's ModelRunner (its model gets the twins' pools)."""
        roots = list(engine_config.speculative_config.draft_adapter_roots)
        cfg = replace(runner.config, adapter_roots=roots, adapter_sources=[],
                      lora_memory_bytes=engine_config.lora_memory_bytes // POOL_SHARE, lora_expert_memory_bytes=0,
                      max_lora_rank=engine_config.max_lora_rank, max_host_adapters=engine_config.max_host_adapters)
        self.registry = AdapterRegistry(cfg, runner.model, runner.device,
                                        cfg.resolve_lora_dtype(runner.dtype))
        # target adapter name -> (the newest target version seen, its twin's ref or None: no twin)
        self._twins: dict[str, tuple[int, AdapterRef | None]] = {}
        self._active: list[AdapterRef] = []  # twins activated for the forward being built

    def close(self) -> None:
        self.registry.close()

    def prefetch(self, target: AdapterRef) -> None:
        """A request with this target adapter arrived: its twin's read from disk starts now, so that it is usually
        in place by the request's prefill (whose draft KV it shapes)."""
        self._current(target)

    def _current(self, target: AdapterRef) -> tuple[int, AdapterRef | None] | None:
        """The twin entry of the target adapter's name, refreshed for a newer target version; None: the target is an
        older version than the newest seen (its twin was replaced)."""
        name, version = target.name, target.version
        seen = self._twins.get(name)
        if seen is None or seen[0] < version:
            seen = self._twins[name] = (version, self._acquire(name, seen))
        return None if seen[0] > version else seen

    def twin(self, target: AdapterRef | None) -> AdapterRef | None:
        """The twin of a request's target adapter, activated for this forward (None: run the draft without one)."""
        seen = None if target is None else self._current(target)
        if seen is None:
            return None
        name, version = target.name, seen[0]
        ref = seen[1]
        if ref is None:
            return None
        try:
            if ref.error is not None:
                raise RequestError("lora_name", ref.error)
            if not ref.ready or not self.registry.activate(ref):
                return None  # still loading, or no rows free beside the step's other twins
        except RequestError as e:  # its load failed: the draft runs without it
            log.warning("draft adapter %r is not used: %s", name, e)
            self._twins[name] = (version, None)
            self.registry.release(ref)
            return None
        self._active.append(ref)
        return ref

    def _acquire(self, name: str, old: tuple[int, AdapterRef | None] | None) -> AdapterRef | None:
        """A twin for a new target version: the old one (if any) dropped, `<root>/<name>` read afresh."""
        reg = self.registry
        if old is not None and old[1] is not None:
            reg.release(old[1])
        if reg.tier_of(name):
            reg.unload(name)  # a reloaded target adapter: its twin is read again (it may have changed with it)
        try:
            return reg.acquire(name)
        except RequestError:  # no twin of that name under the roots (or one this draft cannot take)
            return None

    def meta(self, targets: list[AdapterRef | None], num_tokens: list[int]) -> LoraBatchMeta | None:
        """A draft forward's LoRA metadata: each row with its target adapter's twin (None: no row has one). The
        previous draft forward has finished by now (speculating steps are synchronous: a proposing forward ends in a
        host read of its tokens, a mirror forward before the step's own): the rows it pinned are released first."""
        for ref in self._active:
            self.registry.deactivate(ref)
        self._active = []
        refs = [self.twin(t) for t in targets]
        if not any(r is not None for r in refs):
            return None
        return self.registry.build_lora_meta(refs, num_tokens)
