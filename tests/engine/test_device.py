"""Every thread that launches device work makes the engine's device its current CUDA device (Triton launches on the
current device; a new thread's is 0): the serving loop thread and the adapter loader. CUDA calls are faked."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

import loom.device as device_mod
import loom.lora.adapter_registry as registry_mod
import loom.serving.async_engine as async_mod
from tests.serving.fake_engine import FakeEngine


def test_bind_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    device_mod.bind_thread(None)
    device_mod.bind_thread("cpu")
    device_mod.bind_thread("cuda:1")
    device_mod.bind_thread(torch.device("cuda"))  # no index: the current one, made explicit
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert device_mod.resolve_device("cuda") == torch.device("cuda", 3)
    assert device_mod.resolve_device("cpu") == torch.device("cpu")


def _recorder(monkeypatch, module):
    seen = []
    monkeypatch.setattr(module, "bind_thread", lambda d: seen.append((threading.current_thread().name, d)))
    return seen


def test_the_loop_thread_binds_the_engine_device(monkeypatch):
    seen = _recorder(monkeypatch, async_mod)
    eng = FakeEngine()
    eng.runner = SimpleNamespace(device=torch.device("cuda", 1))
    ae = async_mod.AsyncEngine(eng)
    try:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        ae.shutdown()
    assert seen == [("loom-engine-loop", torch.device("cuda", 1))]


def test_the_adapter_loader_binds_the_engine_device(monkeypatch, tmp_path):
    from harness.lora import make_tiny_llama
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine

    seen = _recorder(monkeypatch, registry_mod)
    eng = LLMEngine(EngineConfig(model=make_tiny_llama(str(tmp_path / "m")), device="cpu",
                                 kv_cache_memory_bytes=1 << 20, lora_memory_bytes=1 << 20), load_tokenizer=False)
    eng.adapters._executor.submit(lambda: None).result()  # the loader thread starts (and binds) on first use
    assert [(name.startswith("loom-lora-load"), d) for name, d in seen] == [(True, torch.device("cpu"))]
    eng.adapters.close()
