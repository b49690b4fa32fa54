"""Thread-safe front of one LLMEngine: one loop thread steps the engine; callers submit and get deltas.

Why one thread: the engine (scheduler, block manager, model runner) is not thread-safe, and on a GPU
the step is the bottleneck anyway. Everything that touches the engine (add, abort, adapter ops,
stats) therefore runs in the loop thread between steps; other threads only hand work over through
`self._cond`. Per-step callbacks (`on_output`) run in the loop thread and must be cheap: the Triton
glue puts deltas into an `Outbox`, and `ResponseStreamer` threads send them, merging whatever piled up
while a send was in flight into one response (a send costs ~0.3 ms of server time, a step can make
hundreds of tokens).

A request with n > 1 completions produces one delta stream per completion (`RequestDelta.index`); the request
is finished when all n are. Health: a sticky device error reported by the engine, too many failed steps in a
row, or the loop thread dying make the engine unhealthy for good: in-flight requests fail, new ones are refused
(UNAVAILABLE), and `on_unhealthy` tells the Triton glue (which stops reporting the model ready).
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from loom.device import bind_thread
from loom.engine.detokenizer import IncrementalDetokenizer
from loom.engine.faults import is_sticky_device_error
from loom.engine.outputs import EngineStats, StepOutput, TokenLogprob
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError

log = logging.getLogger("loom.async_engine")


@dataclass
class RequestDelta:
    """What one completion of a request produced since the last delta (or, merged, since the last send)."""
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False  # the whole request is finished (every completion)
    finish_reason: str | None = None  # this completion's, once it ended: stop | length | abort
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # total so far (the delta's own count is len(token_ids))
    cumulative_logprob: float = 0.0
    error: str | None = None  # "field: message" when the request failed
    error_kind: str | None = None  # invalid | unavailable | cancelled | timeout | internal
    index: int = 0  # which of the request's n completions
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the request's first token

    def merge(self, later: "RequestDelta") -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finish_reason is not None or self.finish_reason is None:
            self.finish_reason = later.finish_reason
        for name in ("finished", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens",
                     "cumulative_logprob", "error", "error_kind"):
            setattr(self, name, getattr(later, name))


@dataclass
class RequestTiming:
    """Handed to the observer when a request ends (metrics)."""
    request_id: str
    arrival: float
    first_token: float | None
    finished: float
    num_prompt_tokens: int
    num_output_tokens: int  # over all n completions
    finish_reason: str | None
    error_kind: str | None
    n: int = 1


class Observer(Protocol):
    def on_step(self, stats: EngineStats, prompt_tokens: int, generation_tokens: int,
                inter_token_latencies: list[float] = ...) -> None: ...
    def on_request_finished(self, timing: RequestTiming) -> None: ...


@dataclass
class AsyncStats:
    engine: EngineStats
    num_active: int  # submitted and not finished
    num_unstarted: int  # submitted, no token yet (what admission control bounds)
    max_queue_size: int
    steps: int
    step_errors: int
    requests_total: int


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None
    on_output: Callable[[RequestDelta], None]
    is_cancelled: Callable[[], bool] | None
    deadline: float | None
    timeout_s: float | None
    arrival: float
    detoks: list = field(default_factory=list)  # one incremental detokenizer per completion
    first_token: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output: list[int] = field(default_factory=list)  # per completion
    cumulative: list[float] = field(default_factory=list)  # per completion
    last_token: list[float | None] = field(default_factory=list)  # per completion: when its latest token came
    done: dict[int, str | None] = field(default_factory=dict)  # finished completions -> finish reason


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue_size: int = 1024, default_timeout_s: float | None = None,
                 observer: Observer | None = None, max_failed_steps: int = 16,
                 on_unhealthy: Callable[[str], None] | None = None):
        self.engine = engine
        self.max_queue_size = max_queue_size
        self.default_timeout_s = default_timeout_s
        self.observer = observer
        self.max_failed_steps = max_failed_steps  # failed steps in a row that make the engine unhealthy (0: never)
        self.on_unhealthy = on_unhealthy
        self._unhealthy: str | None = None
        self._itl: list[float] = []  # inter-token latencies since the last report (loop thread)
        self._cond = threading.Condition()
        self._inbox: list[_Req] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[Any], Any], Future]] = []
        self._ids: set[str] = set()  # every accepted, unfinished request id (guarded by _cond)
        self._unstarted = 0  # guarded by _cond
        self._stopping = False
        self._reqs: dict[str, _Req] = {}  # loop thread only
        self._stats = EngineStats()
        self._steps = self._step_errors = self._requests_total = 0
        self._consecutive_errors = 0
        self._prompt_tokens_pending = self._gen_tokens_pending = 0
        self._thread = threading.Thread(target=self._run, name="loom-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ API (any thread)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               lora_name: str | None = None, on_output: Callable[[RequestDelta], None] | None = None,
               is_cancelled: Callable[[], bool] | None = None, timeout_s: float | None = None) -> None:
        """Queue a request. Raises RequestError at once for overload, shutdown or a duplicate id;
        engine-side refusals (prompt too long, unknown adapter) arrive as a finished delta with `error`."""
        now = time.monotonic()
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        req = _Req(request_id, list(prompt_token_ids), params, lora_name, on_output or (lambda d: None), is_cancelled,
                   now + timeout_s if timeout_s else None, timeout_s, now)
        with self._cond:
            if self._stopping:
                raise RequestError("server", "the model is shutting down; retry on another instance")
            reason = self.health()
            if reason is not None:
                raise RequestError("server", f"the model is unavailable: its engine is unhealthy ({reason}); "
                                   "retry on another instance")
            if request_id in self._ids:
                raise RequestError("request_id", f"{request_id!r} is already in flight")
            if self._unstarted >= self.max_queue_size:
                raise RequestError("overload", f"{self._unstarted} requests are already waiting (max_queue_size="
                                   f"{self.max_queue_size}); retry later")
            self._ids.add(request_id)
            self._unstarted += 1
            self._requests_total += 1
            self._inbox.append(req)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def call_in_loop(self, fn: Callable[[Any], Any]) -> Future:
        """Run fn(engine) in the loop thread between steps; the Future carries its result or exception."""
        fut: Future = Future()
        with self._cond:
            if self._stopping:
                fut.set_exception(RequestError("server", "the model is shutting down"))
                return fut
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def adapter_op(self, op: str, name: str | None = None, path: str | None = None) -> Future:
        """load | reload | unload | list | info on engine.adapters. Loads read weights in the registry's own
        thread (wait=False), so the loop keeps stepping; the Future completes when the load does. `info`: the
        registry's counters (`refs` = unreleased request refs over all versions) and the engine's KV use."""
        def run(engine):
            adapters = engine.adapters
            if op == "info":
                st = engine.stats()
                with self._cond:
                    active = len(self._ids)
                return {"adapters": adapters.info(),
                        "kv_blocks_used": st.kv_blocks_used, "kv_blocks_total": st.kv_blocks_total,
                        "num_running": st.num_running, "num_waiting": st.num_waiting, "num_active": active}
            if op == "list":
                return adapters.list()
            if op == "unload":
                return adapters.unload(name)
            return getattr(adapters, op)(name, path, wait=False)
        return self.call_in_loop(run)

    def stats(self) -> AsyncStats:
        with self._cond:
            return AsyncStats(self._stats, len(self._ids), self._unstarted, self.max_queue_size, self._steps,
                              self._step_errors, self._requests_total)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail whatever is still in flight (error kind "unavailable") and stop the loop thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def loop_alive(self) -> bool:
        """Whether the loop thread still runs (after shutdown(): a step outlived the timeout)."""
        return self._thread.is_alive()

    def health(self) -> str | None:
        """None while the engine can serve; else why not (for good: a restart is the cure)."""
        if self._unhealthy is not None:
            return self._unhealthy
        if not self._thread.is_alive() and not self._stopping:
            return "the engine loop thread died"
        return None

    def _mark_unhealthy(self, reason: str) -> None:
        """Fail what is in flight and tell the glue, once."""
        if self._unhealthy is not None:
            return
        self._unhealthy = reason
        log.error("the engine is unhealthy and will not serve again: %s", reason)
        msg = f"server: the model is unavailable: its engine is unhealthy ({reason}); retry on another instance"
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for r in inbox:
            self._finish(r, RequestDelta(r.request_id, finished=True, finish_reason="abort", error=msg,
                                         error_kind="unavailable"))
        for r in list(self._reqs.values()):
            self._engine_abort(r.request_id)
            self._fail(r, "unavailable", msg)
        if self.on_unhealthy is not None:
            try:
                self.on_unhealthy(reason)
            except Exception:
                log.error("on_unhealthy failed:\n%s", traceback.format_exc())

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            bind_thread(getattr(getattr(self.engine, "runner", None), "device", None))  # Triton's current device
            self._loop()
        except BaseException as e:  # only what the loop's own guard does not catch (SystemExit, ...)
            if not self._stopping:
                self._mark_unhealthy(f"the engine loop thread died: {type(e).__name__}: {e}")
            raise

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or self._calls or self._stopping or self._reqs
                           or self._engine_busy()):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
                stopping = self._stopping
            try:
                if stopping:
                    self._stop(inbox, calls)
                    return
                for fn, fut in calls:
                    self._call(fn, fut)
                for rid in aborts:
                    self._abort(rid, inbox)
                for req in inbox:
                    self._add(req)
                self._poll(time.monotonic())
                if self._unhealthy is not None:
                    for r in list(self._reqs.values()):  # raced in after the engine broke
                        self._fail(r, "unavailable", f"server: the model is unavailable: its engine is unhealthy "
                                                     f"({self._unhealthy})")
                elif self._engine_busy():
                    self._step()
                elif self._reqs:
                    # The engine lost requests we still track: fail them instead of spinning.
                    for r in list(self._reqs.values()):
                        self._fail(r, "internal", "engine: the request vanished from the engine")
                self._report()
            except Exception:  # a bug here must not kill the thread that serves everyone
                log.error("engine loop error:\n%s", traceback.format_exc())
                time.sleep(0.01)

    def _engine_busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _call(self, fn, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as e:
            fut.set_exception(e)
            return
        if isinstance(result, Future):  # finishes later (an adapter load): chain, never block the loop
            def chain(inner: Future) -> None:
                e = inner.exception()
                fut.set_exception(e) if e is not None else fut.set_result(inner.result())
            result.add_done_callback(chain)
        else:
            fut.set_result(result)

    def _add(self, r: _Req) -> None:
        try:
            n = r.params.n
            r.detoks = [IncrementalDetokenizer(self.engine.tokenizer, r.prompt_token_ids, r.params) for _ in range(n)]
            r.num_output, r.cumulative, r.last_token = [0] * n, [0.0] * n, [None] * n
            self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.lora_name)
        except RequestError as e:
            self._finish(r, RequestDelta(r.request_id, finished=True, finish_reason="abort", error=str(e),
                                         error_kind="invalid"))
            return
        except Exception as e:
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._finish(r, RequestDelta(r.request_id, finished=True, finish_reason="abort",
                                         error=f"engine: add_request failed: {type(e).__name__}: {e}",
                                         error_kind="internal"))
            return
        r.num_prompt_tokens = len(r.prompt_token_ids)  # until the engine reports it (after truncation)
        self._reqs[r.request_id] = r

    def _abort(self, rid: str, inbox: list[_Req]) -> None:
        r = self._reqs.get(rid)
        if r is not None:
            self._engine_abort(rid)
            self._finish(r, self._delta(r, finished=True, finish_reason="abort"))
            return
        for q in inbox:
            if q.request_id == rid:
                inbox.remove(q)
                self._finish(q, RequestDelta(rid, finished=True, finish_reason="abort"))
                return

    def _engine_abort(self, rid: str, index: int | None = None) -> None:
        try:
            if index is None:
                self.engine.abort_request(rid)
            else:
                self.engine.abort_request(rid, index=index)
        except Exception:
            log.error("abort_request(%s) failed:\n%s", rid, traceback.format_exc())

    def _poll(self, now: float) -> None:
        """Cancellation and deadlines, once per step (is_cancelled costs ~0.1 ms: never per token)."""
        for r in list(self._reqs.values()):
            cancelled = False
            if r.is_cancelled is not None:
                try:
                    cancelled = bool(r.is_cancelled())
                except Exception:
                    cancelled = False
            if cancelled:
                self._engine_abort(r.request_id)
                self._finish(r, self._delta(r, finished=True, finish_reason="abort",
                                            error="cancelled: the client cancelled the request", error_kind="cancelled"))
            elif r.deadline is not None and now > r.deadline:
                self._engine_abort(r.request_id)
                self._finish(r, self._delta(r, finished=True, finish_reason="abort",
                                            error=f"request_timeout_s: the request ran past its deadline of "
                                                  f"{r.timeout_s:g} s", error_kind="timeout"))

    def _step(self) -> None:
        try:
            outputs: list[StepOutput] = self.engine.step()
        except Exception as e:
            self._on_step_error(e)
            return
        self._steps += 1
        self._consecutive_errors = 0
        for o in outputs:
            r = self._reqs.get(o.request_id)
            if r is not None and o.index not in r.done:  # else aborted by us already: its echo is ignored
                self._on_output(r, o)
        fatal = getattr(self.engine, "fatal_error", None)  # a sticky device error: every later step would fail
        if fatal:
            self._mark_unhealthy(fatal)
        elif self.max_failed_steps and getattr(self.engine, "failed_steps_in_a_row", 0) >= self.max_failed_steps:
            self._mark_unhealthy(f"{self.engine.failed_steps_in_a_row} engine steps in a row failed")

    def _on_step_error(self, e: Exception) -> None:
        """Fail the requests of the failed step with the cause and keep serving the rest."""
        self._step_errors += 1
        self._consecutive_errors += 1
        log.error("engine step failed:\n%s", traceback.format_exc())
        ids = self.engine.last_step_request_ids  # the requests scheduled in the failed step
        victims = [self._reqs[i] for i in ids if i in self._reqs] if ids else list(self._reqs.values())
        for r in victims:
            self._engine_abort(r.request_id)
            self._fail(r, "internal", f"engine: step failed: {type(e).__name__}: {e}")
        if is_sticky_device_error(e):
            self._mark_unhealthy(f"sticky device error: {type(e).__name__}: {e}")
            return
        if self.max_failed_steps and self._consecutive_errors >= self.max_failed_steps:
            self._mark_unhealthy(f"{self._consecutive_errors} engine steps in a row failed (last: "
                                 f"{type(e).__name__}: {e})")
            return
        time.sleep(min(0.001 * 2 ** self._consecutive_errors, 1.0))  # a broken engine must not spin a core

    def _on_output(self, r: _Req, o: StepOutput) -> None:
        now = time.monotonic()
        if o.finish_reason == "error" or o.error:
            self._engine_abort(r.request_id)  # its other completions, if any
            self._fail(r, "internal", o.error or "engine: the request failed")
            return
        i = o.index
        r.num_prompt_tokens, r.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
        if o.new_token_ids and r.first_token is None:  # prefill done: count the prompt once
            r.first_token = now
            self._prompt_tokens_pending += o.num_prompt_tokens
            with self._cond:
                self._unstarted -= 1
        if o.new_token_ids and self.observer is not None:
            last = r.last_token[i]
            if last is not None:  # vLLM's inter-token latency: one observation per token after the first
                self._itl.extend([(now - last) / len(o.new_token_ids)] * len(o.new_token_ids))
            elif len(o.new_token_ids) > 1:
                self._itl.extend([0.0] * (len(o.new_token_ids) - 1))
            r.last_token[i] = now
        r.num_output[i] += len(o.new_token_ids)
        r.cumulative[i] = o.cumulative_logprob
        self._gen_tokens_pending += len(o.new_token_ids)
        try:
            u = r.detoks[i].update(o.new_token_ids, o.finished, o.finish_reason)
        except Exception as e:
            log.error("detokenizer failed:\n%s", traceback.format_exc())
            self._engine_abort(r.request_id)
            self._fail(r, "internal", f"detokenizer: {type(e).__name__}: {e}")
            return
        if u.abort_engine:
            self._engine_abort(r.request_id, i)
        if u.finished:
            r.done[i] = u.finish_reason
        delta = self._delta(r, i, text=u.text, token_ids=list(o.new_token_ids), logprobs=o.new_logprobs,
                            finished=len(r.done) == r.params.n, finish_reason=u.finish_reason if u.finished else None,
                            prompt_logprobs=o.prompt_logprobs)
        if delta.finished:
            self._finish(r, delta)
        else:
            self._emit(r, delta)

    def _delta(self, r: _Req, index: int = 0, **kw) -> RequestDelta:
        return RequestDelta(r.request_id, num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=r.num_cached_tokens,
                            num_output_tokens=r.num_output[index] if r.num_output else 0,
                            cumulative_logprob=r.cumulative[index] if r.cumulative else 0.0, index=index, **kw)

    def _fail(self, r: _Req, kind: str, message: str) -> None:
        self._finish(r, self._delta(r, finished=True, finish_reason="abort", error=message, error_kind=kind))

    def _finish(self, r: _Req, delta: RequestDelta) -> None:
        self._reqs.pop(r.request_id, None)
        with self._cond:
            self._ids.discard(r.request_id)
            if r.first_token is None:
                self._unstarted -= 1
        if self.observer is not None:
            try:
                self.observer.on_request_finished(RequestTiming(
                    r.request_id, r.arrival, r.first_token, time.monotonic(), r.num_prompt_tokens, sum(r.num_output),
                    delta.finish_reason, delta.error_kind, r.params.n))
            except Exception:
                log.error("observer failed:\n%s", traceback.format_exc())
        self._emit(r, delta)

    def _emit(self, r: _Req, delta: RequestDelta) -> None:
        try:
            r.on_output(delta)
        except Exception:
            log.error("on_output callback failed for %s:\n%s", r.request_id, traceback.format_exc())

    def _report(self) -> None:
        try:
            stats = self.engine.stats()
        except Exception:
            stats = self._stats
        with self._cond:
            self._stats = stats
        if self.observer is not None:
            p, g, itl = self._prompt_tokens_pending, self._gen_tokens_pending, self._itl
            self._prompt_tokens_pending = self._gen_tokens_pending = 0
            self._itl = []
            try:
                self.observer.on_step(stats, p, g, itl)
            except Exception:
                log.error("observer failed:\n%s", traceback.format_exc())

    def _stop(self, inbox: list[_Req], calls) -> None:
        for fn, fut in calls:
            fut.set_exception(RequestError("server", "the model is shutting down"))
        msg = "server: the model is shutting down; retry on another instance"
        for r in inbox:
            self._finish(r, RequestDelta(r.request_id, finished=True, finish_reason="abort", error=msg,
                                         error_kind="unavailable"))
        for r in list(self._reqs.values()):
            self._engine_abort(r.request_id)
            self._fail(r, "unavailable", msg)
        self._report()
