"""Shared test set-up: float32, deterministic, and the CPU tuning applied before torch loads.

LOOM_TEST_DEVICE=cuda runs the device-aware tests (tests/kernels/test_kernels.py, tests/engine/test_parity.py)
on the GPU: compiled kernels, no interpreter, bf16 with its own tolerance (see scripts/harness/suite_device.py).
"""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# On CPU the Triton kernels run under the interpreter; it must be set before any @triton.jit is decorated.
# The engine still runs the PyTorch references on CPU unless LOOM_FORCE_TRITON=1.
if os.environ.get("LOOM_TEST_DEVICE", "cpu").strip().lower() in ("", "cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loom.engine.worker.cpu import tune_mkl_for_amd  # noqa: E402

tune_mkl_for_amd()  # before torch loads MKL (the HF oracles run in this process too)


@pytest.fixture(scope="module")
def single_thread_torch():
    """One intra-op thread in this process while a module runs. On a 2-core box a second thread only contends with
    the other processes (a server's engine, other jobs): measured on a loaded box, the HF greedy oracle of the e2e
    tests took 47 s with 2 threads and 12-14 s with 1; tiny models are up to 50x slower with 2."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def pytest_configure(config):
    from harness import suite_device

    try:
        suite_device.check()
    except ValueError as e:
        raise __import__("pytest").UsageError(str(e)) from None

