"""Thread-safe front of one LLMEngine: one loop thread steps the engine; callers submit and get deltas.

Why one thread: the engine (scheduler, block manager, model runner) is not thread-safe, and on a GPU the step
is the bottleneck anyway. Everything that touches the engine (add, abort, adapter ops, stats) runs in the loop
thread between steps; other threads hand work over through `self._cond`. The loop does only engine work: per
step it hands the step's outputs to the output worker (loom.serving.output_worker: detokenization, stop strings,
deltas, `on_output`) in one queue put, and hears back only about changes (a completion a stop string ended, a
request whose final delta went out). Cancellation is polled by its own thread (loom.serving.cancel_watch) and
deadlines sit in a heap, so what the loop does per step does not grow with the number of running requests
beyond the engine step itself. `on_output` runs in the output worker and must be cheap: the Triton glue puts
deltas into an `Outbox`, and `ResponseStreamer` threads send them, merging whatever piled up while a send was in
flight into one response.

A request with n > 1 completions produces one delta stream per completion (`RequestDelta.index`); the request
is finished when all n are. Health: a sticky device error reported by the engine, too many failed steps in a
row, or the loop thread dying make the engine unhealthy for good: in-flight requests fail, new ones are refused
(UNAVAILABLE), and `on_unhealthy` tells the Triton glue (which stops reporting the model ready).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from loom.device import bind_thread
from loom.engine.faults import is_sticky_device_error
from loom.engine.outputs import EngineStats
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.serving.cancel_watch import CancelWatcher
from loom.serving.deltas import Observer, RequestDelta, RequestTiming, ServingRequest
from loom.serving.output_worker import OutputWorker

__all__ = ["AsyncEngine", "AsyncStats", "Observer", "RequestDelta", "RequestTiming"]

log = logging.getLogger("loom.async_engine")

# Steps the loop may run before the output worker has processed them (the worker's time overlaps the next step;
# more lead would only let output, and the aborts stop strings cause, fall behind).
MAX_STEPS_AHEAD = 2
# A step with a request's first token and at most this many outputs yields the GIL to the output worker at once.
YIELD_MAX_OUTPUTS = 4
# An idle loop asks the engine for its health this often (a dead tensor-parallel rank makes the model not ready
# without waiting for a request to find it).
IDLE_HEALTH_CHECK_S = 1.0


@dataclass
class AsyncStats:
    engine: EngineStats
    num_active: int  # submitted and not finished
    num_unstarted: int  # submitted, no token yet (what admission control bounds)
    max_queue_size: int
    steps: int
    step_errors: int
    requests_total: int


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue_size: int = 1024, default_timeout_s: float | None = None,
                 observer: Observer | None = None, max_failed_steps: int = 16,
                 on_unhealthy: Callable[[str], None] | None = None, cancel_poll_interval_s: float = 0.02,
                 cancel_poll_duty: float = 0.05):
        self.engine = engine
        self.max_queue_size = max_queue_size
        self.default_timeout_s = default_timeout_s
        self.observer = observer
        self.max_failed_steps = max_failed_steps  # failed steps in a row that make the engine unhealthy (0: never)
        self.on_unhealthy = on_unhealthy
        self._unhealthy: str | None = None
        self._cond = threading.Condition()
        self._inbox: list[ServingRequest] = []
        self._aborts: list[tuple[str, str | None]] = []  # (request id, "cancelled" or None)
        self._calls: list[tuple[Callable[[Any], Any], Future]] = []
        self._msgs: list[tuple] = []  # from the output worker: ("done", req) / ("abort", req, index)
        self._worker_pending = 0  # events posted to the output worker and not processed yet (guarded by _cond)
        self._steps_behind = 0  # of which steps: the loop runs at most MAX_STEPS_AHEAD steps ahead of the worker
        self._ids: set[str] = set()  # every accepted, unfinished request id (guarded by _cond)
        self._unstarted = 0  # guarded by _cond
        self._stopping = False
        self._reqs: dict[str, ServingRequest] = {}  # loop thread only: requests the engine may still hold
        self._deadlines: list[tuple[float, int, ServingRequest]] = []  # loop thread only: a heap
        self._seq = itertools.count()
        self._stats = EngineStats()
        self._steps = self._step_errors = self._requests_total = 0
        self._consecutive_errors = 0
        self.loop_busy_s = 0.0  # loop time outside engine.step() (the serving benchmark reads it)
        self._worker = OutputWorker(self, getattr(engine, "tokenizer", None), observer)
        self._watcher = CancelWatcher(self._cancelled, cancel_poll_interval_s, cancel_poll_duty)
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
        req = ServingRequest(request_id, list(prompt_token_ids), params, lora_name, on_output or (lambda d: None),
                             is_cancelled, now + timeout_s if timeout_s else None, timeout_s, now)
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
        if is_cancelled is not None:
            self._watcher.watch(request_id, req)

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append((request_id, None))
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

    def timings(self) -> dict:
        """Where the serving layer's time goes (for the overhead benchmark): per engine step, the loop's time outside
        engine.step(), the output worker's time; per cancellation sweep, its time."""
        steps = max(1, self._steps)
        w = self._watcher
        return {"loop_ms_per_step": self.loop_busy_s / steps * 1e3,
                "detok_ms_per_step": self._worker.busy_s / steps * 1e3,
                "cancel_ms_per_sweep": w.sweep_s / max(1, w.sweeps) * 1e3, "cancel_sweeps": w.sweeps,
                "cancel_polls": w.polls}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail whatever is still in flight (error kind "unavailable") and stop the threads."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # the loop handed its last events over; else it still holds them
            self._worker.join(max(0.1, deadline - time.monotonic()))
        self._watcher.stop(max(0.1, deadline - time.monotonic()))

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

    # ------------------------------------------------------------ from the other threads

    def _cancelled(self, rid: str, req: ServingRequest) -> None:
        """The cancellation watcher found this request cancelled."""
        with self._cond:
            self._aborts.append((rid, "cancelled"))
            self._cond.notify()

    def _started(self, r: ServingRequest) -> None:  # output worker: its first token
        with self._cond:
            self._unstarted -= 1

    def _closed(self, r: ServingRequest) -> None:
        """Output worker: the request's final delta is about to go out. The loop forgets it (and aborts what the
        engine may still hold of it) before the id can be reused."""
        with self._cond:
            self._msgs.append(("done", r))
            self._ids.discard(r.request_id)
            if r.first_token is None:
                self._unstarted -= 1
            self._cond.notify()
        if r.is_cancelled is not None:
            self._watcher.unwatch(r.request_id, r)

    def _engine_abort_later(self, r: ServingRequest, index: int | None) -> None:
        """Output worker: a stop string (or a failure) ended this completion (all of them: None) first."""
        with self._cond:
            self._msgs.append(("abort", r, index))
            self._cond.notify()

    def _worker_processed(self, kind: str) -> None:
        with self._cond:
            self._worker_pending -= 1
            if kind == "step":
                self._steps_behind -= 1
                if self._steps_behind == MAX_STEPS_AHEAD - 1:
                    self._cond.notify()
            if not self._worker_pending:
                self._cond.notify()

    def _post(self, kind: str, *event) -> None:
        with self._cond:
            self._worker_pending += 1
            if kind == "step":
                self._steps_behind += 1
        self._worker.post(kind, *event)

    def _end(self, r: ServingRequest, **kw) -> None:
        """The request ends here (loop thread): the worker sends its final delta unless it ended already."""
        if self._reqs.get(r.request_id) is r:
            del self._reqs[r.request_id]
        self._post("end", r, kw)

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
            self._end(r, error=msg, error_kind="unavailable")
        for r in list(self._reqs.values()):
            self._engine_abort(r.request_id)
            self._end(r, error=msg, error_kind="unavailable")
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

    def _idle(self) -> bool:
        """Nothing to do: wait (called with the condition held)."""
        if self._inbox or self._aborts or self._calls or self._stopping or self._msgs:
            return False
        if self._engine_busy():
            # a bounded lead over the output worker: output (and a stop string's abort) is never far behind
            return self._steps_behind >= MAX_STEPS_AHEAD
        # requests the engine no longer holds: the worker is still sending their ends, or they vanished
        return not (self._reqs and self._worker_pending == 0)

    def _loop(self) -> None:
        while True:
            with self._cond:
                idle_check = False
                while self._idle():
                    if not self._cond.wait(IDLE_HEALTH_CHECK_S):
                        idle_check = True
                        break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
                msgs, self._msgs = self._msgs, []
                stopping = self._stopping
                worker_idle = self._worker_pending == 0 and not msgs
            t0 = time.perf_counter()
            step_s = 0.0
            try:
                if stopping:
                    self._stop(inbox, calls)
                    return
                for m in msgs:  # before the inbox: a finished request's id may come back in it
                    self._from_worker(m)
                for fn, fut in calls:
                    self._call(fn, fut)
                for rid, kind in aborts:
                    self._abort(rid, kind, inbox)
                for req in inbox:
                    self._add(req)
                if self._deadlines:
                    self._expire(time.monotonic())
                if idle_check and self._unhealthy is None:
                    self._check_idle_health()
                if self._unhealthy is not None:
                    for r in list(self._reqs.values()):  # raced in after the engine broke
                        self._end(r, error=f"server: the model is unavailable: its engine is unhealthy "
                                           f"({self._unhealthy})", error_kind="unavailable")
                elif self._engine_busy():
                    if self._steps_behind < MAX_STEPS_AHEAD:
                        t1 = time.perf_counter()
                        self._step()
                        step_s = time.perf_counter() - t1
                elif self._reqs and worker_idle:
                    # The engine lost requests we still track: fail them instead of spinning.
                    for r in list(self._reqs.values()):
                        self._end(r, error="engine: the request vanished from the engine", error_kind="internal")
                try:
                    stats = self.engine.stats()
                except Exception:
                    stats = self._stats
                with self._cond:
                    self._stats = stats
            except Exception:  # a bug here must not kill the thread that serves everyone
                log.error("engine loop error:\n%s", traceback.format_exc())
                time.sleep(0.01)
            self.loop_busy_s += time.perf_counter() - t0 - step_s

    def _engine_busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _from_worker(self, m: tuple) -> None:
        r = m[1]
        if self._reqs.get(r.request_id) is not r:
            return  # the loop ended it already
        if m[0] == "done":
            del self._reqs[r.request_id]
            self._engine_abort(r.request_id)  # a no-op when the engine finished it; else a stop string did
        else:
            self._engine_abort(r.request_id, m[2])

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

    def _add(self, r: ServingRequest) -> None:
        try:
            self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.lora_name)
        except RequestError as e:
            self._end(r, error=str(e), error_kind="invalid")
            return
        except Exception as e:
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._end(r, error=f"engine: add_request failed: {type(e).__name__}: {e}", error_kind="internal")
            return
        self._reqs[r.request_id] = r
        self._post("add", r)
        if r.deadline is not None:
            heapq.heappush(self._deadlines, (r.deadline, next(self._seq), r))

    def _abort(self, rid: str, kind: str | None, inbox: list[ServingRequest]) -> None:
        kw = {"error": "cancelled: the client cancelled the request", "error_kind": "cancelled"} if kind else {}
        r = self._reqs.get(rid)
        if r is not None:
            self._engine_abort(rid)
            self._end(r, **kw)
            return
        for q in inbox:
            if q.request_id == rid:
                inbox.remove(q)
                self._end(q, **kw)
                return

    def _expire(self, now: float) -> None:
        """Deadlines, from a heap: the loop only looks at the ones that passed."""
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, r = heapq.heappop(self._deadlines)
            if self._reqs.get(r.request_id) is r:
                self._engine_abort(r.request_id)
                self._end(r, error=f"request_timeout_s: the request ran past its deadline of {r.timeout_s:g} s",
                          error_kind="timeout")

    def _engine_abort(self, rid: str, index: int | None = None) -> None:
        try:
            if index is None:
                self.engine.abort_request(rid)
            else:
                self.engine.abort_request(rid, index=index)
        except Exception:
            log.error("abort_request(%s) failed:\n%s", rid, traceback.format_exc())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._on_step_error(e)
            return
        self._steps += 1
        self._consecutive_errors = 0
        try:
            stats = self.engine.stats()
        except Exception:
            stats = self._stats
        self._post("step", outputs, stats, time.monotonic())
        if len(outputs) <= YIELD_MAX_OUTPUTS and any(o.timing is not None for o in outputs):
            # A request's first token at light load: hand the GIL to the output worker now, or it waits until the
            # next step's host work reaches a call that releases it (TTFT's detokenize stage at one request: 0.9-1.0
            # ms p50 before, 0.5-0.7 after). The loop waits while the worker handles these few outputs; with more,
            # or for later tokens (a constant delay leaves the inter-token latency as is), it goes straight on.
            time.sleep(0)
        fatal = getattr(self.engine, "fatal_error", None)  # a sticky device error: every later step would fail
        if fatal:
            self._mark_unhealthy(fatal)
        elif self.max_failed_steps and getattr(self.engine, "failed_steps_in_a_row", 0) >= self.max_failed_steps:
            self._mark_unhealthy(f"{self.engine.failed_steps_in_a_row} engine steps in a row failed")

    def _check_idle_health(self) -> None:
        check = getattr(self.engine, "check_health", None)
        reason = check() if check is not None else None
        if reason:
            self._mark_unhealthy(reason)

    def _on_step_error(self, e: Exception) -> None:
        """Fail the requests of the failed step with the cause and keep serving the rest."""
        self._step_errors += 1
        self._consecutive_errors += 1
        log.error("engine step failed:\n%s", traceback.format_exc())
        ids = self.engine.last_step_request_ids  # the requests scheduled in the failed step
        victims = [self._reqs[i] for i in ids if i in self._reqs] if ids else list(self._reqs.values())
        for r in victims:
            self._engine_abort(r.request_id)
            self._end(r, error=f"engine: step failed: {type(e).__name__}: {e}", error_kind="internal")
        if is_sticky_device_error(e):
            self._mark_unhealthy(f"sticky device error: {type(e).__name__}: {e}")
            return
        if self.max_failed_steps and self._consecutive_errors >= self.max_failed_steps:
            self._mark_unhealthy(f"{self._consecutive_errors} engine steps in a row failed (last: "
                                 f"{type(e).__name__}: {e})")
            return
        time.sleep(min(0.001 * 2 ** self._consecutive_errors, 1.0))  # a broken engine must not spin a core

    def _stop(self, inbox: list[ServingRequest], calls) -> None:
        for fn, fut in calls:
            fut.set_exception(RequestError("server", "the model is shutting down"))
        msg = "server: the model is shutting down; retry on another instance"
        for r in inbox:
            self._end(r, error=msg, error_kind="unavailable")
        for r in list(self._reqs.values()):
            self._engine_abort(r.request_id)
            self._end(r, error=msg, error_kind="unavailable")
        self._worker.post("stop")
