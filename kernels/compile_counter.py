"""Count Triton JIT compiles in a region: a compile in the middle of serving stalls every request of that step
(seconds for a fresh kernel, milliseconds even from Triton's disk cache), so after warm-up the count must be 0.

    with JitCompileCounter() as c:
        engine.step()
    c.count, c.kernels   # in-process kernel-cache misses since __enter__, and the kernels' names

It chains Triton's post-compile hook (restored on exit), so it is per region, not global state. A miss is
counted whether the binary comes from a fresh compile or from Triton's disk cache. Under TRITON_INTERPRET=1
nothing is compiled and the count stays 0.
"""
from __future__ import annotations


def _hook_owner():
    """(object, attribute) holding the post-compile hook in this Triton version, or None."""
    try:
        from triton import knobs  # triton >= 3.4

        if hasattr(knobs.runtime, "jit_post_compile_hook"):
            return knobs.runtime, "jit_post_compile_hook"
    except ImportError:
        pass
    from triton.runtime.jit import JITFunction  # triton 3.0 - 3.3

    if hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "compiled_hook"
    return None


def is_supported() -> bool:
    return _hook_owner() is not None


class JitCompileCounter:
    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._owner = None
        self._prev = None

    @property
    def count(self) -> int:
        return len(self.kernels)

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.kernels.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0])
        if self._prev is not None:
            return self._prev(*args, **kwargs)
        return None

    def __enter__(self) -> "JitCompileCounter":
        owner = _hook_owner()
        if owner is None:
            raise NotImplementedError("this Triton version has no post-compile hook")
        self._owner = owner
        self._prev = getattr(*owner)
        setattr(*owner, self._hook)
        return self

    def __exit__(self, *exc) -> None:
        obj, attr = self._owner
        if getattr(obj, attr) == self._hook:  # restore only what we installed
            setattr(obj, attr, self._prev)
        self._owner = None
