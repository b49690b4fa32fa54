"""Rotary position embedding: the cos/sin cache (incl. Llama-3 scaling) built once; the kernel applies it."""
from __future__ import annotations

import math

import torch
from torch import nn

from loom.kernels import rotary_embedding


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(rotary_dim: int, max_position: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_position, rotary_dim]: cos in the first half, sin in the second (float32, as transformers computes)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        else:  # loom.models.spec refuses other types before a model is built
            raise ValueError(f"rope type {kind!r} is not supported")
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rope on the first rotary_dim dims of each head (all of them unless partial rotary)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_sin_cache", cos_sin_cache(rotary_dim, max_position, theta, scaling),
                             persistent=False)

    def rebuild(self, device) -> None:
        """Non-persistent buffers are lost when a model built on the meta device is materialised."""
        self.cos_sin_cache = cos_sin_cache(self.rotary_dim, self.max_position, self.theta, self.scaling).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """In place on q [T, H, head_dim] and k [T, KVH, head_dim]: their leading rotary_dim dims."""
        rotary_embedding(positions, q, k, self.cos_sin_cache)
