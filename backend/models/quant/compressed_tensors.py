"""compressed-tensors checkpoints (llm-compressor, `quant_method: compressed-tensors`), as compressed-tensors 0.20
writes them (compressors/pack_quantized, compressors/naive_quantized):

- pack-quantized (W4A16, W8A16): weight_packed int32 [out, ceil(in * bits / 32)], value q + 2**(bits - 1) at bit
  bits * j of the row's bit string (for 4 and 8 bits: the canonical layout of QuantizedWeight as is); weight_shape
  [out, in]; asymmetric group/channel zero points weight_zero_point packed the same way along the output dimension
  (int32 [ceil(out * bits / 32), groups]).
- naive-quantized / int-quantized (int8): weight int8 [out, in], signed; zero points int8.
- float-quantized (FP8): weight float8_e4m3fn [out, in].
weight_scale is [1] (tensor), [out, 1] (channel), [out, in / group_size] (group) or [ceil(out / r), ceil(in / c)]
(block [r, c]); an older checkpoint's weight_g_idx gives each input column's group (act-order "group").
w = (q - zero) * scale. Each config group's `targets` ("Linear", exact module names, or "re:" regexes matched from
the start) chooses the scheme of a module, the first matching target winning; `ignore` lists unquantized modules,
which the checkpoint stores as plain weights.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loom.models.kv_scales import check_kv_cache_scheme
from loom.models.quant.base import QuantMethod, fail, need
from loom.models.quant.gptq import act_order
from loom.models.quant.weight import QuantizedWeight, meta_weight, num_groups, pack_int32, unpack_int32

INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class Scheme:
    targets: tuple[str, ...]
    format: str
    kind: str  # "int" | "fp8"
    bits: int
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool
    activations: str | None  # None (weight-only), "dynamic" or "static"

    def matches(self, module: str) -> str | None:
        """The target that selects this module, if any."""
        for t in self.targets:
            if t == module or t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)):
                return t
        return None


@dataclass(frozen=True)
class CompressedTensors(QuantMethod):
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...] = ()  # modules left unquantized: names or "re:" regexes

    marker = "weight_scale"
    components = frozenset({"weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                            "weight_g_idx", "input_scale", "input_zero_point"})

    @property
    def activations(self) -> str | None:
        return next((s.activations for s in self.schemes if s.activations), None)

    @classmethod
    def parse(cls, q: dict) -> "CompressedTensors | None":
        """None for a checkpoint whose only quantization is its KV cache scheme (llm-compressor's kv-cache-only
        recipe): its weights are dense, its K/V scales read where an fp8 cache uses them."""
        status = q.get("quantization_status", "compressed")
        if status != "compressed":
            raise fail("quantization_status", f"{status!r} is not supported; loom loads compressed checkpoints")
        check_kv_cache_scheme(q.get("kv_cache_scheme"))  # its scales: models/kv_scales.py, read for an fp8 cache
        for key in ("sparsity_config", "transform_config"):
            if q.get(key):
                raise fail(key, "is set; loom does not load it yet (weight quantization only)")
        groups = q.get("config_groups") or {}
        if not groups and q.get("kv_cache_scheme"):
            return None
        if not groups:
            raise fail("config_groups", "is empty: no quantization scheme to load")
        return cls(tuple(_scheme(f"config_groups.{name}", g, q.get("format")) for name, g in groups.items()),
                   tuple(q.get("ignore") or ()))

    def quantizes(self, module: str) -> bool:
        ignored = any(t == module or (t.startswith("re:") and re.match(t[3:], module)) for t in self.ignore)
        return not ignored and any(s.matches(module) for s in self.schemes)

    def layout(self, module: str, shape: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
        s = self.scheme(module)
        out, inp = shape
        rows = {"tensor": (1, 1), "channel": (out, 1), "group": (out, num_groups(inp, s.group_size))}.get(
            s.strategy) or (-(-out // s.block[0]), -(-inp // s.block[1]))
        # scales in the checkpoint's dtype, as compressed-tensors writes them
        return meta_weight(shape, s.kind, s.bits, rows, dtype, zero=not s.symmetric, group_size=s.group_size,
                           block=s.block)

    def scheme(self, module: str) -> Scheme:
        """The first scheme (in config order) one of whose targets selects the module."""
        for s in self.schemes:
            if s.matches(module):
                return s
        raise ValueError(f"{module}: quantized in the checkpoint, but no config_groups target selects it")

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        s = self.scheme(module)
        scale = need(module, tensors, "weight_scale")
        offset = 1 << (s.bits - 1)
        if s.kind == "fp8":
            weight = need(module, tensors, "weight")
            shape = tuple(weight.shape)
        elif s.format == "pack-quantized":
            weight = need(module, tensors, "weight_packed")
            shape = tuple(int(v) for v in need(module, tensors, "weight_shape").tolist())
        else:  # int8 stored as it is, signed
            signed = need(module, tensors, "weight")
            shape = tuple(signed.shape)
            weight = pack_int32(signed.to(torch.int32) + offset, s.bits)
        scale = scale.reshape(1, 1) if s.strategy == "tensor" else scale
        zero = None
        if not s.symmetric:
            zp = need(module, tensors, "weight_zero_point")
            if zp.dtype == torch.int32 and s.format == "pack-quantized" and s.strategy in ("group", "channel"):
                zero = unpack_int32(zp.t(), s.bits, shape[0]).t().contiguous()  # packed along the output dim
            else:
                zero = zp.to(torch.int32).reshape(scale.shape) + offset
        g_idx = act_order(tensors.get("weight_g_idx"), shape[1], s.group_size)
        return QuantizedWeight(shape=shape, kind=s.kind, bits=s.bits, weight=weight, scale=scale, zero=zero,
                               group_size=s.group_size, g_idx=g_idx, block=s.block)


def _scheme(where: str, g: dict, default_format: str | None) -> Scheme:
    w = g.get("weights")
    if not w:
        raise fail(f"{where}.weights", "is null; loom loads weight-quantized schemes only")
    if g.get("output_activations"):
        raise fail(f"{where}.output_activations", "is set; output activation quantization is not supported")
    fmt = g.get("format") or default_format
    kind = {"int": "int", "float": "fp8"}.get(str(w.get("type", "int")).lower())
    bits = w.get("num_bits", 8)
    if kind is None:
        raise fail(f"{where}.weights.type", f"{w.get('type')!r} is not supported (int or float)")
    if kind == "fp8" and (bits != 8 or fmt not in FLOAT_FORMATS):
        raise fail(f"{where}.weights.num_bits", f"float {bits}-bit weights in format {fmt!r} are not supported; "
                   f"loom loads FP8 (8-bit float) weights in {' / '.join(FLOAT_FORMATS)}")
    if kind == "int" and (bits not in (4, 8) or fmt not in INT_FORMATS or (bits == 4 and fmt != "pack-quantized")):
        raise fail(f"{where}.weights.num_bits", f"{bits}-bit int weights in format {fmt!r} are not supported; loom "
                   "loads 4-bit pack-quantized and 8-bit pack-quantized / naive-quantized int weights")
    strategy = str(w.get("strategy") or ("group" if (w.get("group_size") or 0) > 0 else "tensor")).lower()
    if strategy not in STRATEGIES:
        raise fail(f"{where}.weights.strategy", f"{strategy!r} is not supported ({', '.join(STRATEGIES)})")
    if w.get("dynamic"):
        raise fail(f"{where}.weights.dynamic", "dynamic weight quantization is not supported")
    symmetric = bool(w.get("symmetric", True))
    if kind == "fp8" and not symmetric:
        raise fail(f"{where}.weights.symmetric", "asymmetric FP8 weights are not supported")
    group_size = block = None
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0:
            raise fail(f"{where}.weights.group_size", f"{group_size!r} is not a positive group size")
    if strategy == "block":
        b = w.get("block_structure")
        if not isinstance(b, (list, tuple)) or len(b) != 2 or not all(isinstance(v, int) and v > 0 for v in b):
            raise fail(f"{where}.weights.block_structure", f"{b!r} is not two positive ints")
        block = (b[0], b[1])
    act = g.get("input_activations")
    activations = None if not act else ("dynamic" if act.get("dynamic") else "static")
    targets = g.get("targets") or []
    return Scheme(tuple(targets), fmt, kind, int(bits), strategy, group_size, block, symmetric, activations)
