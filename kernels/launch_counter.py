"""Count the device kernels a region launches, from outside: every Triton launch (compiled, or run by the
interpreter with TRITON_INTERPRET=1 on CPU) by kernel name, and every PyTorch op that launches a kernel, as a GEMM,
a copy or another kernel. Views and allocations launch nothing and are not counted; the tensor work the Triton
interpreter does around a launch is not either.

    with LaunchCounter() as c:
        c.label = "layer 0"           # launches are recorded under the label current at the time
        model(...)
    c.records                         # [(label, kind, name)], kind in triton / gemm / copy / other
    c.count(label=..., kind=...)

On CPU this counts what the same code launches on a GPU (scripts/launch_count.py): the dispatcher sees the same
ops, and the Triton launchers run as they would.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Under inference_mode the dispatcher also sees composite ops whole (linear, reshape, contiguous, to): one GEMM, or a
# copy only when the result is not a view of the input.
GEMMS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm, _aten.linear, _aten.matmul})
COPIES = frozenset({_aten.copy_, _aten.clone, _aten._to_copy, _aten.copy, _aten._copy_from})
COPIES_UNLESS_VIEW = frozenset({_aten.contiguous, _aten.reshape, _aten.flatten, _aten.to, _aten.type_as})
# no kernel: allocations, and views whose schema does not say so
NO_KERNEL = frozenset({_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
                       _aten._unsafe_view, _aten.lift_fresh, _aten.set_, _aten.sym_size, _aten.sym_stride,
                       _aten.sym_numel, _aten.sym_storage_offset, _aten.is_same_size})


def _aliases(out, x) -> bool:
    return isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and \
        out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def op_kind(func, args=(), out=None) -> Optional[str]:
    """gemm, copy, other, or None for an op that launches no kernel; `args` and `out`: the op's inputs and result."""
    packet = func.overloadpacket
    if packet in GEMMS:
        return "gemm"
    if packet in COPIES:
        return "copy"
    if packet in COPIES_UNLESS_VIEW:
        return None if args and _aliases(out, args[0]) else "copy"
    if func.is_view or packet in NO_KERNEL:
        return None
    return "other"


def _triton_classes() -> list:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return [JITFunction, InterpretedFunction]


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: "LaunchCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        out = func(*args, **(kwargs or {}))
        if not c._in_triton:
            kind = op_kind(func, args, out)
            if kind is not None:
                c.records.append((c.label, kind, str(func.overloadpacket).removeprefix("aten.")))
        return out


class LaunchCounter:
    def __init__(self) -> None:
        self.records: list[tuple] = []
        self.label = None
        self._in_triton = False
        self._saved: list = []
        self._mode: Optional[_Dispatch] = None

    def _wrap(self, cls):
        run = cls.run

        def counted_run(fn_self, *args, grid, warmup, **kwargs):
            if warmup or self._in_triton:
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            self.records.append((self.label, "triton", fn_self.fn.__name__))
            self._in_triton = True
            try:
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                self._in_triton = False

        return counted_run

    def __enter__(self) -> "LaunchCounter":
        for cls in _triton_classes():
            self._saved.append((cls, cls.__dict__["run"]))
            cls.run = self._wrap(cls)
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
        for cls, run in reversed(self._saved):
            cls.run = run
        self._saved.clear()

    def count(self, label=..., kind: Optional[str] = None) -> int:
        """Launches under `label` (any label if not given) of `kind` (all kinds if None)."""
        return sum(1 for lb, k, _ in self.records if (label is ... or lb == label) and (kind is None or k == kind))

    def by_kind(self, label=...) -> Counter:
        return Counter(k for lb, k, _ in self.records if label is ... or lb == label)

    def names(self, label=..., kind: Optional[str] = None) -> list[str]:
        return [n for lb, k, n in self.records if (label is ... or lb == label) and (kind is None or k == kind)]
