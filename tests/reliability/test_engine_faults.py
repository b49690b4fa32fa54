"""Engine faults, a KV budget too small for a prompt, and shutdown with requests open: the real engine
(a tiny random Llama with SmolLM2's tokenizer) behind the real AsyncEngine, and backend/model.py's
finalize() with a stand-in for triton_python_backend_utils."""
from __future__ import annotations

import gc
import json
import logging
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest

from loom.engine.config import EngineConfig
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.serving.async_engine import AsyncEngine
from tests.reliability.conftest import Collector

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K,V) * block_size * kv_heads * head_dim * float32


def engine(tiny_model_dir, **kw):
    from loom.engine.llm_engine import LLMEngine
    kw.setdefault("kv_cache_memory_bytes", 256 * TINY_BLOCK_BYTES)
    return LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", **kw))


def greedy(n=8, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def no_leak(eng):
    bm = eng.block_manager
    assert not eng.requests, f"engine still tracks {list(eng.requests)}"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks leaked"


def hold_loop(ae: AsyncEngine) -> threading.Event:
    """Block the loop thread between steps until the event is set (to batch submissions deterministically)."""
    gate, entered = threading.Event(), threading.Event()

    def wait(_engine):
        entered.set()
        gate.wait(10)
    ae.call_in_loop(wait)
    assert entered.wait(5)
    return gate


def reference_tokens(tiny_model_dir, prompts, params) -> list[list[int]]:
    eng = engine(tiny_model_dir)
    ids = [eng.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(ids):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[int(o.request_id)].extend(o.new_token_ids)
    return [out[i] for i in range(len(prompts))]


def submit_all(ae, eng, prompts, params, prefix="q"):
    cols = []
    for i, p in enumerate(prompts):
        c = Collector()
        ae.submit(f"{prefix}{i}", eng.tokenizer.encode(p, add_special_tokens=False), params, on_output=c)
        cols.append(c)
    return cols


def test_fault_inside_a_step_fails_only_that_steps_requests(tiny_model_dir):
    ref = reference_tokens(tiny_model_dir, PROMPTS, greedy())
    eng = engine(tiny_model_dir, max_num_seqs=2)  # 4 requests: two steps' worth of sequences at a time
    ae = AsyncEngine(eng)
    try:
        run, in_fault = eng.runner.run, []

        def faulty(batch, lora):
            if not in_fault:
                in_fault.extend(s.request_id for s in batch.seqs)
                raise RuntimeError("injected fault: device lost")
            return run(batch, lora)
        eng.runner.run = faulty
        gate = hold_loop(ae)
        cols = submit_all(ae, eng, PROMPTS, greedy())
        gate.set()
        for c in cols:
            assert c.done.wait(30)
        assert len(in_fault) == 2, in_fault
        for i, c in enumerate(cols):
            assert c.finals == 1
            if f"q{i}" in in_fault:
                assert c.last.error and "injected fault: device lost" in c.last.error and "RuntimeError" in c.last.error
                assert c.last.error_kind == "internal"
            else:  # the other requests of the engine are untouched: full, correct output
                assert c.last.error is None and c.last.finish_reason == "length"
                assert c.tokens == ref[i]
        # and the engine keeps serving
        later = submit_all(ae, eng, PROMPTS[:1], greedy(), prefix="later")[0]
        assert later.done.wait(30) and later.last.error is None and later.tokens == ref[0]
        assert wait_idle(ae)
        no_leak(eng)
    finally:
        ae.shutdown(5)


def wait_idle(ae, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ae.stats().num_active == 0 and not ae.engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


def test_fault_escaping_engine_step_fails_its_requests_and_serving_goes_on(tiny_model_dir):
    """An exception out of LLMEngine.step itself (here: the scheduler) reaches AsyncEngine's handler."""
    ref = reference_tokens(tiny_model_dir, PROMPTS[:2], greedy())
    eng = engine(tiny_model_dir)
    ae = AsyncEngine(eng)
    try:
        schedule, fired = eng.scheduler.schedule, []

        def faulty():
            if not fired:
                fired.append(1)
                raise MemoryError("injected: scheduler ran out of memory")
            return schedule()
        eng.scheduler.schedule = faulty
        gate = hold_loop(ae)
        cols = submit_all(ae, eng, PROMPTS[:2], greedy())
        gate.set()
        for c in cols:
            assert c.done.wait(30) and c.finals == 1
            assert "engine: step failed: MemoryError: injected: scheduler ran out of memory" in c.last.error
        assert ae.stats().step_errors == 1
        later = submit_all(ae, eng, PROMPTS[:2], greedy(), prefix="later")
        for i, c in enumerate(later):
            assert c.done.wait(30) and c.last.error is None and c.tokens == ref[i]
        assert wait_idle(ae)
        no_leak(eng)
    finally:
        ae.shutdown(5)


def test_kv_budget_too_small_for_a_prompt_is_refused_up_front(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="loom"):
        eng = engine(tiny_model_dir, kv_cache_memory_bytes=2 * TINY_BLOCK_BYTES)  # 2 blocks = 32 tokens
    assert eng.block_manager.num_blocks == 2
    # said once at start: what the cache holds against max_model_len, and what to change
    said = [r.getMessage() for r in caplog.records if "KV cache holds" in r.getMessage()]
    assert said == [f"the KV cache holds 32 tokens, fewer than max_model_len {eng.max_model_len}: a longer prompt is "
                    "refused and a request ends (finish_reason length) when its prompt and output fill the whole "
                    "cache; raise kv_cache_memory_bytes or lower max_model_len"]
    with pytest.raises(RequestError) as ei:
        eng.add_request("x", list(range(100, 140)), greedy())
    assert ei.value.field == "prompt" and "KV cache holds 32" in str(ei.value)
    assert "kv_cache_memory_bytes" in str(ei.value)
    ae = AsyncEngine(eng)
    try:
        big = Collector()
        t0 = time.monotonic()
        ae.submit("big", list(range(100, 140)), greedy(), on_output=big)
        assert big.done.wait(5), "a prompt that can never fit must be refused, not retried"
        assert time.monotonic() - t0 < 2
        assert big.finals == 1 and big.last.error.startswith("prompt: has 40 tokens but the whole KV cache holds 32")
        assert big.last.error_kind == "invalid"
        # A prompt that fits but whose max_tokens would not: it ends by length when the cache is full.
        fits = Collector()
        ae.submit("fits", list(range(100, 120)), greedy(50), on_output=fits)
        assert fits.done.wait(30) and fits.last.error is None and fits.last.finish_reason == "length"
        assert len(fits.tokens) == 32 - 20
        # Two that fit alone but not together: both finish (one waits or is preempted), neither forever.
        a, b = Collector(), Collector()
        ae.submit("a", list(range(100, 120)), greedy(10), on_output=a)
        ae.submit("b", list(range(200, 220)), greedy(10), on_output=b)
        for c in (a, b):
            assert c.done.wait(60) and c.last.error is None and len(c.tokens) == 10
        assert wait_idle(ae)
        no_leak(eng)
    finally:
        ae.shutdown(5)


def slow_runner(eng, delay=0.03):
    run = eng.runner.run

    def slow(batch, lora):
        time.sleep(delay)
        return run(batch, lora)
    eng.runner.run = slow


def test_shutdown_with_requests_open_ends_within_the_timeout(tiny_model_dir):
    eng = engine(tiny_model_dir)
    slow_runner(eng)
    ae = AsyncEngine(eng)
    cols = submit_all(ae, eng, PROMPTS, greedy(400))
    for c in cols:
        assert wait_for_tokens(c)
    queued = Collector()
    t0 = time.monotonic()
    ae.shutdown(timeout=5.0)
    assert time.monotonic() - t0 < 5.0
    assert not ae._thread.is_alive()
    for c in cols:
        assert c.finals == 1
        assert c.last.error.startswith("server: the model is shutting down") and c.last.error_kind == "unavailable"
    no_leak(eng)
    with pytest.raises(RequestError) as ei:
        ae.submit("late", [1, 2, 3], greedy(), on_output=queued)
    assert ei.value.field == "server"
    with pytest.raises(RequestError):
        ae.adapter_op("list").result(1)


def wait_for_tokens(c: Collector, n=1, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(c.tokens) >= n:
            return True
        time.sleep(0.01)
    return False


# ------------------------------------------------------------------ backend/model.py finalize()

class _FakeTensor:
    def __init__(self, name, arr):
        self._name, self._arr = name, arr

    def as_numpy(self):
        return self._arr

    def name(self):
        return self._name


class _FakeResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error


class _FakeError(Exception):
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL"

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message, self.code = message, code


class FakeSender:
    def __init__(self):
        self.sent: list[tuple[object, int]] = []
        self.finals = 0
        self.lock = threading.Lock()

    def send(self, response=None, flags=0):
        with self.lock:
            self.sent.append((response, flags))
            self.finals += bool(flags & 1)

    def is_cancelled(self):
        return False

    @property
    def error(self):
        errs = [r.error for r, _ in self.sent if r is not None and r.error is not None]
        return str(errs[-1]) if errs else None


class FakeRequest:
    def __init__(self, inputs: dict, parameters: dict | None = None):
        self.inputs = {k: _FakeTensor(k, v) for k, v in inputs.items()}
        self._params = json.dumps(parameters or {})
        self.sender = FakeSender()

    def parameters(self):
        return self._params

    def get_response_sender(self):
        return self.sender


def fake_pb_utils():
    m = types.ModuleType("triton_python_backend_utils")
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    m.Logger = types.SimpleNamespace(log_info=lambda s: None, log_warn=lambda s: None, log_error=lambda s: None)
    m.TritonError = _FakeError
    m.InferenceResponse = _FakeResponse
    m.Tensor = _FakeTensor
    m.using_decoupled_model_transaction_policy = lambda cfg: cfg.get("model_transaction_policy", {}).get("decoupled")
    m.get_input_tensor_by_name = lambda req, name: req.inputs.get(name)
    return m


@pytest.fixture
def model_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    sys.modules.pop("loom.model", None)
    import loom.model as model_py
    handlers = list(logging.getLogger("loom").handlers)
    yield model_py
    logging.getLogger("loom").handlers[:] = handlers
    sys.modules.pop("loom.model", None)


def test_finalize_with_streams_open_fails_them_and_releases_the_engine(model_py, tiny_model_dir, tmp_path):
    """Also: with adapter roots, the adapter loader process boots at initialize (not at the first large adapter load,
    while requests stream: its boot is not paced) and is gone after finalize."""
    from tests.lora.test_load_process import wait_gone

    (tmp_path / "adapters").mkdir()
    params = {"model": tiny_model_dir, "device": "cpu", "kv_cache_memory_bytes": str(256 * TINY_BLOCK_BYTES),
              "metrics": "false", "shutdown_timeout_s": "3", "adapter_roots": str(tmp_path / "adapters")}
    args = {"model_config": json.dumps({"name": "m", "model_transaction_policy": {"decoupled": True},
                                        "parameters": {k: {"string_value": v} for k, v in params.items()}}),
            "model_repository": str(tmp_path), "model_name": "m", "model_version": "1"}
    before = set(threading.enumerate())
    m = model_py.TritonPythonModel()
    m.initialize(args)
    assert wait_for(lambda: m.engine.adapters.loader_pid), "the adapter loader process did not start at initialize"
    loader = m.engine.adapters.loader_pid
    slow_runner(m.engine)
    eng_ref = weakref.ref(m.engine)
    sp = json.dumps({"max_tokens": 400, "temperature": 0, "ignore_eos": True}).encode()
    reqs = [FakeRequest({"text_input": np.array([p.encode()], dtype=np.object_), "stream": np.array([True]),
                         "sampling_parameters": np.array([sp], dtype=np.object_)}) for p in PROMPTS]
    m.execute(reqs)
    assert all(wait_for(lambda r=r: len(r.sender.sent) >= 1) for r in reqs), "requests did not start streaming"
    threads = {t.name for t in threading.enumerate()}
    assert "loom-engine-loop" in threads
    t0 = time.monotonic()
    m.finalize()
    assert time.monotonic() - t0 < 3.0 + 1.0
    for r in reqs:
        assert r.sender.finals == 1, "exactly one final response per request"
        assert r.sender.error.startswith("server: the model is shutting down")
    assert m.engine is None and m.async_engine is None
    gc.collect()
    assert eng_ref() is None, "finalize() must release the engine (weights, KV cache)"
    left = {t.name for t in set(threading.enumerate()) - before}
    assert not any(n.startswith(("loom-engine-loop", "loom-sender", "loom-lora-load")) for n in left), left
    assert wait_gone(loader), "the adapter loader process outlived finalize()"


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False
