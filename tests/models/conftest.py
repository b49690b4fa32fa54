"""Tiny random models of every family (scripts/harness/hf_models.py), built once per session, and the oracles."""
from __future__ import annotations

import pytest
import torch

from harness.hf_models import make_hf_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread_torch():
    """Tiny models: intra-op threads only add contention on a loaded 2-core box."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """family -> (transformers model, saved directory), built on first use."""
    cache: dict[str, tuple] = {}
    root = tmp_path_factory.mktemp("families")

    def get(family: str):
        if family not in cache:
            cache[family] = make_hf_model(family, root)
        return cache[family]

    return get
