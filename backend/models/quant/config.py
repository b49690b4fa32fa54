"""quantization_config -> the reader of its format, or a ConfigError naming the field loom does not load."""
from __future__ import annotations

from loom.models.quant.awq import Awq
from loom.models.quant.base import QuantMethod, fail
from loom.models.quant.compressed_tensors import CompressedTensors
from loom.models.quant.fp8 import FineGrainedFp8
from loom.models.quant.gptq import Gptq

METHODS = {"compressed-tensors": CompressedTensors, "gptq": Gptq, "awq": Awq, "fp8": FineGrainedFp8}


def parse_quant_config(q) -> QuantMethod | None:
    """The format reader for a config's quantization_config (a dict as config.json holds it, or a transformers
    QuantizationConfigMixin); None when there is none."""
    if not q:
        return None
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else {}
    method = q.get("quant_method")
    if method not in METHODS:
        raise fail("quant_method", f"{method!r} is not supported; loom loads {', '.join(sorted(METHODS))} "
                   "checkpoints (bitsandbytes and the rest are refused)")
    return METHODS[method].parse(q)
