"""Loading: weights are allocated once, in the target dtype (never a float32 copy first: twice the weights at the
peak), and each distinct rope has one cos/sin cache for the whole model."""
from __future__ import annotations

import torch
from torch import nn

from loom.layers.rotary import RotaryEmbedding
from loom.models.loader import load_model


def test_weights_are_allocated_in_the_target_dtype(tiny_model, monkeypatch):
    _, path = tiny_model("llama")
    allocated = []
    orig = nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        allocated.extend({p.dtype for p in self.parameters()})
        return orig(self, device=device, recurse=recurse)

    monkeypatch.setattr(nn.Module, "to_empty", spy)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), 64)
    assert set(allocated) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ropes = {m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert all(r.cos_sin_cache.dtype == torch.float32 and r.cos_sin_cache.shape[0] == 64 for r in ropes)


def test_one_rope_cache_per_model(tiny_model):
    for family, distinct in (("llama", 1), ("gemma3", 2)):  # Gemma 3: a separate rope for its sliding layers
        _, path = tiny_model(family)
        model, _ = load_model(path, torch.float32, torch.device("cpu"), 128)
        layers = model.model.layers
        caches = {layer.self_attn.rotary.cos_sin_cache.data_ptr() for layer in layers}
        assert len(layers) > 1 and len(caches) == distinct, family
