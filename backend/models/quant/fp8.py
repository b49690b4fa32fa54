"""HF fine-grained FP8 checkpoints (`quant_method: fp8`, DeepSeek-V3 style): weight + weight_scale_inv per linear.

weight is float8_e4m3fn [out, in]; weight_scale_inv holds one scale per weight_block_size block,
[ceil(out / block[0]), ceil(in / block[1])] (float32, or UE8M0 with scale_fmt "ue8m0"), or one scale for the whole
weight when weight_block_size is null. Despite its name it multiplies: w = weight * weight_scale_inv[block].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.models.quant.base import QuantMethod, fail, need
from loom.models.quant.weight import QuantizedWeight, meta_weight


@dataclass(frozen=True)
class FineGrainedFp8(QuantMethod):
    block: tuple[int, int] | None
    activations: str | None
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert

    marker = "weight_scale_inv"
    components = frozenset({"weight", "weight_scale_inv", "input_scale", "activation_scale"})

    @classmethod
    def parse(cls, q: dict) -> "FineGrainedFp8":
        block = q.get("weight_block_size", (128, 128))
        if block is not None:
            if not isinstance(block, (list, tuple)) or len(block) != 2 or \
                    not all(isinstance(b, int) and b > 0 for b in block):
                raise fail("weight_block_size", f"{block!r} is not supported (two positive ints, or null)")
            block = (int(block[0]), int(block[1]))
        act = str(q.get("activation_scheme", "dynamic")).lower()
        if act not in ("dynamic", "static"):
            raise fail("activation_scheme", f"{act!r} is not supported (dynamic or static)")
        if q.get("scale_fmt", "float") not in ("float", "ue8m0"):
            raise fail("scale_fmt", f"{q.get('scale_fmt')!r} is not supported (float or ue8m0)")
        if q.get("expert_dtype", "fp8") != "fp8":
            raise fail("expert_dtype", f"{q.get('expert_dtype')!r} is not supported; loom loads FP8 experts only")
        return cls(block, act, tuple(q.get("modules_to_not_convert") or ()))

    def quantizes(self, module: str) -> bool:
        return not any(m in module for m in self.not_converted)

    def layout(self, module: str, shape: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
        b = self.block
        rows = (1, 1) if b is None else (-(-shape[0] // b[0]), -(-shape[1] // b[1]))
        return meta_weight(shape, "fp8", 8, rows, torch.float32, block=b)

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        weight, scale = need(module, tensors, "weight"), need(module, tensors, "weight_scale_inv")
        if self.block is None:
            scale = scale.reshape(1, 1)
        return QuantizedWeight(shape=tuple(weight.shape), kind="fp8", bits=8, weight=weight, scale=scale,
                               block=self.block)
