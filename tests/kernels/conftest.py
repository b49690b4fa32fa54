import os
import sys

# The interpreter must be chosen before triton (and so kernels.*) is imported. If another conftest or test
# imported kernels first, the @jit functions are already compiled-mode and CPU launches would fail.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))  # for kcases
