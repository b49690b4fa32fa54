"""Shared test set-up: float32, deterministic, and the CPU tuning applied before torch loads."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run under the interpreter on CPU; it must be set before any @triton.jit is decorated.
# The engine still runs the PyTorch references on CPU unless LOOM_FORCE_TRITON=1.
os.environ.setdefault("TRITON_INTERPRET", "1")
from loom.engine.cpu import tune_mkl_for_amd  # noqa: E402

tune_mkl_for_amd()  # before torch loads MKL (the HF oracles run in this process too)
