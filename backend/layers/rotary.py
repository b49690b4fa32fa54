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


def rope_parameters(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a config of transformers 4.x or 5.x."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or None
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return float(theta), scaling


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        # float32 throughout, the way transformers computes it, so float32 outputs match token for token.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        rotary_embedding(positions, q, k, self.cos_sin_cache)
