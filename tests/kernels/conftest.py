import os

# The interpreter must be chosen before triton (and so loom.kernels.*) is imported. If another conftest or test
# imported the kernels first, the @jit functions are already compiled-mode and CPU launches would fail.
os.environ.setdefault("TRITON_INTERPRET", "1")
