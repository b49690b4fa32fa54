"""What every format reader provides, and the refusal helper that names the quantization_config field."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from loom.errors import ConfigError
from loom.models.quant.weight import QuantizedWeight


def fail(field_name: str, msg: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config.{field_name}", msg)


def read_int(q: dict, key: str, allowed: tuple[int, ...], what: str) -> int:
    v = q.get(key)
    if v not in allowed:
        raise fail(key, f"{v!r} is not supported; loom loads {what}")
    return int(v)


class QuantMethod(ABC):
    """One checkpoint format, read from its quantization_config. A module of the checkpoint is quantized when it has
    a tensor named `<module>.<marker>`; its tensors named `<module>.<component>` are handed to `read` together."""

    marker: ClassVar[str]
    components: ClassVar[frozenset[str]]
    activations: str | None = None  # "dynamic" / "static" activation quantization the checkpoint asks for, if any

    def quantizes(self, module: str) -> bool:
        """From the config alone (the memory plan): whether the checkpoint stores this linear module (its name in the
        checkpoint) quantized. Default: all of them (the formats' own lists of exceptions override it)."""
        return True

    @abstractmethod
    def layout(self, module: str, shape: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
        """What `read` gives for this module of this [out, in] shape, on the meta device (`meta_weight`): the memory
        plan's bytes. dtype: the checkpoint's float dtype (the scales' type where the format keeps them in it)."""

    @abstractmethod
    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The module's quantized weight from its component tensors (suffix -> tensor); ValueError if malformed."""


def need(module: str, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{module}: the checkpoint has no {module}.{name}")
    return tensors[name]
