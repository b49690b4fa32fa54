"""An fp8 KV cache's per-layer scales (kv_cache_dtype fp8, kernels/kv_fp8.py) from a checkpoint, as vLLM reads them.

llm-compressor / compressed-tensors checkpoints with a `kv_cache_scheme` (8-bit float, per tensor) store one scalar
per attention layer for K and one for V: `model.layers.N.self_attn.k_scale` / `v_scale` (older exports:
`...self_attn.k_proj.output_scale` / `v_proj.output_scale`, or one `kv_scale` for both). The cache holds
e4m3(x / scale). A layer without scales gets 1.0 (e4m3's range, +-448, holds K/V of usual models unscaled), as in
vLLM. The loader skips these tensors (is_kv_scale) whatever the kv_cache_dtype: with auto they are unused.
"""
from __future__ import annotations

import logging
import math
import re

from safetensors import safe_open

from loom.errors import ConfigError

log = logging.getLogger("loom")

_NAME = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.self_attn\."
                   r"(?:(?P<kind>k_scale|v_scale|kv_scale)|(?P<proj>k_proj|v_proj)\.output_scale)$")


def is_kv_scale(name: str) -> bool:
    return _NAME.match(name) is not None


def check_kv_cache_scheme(scheme: dict | None) -> None:
    """compressed-tensors' quantization_config.kv_cache_scheme: only what the fp8 cache is (8-bit float, one scale
    per tensor) is accepted."""
    if not scheme:
        return
    ok = scheme.get("num_bits") == 8 and scheme.get("type") == "float" and scheme.get("strategy") == "tensor"
    if not ok or scheme.get("dynamic"):
        raise ConfigError("config.json quantization_config.kv_cache_scheme",
                          f"{scheme!r} is not supported; loom's fp8 KV cache takes num_bits 8, type float, strategy "
                          "tensor, static scales")


def read_kv_scales(files: list[str], num_layers: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each layer from the checkpoint's safetensors `files`, 1.0 where absent."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    found = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _NAME.match(name)
                if m is None:
                    continue
                layer = int(m.group("layer"))
                t = f.get_tensor(name)
                value = float(t.float().flatten()[0]) if t.numel() == 1 else math.nan
                if layer >= num_layers or not (math.isfinite(value) and value > 0):
                    from loom.models.loader import ModelLoadError  # the loader imports this module

                    raise ModelLoadError(f"{path}: KV cache scale {name!r} must be one positive finite value of a "
                                         f"layer below {num_layers}, got shape {tuple(t.shape)} value {value}")
                kind = m.group("kind") or m.group("proj")[0] + "_scale"
                for i in {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}[kind]:
                    scales[layer][i] = value
                found += 1
    log.info("fp8 KV cache: %s", f"scales of {found} tensors from the checkpoint" if found else
             "no scales in the checkpoint, 1.0 for every layer")
    return [(k, v) for k, v in scales]
