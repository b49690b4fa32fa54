"""The LoRA tests run tiny models: one intra-op thread (tests/conftest.py: single_thread_torch)."""
import pytest


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""
