"""Sending side: per-request outboxes drained by sender threads, merging what piles up during a send.

A Triton `send()` costs ~0.3 ms of server time while one engine step can produce a token for hundreds of
requests: sending one response per token per request would cap throughput. So the engine loop only
merges each delta into its request's outbox, and a sender thread sends whatever is there as one
response; at most one send per request is in flight, which keeps each request's responses in order.
A request with n completions keeps one pending delta per completion; a send gets them all (by index).
A request's first response goes out before the queued later ones of other requests: a step that starts one stream
among many running ones would otherwise queue its first token behind a send per running stream (time to first
token through tritonserver at 64 streams: ~16 ms p50 from emitted to sent), while a later token waits at most the
few first responses of that step.
"""
from __future__ import annotations

import collections
import logging
import threading
import traceback
from typing import Any, Callable

from loom.serving.async_engine import RequestDelta

log = logging.getLogger("loom.response_streamer")


class Outbox:
    """One request's not-yet-sent output. Guarded by the streamer's lock."""
    __slots__ = ("ctx", "stream", "pending", "finished", "queued", "in_flight", "sent")

    def __init__(self, ctx: Any, stream: bool):
        self.ctx, self.stream = ctx, stream
        self.pending: dict[int, RequestDelta] = {}  # completion index -> what it produced since the last send
        self.finished = False
        self.queued = self.in_flight = self.sent = False

    def ready(self) -> bool:
        return bool(self.pending) and (self.stream or self.finished)


class ResponseStreamer:
    """Sender threads that drain per-request outboxes: at most one send in flight per request (keeps
    order), and everything produced meanwhile goes out merged as one response. Non-streaming requests
    are sent once, when finished."""

    def __init__(self, send: Callable[[Any, list[RequestDelta]], None], num_threads: int = 1):
        self._send = send
        self._cond = threading.Condition()
        self._first: collections.deque[Outbox] = collections.deque()  # nothing sent yet: these go first
        self._queue: collections.deque[Outbox] = collections.deque()
        self._stopping = False
        self.sends = 0
        self._threads = [threading.Thread(target=self._run, name=f"loom-sender-{i}", daemon=True)
                         for i in range(max(1, num_threads))]
        for t in self._threads:
            t.start()

    def open(self, ctx: Any, stream: bool) -> Callable[[RequestDelta], None]:
        """An `on_output` callback for one request; `ctx` is handed back to `send` with the pending deltas."""
        ob = Outbox(ctx, stream)

        def on_output(delta: RequestDelta) -> None:
            with self._cond:
                have = ob.pending.get(delta.index)
                if have is None:
                    ob.pending[delta.index] = delta
                else:
                    have.merge(delta)
                ob.finished = ob.finished or delta.finished
                if ob.ready() and not ob.queued and not ob.in_flight:
                    self._enqueue(ob)
        return on_output

    def _enqueue(self, ob: Outbox) -> None:  # with the lock held
        ob.queued = True
        (self._queue if ob.sent else self._first).append(ob)
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._first and not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._first and not self._queue:
                    return
                ob = (self._first or self._queue).popleft()
                ob.queued, ob.in_flight, ob.sent = False, True, True
                deltas = [ob.pending[i] for i in sorted(ob.pending)]
                ob.pending = {}
                if ob.finished:  # the final send says so on every delta it carries
                    for d in deltas:
                        d.finished = True
            try:
                self._send(ob.ctx, deltas)
            except Exception:
                log.error("sending a response failed:\n%s", traceback.format_exc())
            with self._cond:
                self.sends += 1
                ob.in_flight = False
                if ob.ready() and not ob.queued:
                    self._enqueue(ob)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
