"""The output side of AsyncEngine, in its own thread: detokenization, stop strings, deltas, the final response.

The engine loop thread hands over each step's StepOutputs in one queue put and goes on with the next step; this
thread turns them into text deltas (incremental detokenizer, stop strings), calls each request's `on_output`,
and does the per-request bookkeeping (first token, inter-token latencies, metrics). Its cost per step grows
with the requests that got a token, but none of it is on the loop thread, which on a GPU mostly waits for the
device while this runs. Events are processed in order, so a request's deltas keep their order and a request
ends exactly once (whichever of its final output, an abort, a cancellation or a failure comes first).

Back to the loop thread (through AsyncEngine's condition): "abort this completion in the engine" when a stop
string ended it first, and "done" when a request's final delta is about to go out.
"""
from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import traceback
from typing import Any

from loom.engine.detokenizer import IncrementalDetokenizer
from loom.engine.outputs import EngineStats, StepOutput
from loom.serving.deltas import Observer, RequestDelta, RequestTiming, ServingRequest

log = logging.getLogger("loom.async_engine")


class OutputWorker:
    def __init__(self, owner: Any, tokenizer: Any, observer: Observer | None):
        self._owner = owner  # the AsyncEngine: request accounting and messages to the loop
        # its own copy: a fast tokenizer must not be used by two threads (the loop thread may encode bad_words)
        self._tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.observer = observer
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, ServingRequest] = {}
        self._itl: list[float] = []
        self._prompt_tokens = self._gen_tokens = 0
        self.busy_s = 0.0  # time spent on events (the serving benchmark reads it)
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="loom-outputs", daemon=True)
        self._thread.start()

    def post(self, *event) -> None:
        self._q.put(event)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        handlers = {"add": self._add, "step": self._step, "end": self._end}
        while True:
            ev = self._q.get()
            if ev[0] == "stop":
                return
            t = time.perf_counter()
            try:
                handlers[ev[0]](*ev[1:])
            except Exception:  # a bug here must not stop every request's output
                log.error("output worker error:\n%s", traceback.format_exc())
            self.busy_s += time.perf_counter() - t
            self._owner._worker_processed(ev[0])

    def _add(self, r: ServingRequest) -> None:
        n = r.params.n
        try:
            r.detoks = [IncrementalDetokenizer(self._tokenizer, r.prompt_token_ids, r.params) for _ in range(n)]
        except Exception as e:
            log.error("detokenizer failed:\n%s", traceback.format_exc())
            self._owner._engine_abort_later(r, None)
            self._fail(r, "internal", f"detokenizer: {type(e).__name__}: {e}")
            return
        r.num_output, r.cumulative, r.last_token = [0] * n, [0.0] * n, [None] * n
        r.num_prompt_tokens = len(r.prompt_token_ids)  # until the engine reports it (after truncation)
        self._reqs[r.request_id] = r

    def _step(self, outputs: list[StepOutput], stats: EngineStats, t_step: float) -> None:
        self.steps += 1
        reqs = self._reqs
        for o in outputs:
            r = reqs.get(o.request_id)
            if r is not None and o.index not in r.done:  # else ended already: an abort's echo is ignored
                self._on_output(r, o, t_step)
        if self.observer is not None:
            p, g, itl = self._prompt_tokens, self._gen_tokens, self._itl
            self._prompt_tokens = self._gen_tokens = 0
            self._itl = []
            try:
                self.observer.on_step(stats, p, g, itl)
            except Exception:
                log.error("observer failed:\n%s", traceback.format_exc())

    def _end(self, r: ServingRequest, kw: dict) -> None:
        """The loop ended a request (abort, cancellation, deadline, failure, refusal, shutdown)."""
        if not r.closed:
            self._finish(r, self._delta(r, 0, finished=True, finish_reason="abort", **kw))

    # ------------------------------------------------------------ per request

    def _on_output(self, r: ServingRequest, o: StepOutput, now: float) -> None:
        if o.finish_reason == "error" or o.error:
            self._owner._engine_abort_later(r, None)  # its other completions, if any
            self._fail(r, "internal", o.error or "engine: the request failed")
            return
        i = o.index
        r.num_prompt_tokens, r.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
        new = o.new_token_ids
        timing = None
        if new and r.first_token is None:  # prefill done: count the prompt once
            r.first_token = o.timing[1] if o.timing is not None else now
            self._prompt_tokens += o.num_prompt_tokens
            self._owner._started(r)
            if o.timing is not None:
                timing = {"first_scheduled": o.timing[0], "first_token": o.timing[1]}
        if new and self.observer is not None:
            last = r.last_token[i]
            if last is not None:  # vLLM's inter-token latency: one observation per token after the first
                self._itl.extend([(now - last) / len(new)] * len(new))
            elif len(new) > 1:
                self._itl.extend([0.0] * (len(new) - 1))
            r.last_token[i] = now
        r.num_output[i] += len(new)
        r.cumulative[i] = o.cumulative_logprob
        self._gen_tokens += len(new)
        try:
            u = r.detoks[i].update(new, o.finished, o.finish_reason)
        except Exception as e:
            log.error("detokenizer failed:\n%s", traceback.format_exc())
            self._owner._engine_abort_later(r, None)
            self._fail(r, "internal", f"detokenizer: {type(e).__name__}: {e}")
            return
        if u.abort_engine:
            self._owner._engine_abort_later(r, i)
        if u.finished:
            r.done[i] = u.finish_reason
        if timing is not None:
            timing["emitted"] = time.monotonic()
        delta = self._delta(r, i, text=u.text, token_ids=list(new), logprobs=o.new_logprobs,
                            finished=len(r.done) == r.params.n, finish_reason=u.finish_reason if u.finished else None,
                            prompt_logprobs=o.prompt_logprobs, timing=timing)
        if delta.finished:
            self._finish(r, delta)
        else:
            self._emit(r, delta)

    def _delta(self, r: ServingRequest, index: int = 0, **kw) -> RequestDelta:
        return RequestDelta(r.request_id, num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=r.num_cached_tokens,
                            num_output_tokens=r.num_output[index] if r.num_output else 0,
                            cumulative_logprob=r.cumulative[index] if r.cumulative else 0.0, index=index, **kw)

    def _fail(self, r: ServingRequest, kind: str, message: str) -> None:
        self._finish(r, self._delta(r, finished=True, finish_reason="abort", error=message, error_kind=kind))

    def _finish(self, r: ServingRequest, delta: RequestDelta) -> None:
        r.closed = True
        self._reqs.pop(r.request_id, None)
        self._owner._closed(r)  # before the final delta goes out: the id is free again once the client sees it
        if self.observer is not None:
            try:
                self.observer.on_request_finished(RequestTiming(
                    r.request_id, r.arrival, r.first_token, time.monotonic(), r.num_prompt_tokens, sum(r.num_output),
                    delta.finish_reason, delta.error_kind, r.params.n))
            except Exception:
                log.error("observer failed:\n%s", traceback.format_exc())
        self._emit(r, delta)

    def _emit(self, r: ServingRequest, delta: RequestDelta) -> None:
        try:
            r.on_output(delta)
        except Exception:
            log.error("on_output callback failed for %s:\n%s", r.request_id, traceback.format_exc())
