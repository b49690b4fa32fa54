"""Record which compiled Triton variants code would need on a Hopper GPU, on a machine without one.

    with VariantRecorder() as rec:
        ...  # code that launches loom's Triton kernels on CPU tensors (LOOM_FORCE_TRITON=1, no TRITON_INTERPRET)
    rec.keys  # {(kernel name, specialisation, launch options)}: one entry per variant a GPU would compile

Every launch is bound exactly as Triton's JIT binds it for sm_90 (its own binder: constexprs, the integer and
pointer-alignment attributes it specialises on, and the launch options), which is the kernel-cache key up to the
kernel's source. Nothing is compiled and nothing runs: outputs keep what they were allocated with, which the
recorder makes zeros (torch.empty* allocate zeroed memory while it is active), so code downstream sees finite
values (e.g. uniform logits a sampler can draw from).
"""
from __future__ import annotations

import os


def _hashable(v):
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


class VariantRecorder:
    def __init__(self) -> None:
        assert os.environ.get("TRITON_INTERPRET") != "1", "recording needs real @jit functions"
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self._backend = make_backend(GPUTarget("cuda", 90, 32))
        self._binders: dict = {}
        self.keys: set = set()
        self.launches = 0
        self._orig = None

    def _run(self, fn, *args, grid, warmup, **kwargs):
        from triton.runtime.jit import create_function_from_signature

        binder = self._binders.get(fn)
        if binder is None:
            binder = self._binders[fn] = create_function_from_signature(fn.signature, fn.params, self._backend)
        _, spec, options = binder(*args, **kwargs)
        self.keys.add((fn.fn.__name__, _hashable(spec), _hashable(options)))
        self.launches += 1
        return None

    def __enter__(self) -> "VariantRecorder":
        from triton.runtime.jit import JITFunction

        rec = self
        self._orig = JITFunction.run

        def run(fn, *args, grid, warmup, **kwargs):
            return rec._run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = run
        import torch

        self._empty = empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
        torch.empty = lambda *a, **k: empty(*a, **k).zero_()
        torch.empty_like = lambda *a, **k: empty_like(*a, **k).zero_()
        torch.Tensor.new_empty = lambda t, *a, **k: new_empty(t, *a, **k).zero_()
        return self

    def __exit__(self, *exc) -> None:
        import torch
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._orig
        torch.empty, torch.empty_like, torch.Tensor.new_empty = self._empty

    def take(self) -> set:
        """The keys recorded so far, and start afresh."""
        keys, self.keys = self.keys, set()
        return keys


def describe(key) -> str:
    name, spec, options = key
    return f"{name}{list(spec)} {dict(options)}"
