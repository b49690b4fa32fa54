"""Tiny random models of every family (scripts/harness/hf_models.py), built once per session, and the oracles."""
from __future__ import annotations

import pytest

from harness.hf_models import make_hf_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


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
