"""A quantized checkpoint's tensors, with each quantized module's components gathered into one QuantizedWeight.

`checkpoint_tensors` yields (file, name, tensor) for every tensor the model takes: plain tensors as they are, and for
each quantized module `<module>.weight` as a QuantizedWeight, once all of its components (which may lie in different
shards) have been read. Nothing else is held: a module's components are dropped as soon as its weight is built.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open

from loom.models.quant.base import QuantMethod
from loom.models.quant.weight import QuantizedWeight


def quantized_modules(files: list[str], method: QuantMethod) -> dict[str, set[str]]:
    """Each module the checkpoint stores quantized (it has `<module>.<marker>`) -> the component suffixes it has, from
    the safetensors headers (no tensor read)."""
    every = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            every.update(f.keys())
    out = {}
    for n in every:
        module, _, suffix = n.rpartition(".")
        if suffix == method.marker:
            out[module] = {c for c in method.components if f"{module}.{c}" in every}
    return out


def checkpoint_tensors(files: list[str], method: QuantMethod | None, error: type[Exception] = ValueError,
                       lazy: bool = False) -> Iterator[tuple[str, str, torch.Tensor | QuantizedWeight]]:
    """`error`: what a module whose tensors do not fit its format raises (the loader's ModelLoadError). lazy (tensor
    parallelism): plain tensors come as safetensors slices, of which indexing reads only the rows a rank holds."""
    names = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names[path] = list(f.keys())
    # quantized module -> the component suffixes the checkpoint has for it
    expected = quantized_modules(files, method) if method is not None else {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names[path]:
                module, _, suffix = name.rpartition(".")
                if module not in expected or suffix not in method.components:
                    yield path, name, f.get_slice(name) if lazy else f.get_tensor(name)
                    continue
                parts = pending.setdefault(module, {})
                parts[suffix] = f.get_tensor(name)
                if len(parts) == len(expected[module]):
                    del pending[module]
                    try:
                        qw = method.read(module, parts)
                        qw.validate()
                    except ValueError as e:
                        raise error(f"{path}: {module}: {e}") from e
                    yield path, f"{module}.weight", qw
    if pending:
        module = sorted(pending)[0]
        raise error(f"{module}: the checkpoint lacks {sorted(expected[module] - set(pending[module]))}")
