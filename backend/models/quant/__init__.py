"""Quantized checkpoints: one reader per format (compressed-tensors, GPTQ, AWQ, HF fine-grained FP8), each producing
the common QuantizedWeight, and one reference `dequantize`; `shard` cuts a tensor-parallel rank's part of one. The
loader keeps them quantized where a kernel takes them (models/quant_layers.py), else dequantises them at load."""
from loom.models.quant.base import QuantMethod
from loom.models.quant.checkpoint import checkpoint_tensors, quantized_modules
from loom.models.quant.config import METHODS, parse_quant_config
from loom.models.quant.weight import QuantizedWeight, dequantize, pack_int32, unpack_int32

__all__ = ["METHODS", "QuantMethod", "QuantizedWeight", "checkpoint_tensors", "dequantize", "pack_int32",
           "parse_quant_config", "quantized_modules", "unpack_int32"]
