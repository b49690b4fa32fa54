"""Fixtures for engine tests (the model factories and oracles live in scripts/harness/hf_models.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    from harness.default_model import ensure_default_model

    return str(ensure_default_model())
