"""AsyncEngine and ResponseStreamer against the fake engine (tests/serving/fake_engine.py), whose contract is
checked against the real LLMEngine here too."""
from __future__ import annotations

import threading
import time

import pytest

from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.serving.async_engine import AsyncEngine, RequestDelta
from loom.serving.response_streamer import ResponseStreamer
from tests.serving.fake_engine import FakeEngine


class Collector:
    def __init__(self):
        self.deltas: list[RequestDelta] = []
        self.done = threading.Event()

    def __call__(self, d: RequestDelta):
        self.deltas.append(d)
        if d.finished:
            self.done.set()

    @property
    def text(self):
        return "".join(d.text for d in self.deltas)

    @property
    def last(self):
        return self.deltas[-1]


class Observer:
    def __init__(self):
        self.finished, self.steps, self.gen, self.prompt = [], 0, 0, 0

    def on_step(self, stats, prompt_tokens, generation_tokens, inter_token_latencies=()):
        self.steps += 1
        self.itl = getattr(self, "itl", []) + list(inter_token_latencies)
        self.prompt += prompt_tokens
        self.gen += generation_tokens

    def on_request_finished(self, t):
        self.finished.append(t)


def make(**kw):
    eng = FakeEngine(gate=kw.pop("gate", None))
    obs = Observer()
    ae = AsyncEngine(eng, observer=obs, **kw)
    return eng, ae, obs


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)
    return cond()


def wait(c: Collector, timeout=5.0):
    assert c.done.wait(timeout), "request did not finish"
    return c


def test_generates_and_finishes_by_length():
    eng, ae, obs = make()
    c = Collector()
    ae.submit("r1", [0, 1, 2], SamplingParams(max_tokens=5, logprobs=1), on_output=c)
    wait(c)
    assert c.text == "defgh"
    assert c.last.finish_reason == "length" and c.last.error is None
    assert [t for d in c.deltas for t in d.token_ids] == [3, 4, 5, 6, 7]
    assert len([lp for d in c.deltas for lp in d.logprobs]) == 5
    assert c.last.num_output_tokens == 5 and c.last.num_prompt_tokens == 3
    assert c.last.cumulative_logprob == pytest.approx(-2.5)
    ae.shutdown()
    assert obs.gen == 5 and obs.prompt == 3
    t = obs.finished[0]
    assert t.first_token is not None and t.finished >= t.first_token >= t.arrival and t.num_output_tokens == 5


def test_stop_string_aborts_in_engine():
    eng, ae, _ = make()
    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=20, stop=["de"]), on_output=c)
    wait(c)
    assert c.text == "bc" and c.last.finish_reason == "stop"
    # the output worker found the stop string; the loop aborts the request in the engine before its next step
    assert wait_for(lambda: "r1" in eng.aborted and not eng.running)
    ae.shutdown()


def test_engine_refusal_arrives_as_named_error():
    eng, ae, _ = make()
    c = Collector()
    ae.submit("r1", [0] * 100, SamplingParams(), on_output=c)
    wait(c)
    assert c.last.error.startswith("prompt:") and c.last.error_kind == "invalid"
    c2 = Collector()
    ae.submit("r2", [0], SamplingParams(max_tokens=2), lora_name="nope", on_output=c2)
    assert wait(c2).last.error.startswith("lora_name:")
    assert ae.stats().num_active == 0 and ae.stats().num_unstarted == 0
    ae.shutdown()


def test_cancellation_polled_off_the_loop_and_frees():
    eng, ae, _ = make(cancel_poll_interval_s=0.005)
    threads = set()
    flag = threading.Event()

    def is_cancelled():
        threads.add(threading.current_thread().name)
        return flag.is_set()

    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=100000), on_output=c, is_cancelled=is_cancelled)
    while len(c.deltas) < 3:
        time.sleep(0.001)
    flag.set()
    wait(c)
    assert c.last.error_kind == "cancelled" and c.last.finish_reason == "abort"
    assert "r1" in eng.aborted and not eng.running
    assert threads == {"loom-cancel-watch"}  # never on the engine loop thread
    ae.shutdown()


def test_the_loop_thread_does_only_engine_work():
    """Per step the loop hands the outputs over; detokenization, on_output and cancellation polling run in other
    threads, and the loop never runs more than MAX_STEPS_AHEAD steps ahead of the output worker."""
    from loom.serving.async_engine import MAX_STEPS_AHEAD

    gate = threading.Event()
    eng, ae, _ = make()
    where = {"on_output": set(), "decode": set(), "is_cancelled": set()}
    decode = eng.tokenizer.decode

    def traced_decode(*a, **kw):
        where["decode"].add(threading.current_thread().name)
        return decode(*a, **kw)
    ae._worker._tokenizer.decode = traced_decode
    ahead = []
    step = eng.step

    def traced_step():
        ahead.append(ae._steps_behind)
        return step()
    eng.step = traced_step
    cs = []
    for i in range(20):
        c = Collector()
        cs.append(c)

        def on_output(d, c=c):
            where["on_output"].add(threading.current_thread().name)
            if d.index == 0 and not c.deltas:
                gate.wait(5)  # the worker is slow at first: the loop must wait for it
            c(d)

        def is_cancelled():
            where["is_cancelled"].add(threading.current_thread().name)
            return False
        ae.submit(f"r{i}", [i % 26], SamplingParams(max_tokens=8), on_output=on_output, is_cancelled=is_cancelled)
    time.sleep(0.05)
    assert eng.steps <= MAX_STEPS_AHEAD + 1  # held back by the output worker
    gate.set()
    for c in cs:
        wait(c)
    ae.shutdown()
    assert where == {"on_output": {"loom-outputs"}, "decode": {"loom-outputs"},
                     "is_cancelled": {"loom-cancel-watch"}}
    assert max(ahead) <= MAX_STEPS_AHEAD - 1


def test_a_first_token_at_light_load_yields_the_gil_once(monkeypatch):
    """The loop yields the GIL (sleep(0)) after a step carrying a request's first token among at most
    YIELD_MAX_OUTPUTS outputs, so the output worker takes it at once; later tokens and busier steps do not yield."""
    import loom.serving.async_engine as mod

    yields = []

    class Time:  # the module's `time`, recording the loop thread's sleep(0)
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, s):
            if s == 0 and threading.current_thread().name == "loom-engine-loop":
                yields.append(s)
            time.sleep(s)

    monkeypatch.setattr(mod, "time", Time())
    eng, ae, _ = make()
    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=4), on_output=c)
    wait(c)
    assert len(yields) == 1  # its first token, not the three after it
    monkeypatch.setattr(mod, "YIELD_MAX_OUTPUTS", 1)
    long = Collector()
    ae.submit("long", [0], SamplingParams(max_tokens=100000), on_output=long)
    assert wait_for(lambda: len(long.deltas) >= 2)
    assert len(yields) == 2  # the long request's first token came alone
    c2 = Collector()
    ae.submit("r2", [0], SamplingParams(max_tokens=2), on_output=c2)
    wait(c2)
    assert len(yields) == 2  # r2's first token shared its step with the long request's token: 2 outputs > 1
    ae.abort("long")
    wait(long)
    ae.shutdown()


def test_overload_is_refused_immediately():
    gate = threading.Event()
    eng, ae, _ = make(gate=gate, max_queue_size=2)
    cs = [Collector() for _ in range(2)]
    for i, c in enumerate(cs):
        ae.submit(f"r{i}", [0], SamplingParams(max_tokens=2), on_output=c)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as ei:
        ae.submit("r9", [0], SamplingParams(max_tokens=2), on_output=Collector())
    assert ei.value.field == "overload" and time.monotonic() - t0 < 0.5
    with pytest.raises(RequestError) as ei:
        ae.submit("r0", [0], SamplingParams(max_tokens=2))
    gate.set()
    for c in cs:
        assert wait(c).last.finish_reason == "length"
    ae.submit("r9", [0], SamplingParams(max_tokens=2), on_output=(c := Collector()))
    assert wait(c).last.finish_reason == "length"
    ae.shutdown()


def test_deadline():
    eng, ae, _ = make()
    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=10**6), on_output=c, timeout_s=0.05)
    wait(c)
    assert c.last.error_kind == "timeout" and c.last.error.startswith("request_timeout_s:")
    assert not eng.running
    ae.shutdown()


def test_step_exception_fails_that_step_and_keeps_serving():
    eng, ae, _ = make()
    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=10**6), on_output=c)
    while not c.deltas:
        time.sleep(0.001)
    eng.fail_next_step = True
    wait(c)
    assert c.last.error_kind == "internal" and "out of memory" in c.last.error
    c2 = Collector()
    ae.submit("r2", [0], SamplingParams(max_tokens=3), on_output=c2)
    assert wait(c2).last.finish_reason == "length" and c2.text == "bcd"
    assert ae.stats().step_errors == 1
    ae.shutdown()


def test_adapter_ops_run_in_loop():
    eng, ae, _ = make()
    assert ae.adapter_op("load", "a1", "/x").result(5) == {"name": "a1", "path": "/x"}
    assert ae.adapter_op("list").result(5) == ["a1"]
    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=2), lora_name="a1", on_output=c)
    assert wait(c).last.error is None
    with pytest.raises(RequestError):
        ae.adapter_op("unload", "zz").result(5)
    ae.shutdown()


def test_shutdown_fails_inflight():
    eng, ae, _ = make()
    c = Collector()
    ae.submit("r1", [0], SamplingParams(max_tokens=10**6), on_output=c)
    while not c.deltas:
        time.sleep(0.001)
    ae.shutdown()
    assert wait(c).last.error_kind == "unavailable"
    with pytest.raises(RequestError):
        ae.submit("r2", [0], SamplingParams())


def test_many_concurrent_requests():
    eng, ae, _ = make()
    cs = {f"r{i}": Collector() for i in range(50)}
    for i, (rid, c) in enumerate(cs.items()):
        ae.submit(rid, [i % 26], SamplingParams(max_tokens=7), on_output=c)
    for i, c in enumerate(cs.values()):
        wait(c)
        assert c.text == "".join(chr(ord("a") + (i + k) % 26) for k in range(1, 8))
    ae.shutdown()


def test_streamer_coalesces_while_send_in_flight():
    sent: list[RequestDelta] = []
    release, entered = threading.Event(), threading.Event()

    def send(ctx, ds):
        entered.set()
        release.wait(5)
        assert len(ds) == 1
        sent.append(ds[0])

    s = ResponseStreamer(send)
    out = s.open("ctx", stream=True)
    out(RequestDelta("r", text="0", token_ids=[0], num_output_tokens=1))
    assert entered.wait(5)
    for i in range(1, 10):
        out(RequestDelta("r", text=str(i), token_ids=[i], num_output_tokens=i + 1))
    out(RequestDelta("r", text="!", finished=True, finish_reason="length", num_output_tokens=10))
    time.sleep(0.05)
    release.set()
    s.close()
    assert "".join(d.text for d in sent) == "0123456789!"
    assert len(sent) == 2  # the first delta, then everything that piled up behind it
    assert sent[-1].finished and sent[-1].token_ids == list(range(1, 10))


def test_streamer_sends_a_first_response_before_queued_later_ones():
    """A stream's first response overtakes the later responses of other streams already queued (time to first
    token at many streams); each stream's own responses stay in order and every delta arrives."""
    order: list[tuple[str, str]] = []
    gate, entered = threading.Event(), threading.Event()

    def send(ctx, ds):
        if ctx == "block":
            entered.set()
            gate.wait(5)
        order.append((ctx, "".join(d.text for d in ds)))

    s = ResponseStreamer(send)
    a, b, c = (s.open(name, stream=True) for name in "ABC")
    a(RequestDelta("A", text="1"))
    b(RequestDelta("B", text="1"))  # A and B have a response out ...
    for _ in range(500):
        if len(order) == 2:
            break
        time.sleep(0.01)
    s.open("block", stream=True)(RequestDelta("k", text="x"))  # ... then the only sender thread is held
    assert entered.wait(5)
    a(RequestDelta("A", text="2"))  # later responses queue first,
    b(RequestDelta("B", text="2"))
    c(RequestDelta("C", text="1"))  # then a new stream's first
    gate.set()
    s.close()
    assert order == [("A", "1"), ("B", "1"), ("block", "x"), ("C", "1"), ("A", "2"), ("B", "2")]


def test_streamer_non_stream_sends_once():
    sent = []
    s = ResponseStreamer(lambda ctx, ds: sent.append((ctx, ds[0])), num_threads=2)
    out = s.open("A", stream=False)
    for i in range(5):
        out(RequestDelta("r", text="x", token_ids=[i]))
    time.sleep(0.05)
    assert sent == []
    out(RequestDelta("r", text="y", finished=True, finish_reason="stop"))
    s.close()
    assert len(sent) == 1 and sent[0][1].text == "xxxxxy" and sent[0][1].token_ids == [0, 1, 2, 3, 4]


def test_streamer_merges_per_completion_index():
    sent = []
    s = ResponseStreamer(lambda ctx, ds: sent.append([(d.index, d.text, d.finish_reason, d.finished) for d in ds]))
    out = s.open("A", stream=False)
    out(RequestDelta("r", text="a", index=1))
    out(RequestDelta("r", text="b", index=0))
    out(RequestDelta("r", text="c", index=1, finish_reason="stop"))
    out(RequestDelta("r", text="d", index=0, finish_reason="length", finished=True))
    s.close()
    # one response, completions in index order, each with its own text and reason, all marked final
    assert sent == [[(0, "bd", "length", True), (1, "ac", "stop", True)]]


def test_streamer_keeps_per_request_order_with_threads():
    got: dict[str, list[str]] = {}
    lock = threading.Lock()

    def send(ctx, ds):
        time.sleep(0.0005)
        with lock:
            got.setdefault(ctx, []).append(ds[0].text)

    s = ResponseStreamer(send, num_threads=4)
    outs = {k: s.open(k, stream=True) for k in "abcdefgh"}
    for i in range(200):
        for k, o in outs.items():
            o(RequestDelta(k, text=f"{i},", finished=(i == 199)))
    time.sleep(0.3)
    s.close()
    for k in outs:
        assert "".join(got[k]) == "".join(f"{i}," for i in range(200))



def test_fake_engine_keeps_the_real_engines_contract(tmp_path):
    """What AsyncEngine uses of an engine has the same names and parameters on the fake and on LLMEngine, so the
    tests above cannot pass against an interface the real engine no longer has."""
    import inspect

    from harness.hf_models import make_hf_model
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.lora import AdapterRegistry

    def params(fn):
        return list(inspect.signature(fn).parameters)

    fake = FakeEngine()
    _, path = make_hf_model("llama", tmp_path, num_hidden_layers=1)
    real = LLMEngine(EngineConfig(model=path, kv_cache_memory_bytes=1 << 20))
    for name in ("add_request", "abort_request", "has_unfinished_requests", "step", "stats"):
        assert params(getattr(fake, name)) == params(getattr(real, name)), name
    for attr in ("tokenizer", "adapters", "last_step_request_ids"):
        assert hasattr(fake, attr) and hasattr(real, attr), attr
    for name in ("load", "reload", "unload", "list"):
        assert params(getattr(fake.adapters, name)) == params(getattr(AdapterRegistry, name))[1:], name
