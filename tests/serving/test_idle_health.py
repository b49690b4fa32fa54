"""An idle serving loop asks the engine for its health (about once a second): a rank that died while no request ran
makes the engine unhealthy, and the glue is told, without a request having to find it (fake engine)."""
from __future__ import annotations

import threading

import pytest

from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.serving import async_engine
from loom.serving.async_engine import AsyncEngine
from tests.serving.fake_engine import FakeEngine


def test_idle_loop_finds_a_dead_rank(monkeypatch):
    monkeypatch.setattr(async_engine, "IDLE_HEALTH_CHECK_S", 0.05)
    eng = FakeEngine()
    asked = threading.Event()
    reason: list[str] = []

    def check_health():
        asked.set()
        return reason[0] if reason else None

    eng.check_health = check_health
    told = threading.Event()
    ae = AsyncEngine(eng, on_unhealthy=lambda r: told.set())
    try:
        assert asked.wait(5) and ae.health() is None  # asked while healthy: nothing happens
        reason.append("tensor-parallel rank 1 (worker pid 7) exited with code -9")
        assert told.wait(5)
        assert ae.health() == reason[0]
        with pytest.raises(RequestError, match="tensor-parallel rank 1"):
            ae.submit("a", [0], SamplingParams())
    finally:
        ae.shutdown()
