import os

# The interpreter must be chosen before triton (and so loom.kernels.*) is imported. If another conftest or test
# imported the kernels first, the @jit functions are already compiled-mode and CPU launches would fail.
# LOOM_TEST_DEVICE=cuda runs them compiled on the GPU instead (tests/conftest.py).
if os.environ.get("LOOM_TEST_DEVICE", "cpu").strip().lower() in ("", "cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Imported after the interpreter choice above (it imports loom.kernels).
import pytest  # noqa: E402

from loom.kernels import cpu_ext  # noqa: E402


@pytest.fixture(scope="module", params=[name for name, _, _ in cpu_ext.ISAS] + ["no-avx2"])
def cpu_build(request):
    """The C++ kernels of one build (AVX-512 and AVX2/FMA intrinsics, and the plain loops a CPU without AVX2 gets),
    each cached on disk like the engine's: a module using it runs once per build. A build this CPU cannot execute is
    skipped, saying which flags it lacks (test_cpu_build compiles it all the same)."""
    missing = cpu_ext.missing_flags(request.param) if request.param != "no-avx2" else []
    if missing:
        pytest.skip(f"the {request.param} kernels need CPU flags this machine lacks: {', '.join(missing)}")
    flags = next((f for name, _, f in cpu_ext.ISAS if name == request.param), ())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_ext, "native_isa", lambda: flags)
        m = cpu_ext.load()
        assert m is not None, "the C++ CPU kernels failed to build (a compiler is part of the test set-up)"
        yield m
