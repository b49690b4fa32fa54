"""loom's opaque ops for torch.compile (namespace `loom`), registered with torch.library's low-level API.

A compiled graph calls them through the dispatcher: about 5-9 us a call this way, against about 80 us for a
`torch.library.custom_op` function (measured here, torch 2.13), which matters at a few hundred calls per step.
Eager code calls the Python functions directly and never pays either.
"""
from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("loom", "FRAGMENT")  # kept alive: the registrations live as long as it does


def define(schema: str, impl: Callable, fake: Callable) -> None:
    """schema: "name(args) -> ret" as in native_functions.yaml; impl runs on real tensors (any device), fake on
    fake tensors (shapes only) while torch.compile traces."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"loom::{name}", fake, lib=_LIB)
