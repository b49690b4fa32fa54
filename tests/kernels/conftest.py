import os

# The interpreter must be chosen before triton (and so loom.kernels.*) is imported. If another conftest or test
# imported the kernels first, the @jit functions are already compiled-mode and CPU launches would fail.
# LOOM_TEST_DEVICE=cuda runs them compiled on the GPU instead (tests/conftest.py).
if os.environ.get("LOOM_TEST_DEVICE", "cpu").strip().lower() in ("", "cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
