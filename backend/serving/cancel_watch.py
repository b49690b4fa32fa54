"""Cancellation polling off the engine loop thread, with a bounded share of the CPU.

Triton's `is_cancelled()` costs about 0.1 ms a call (a round trip through the Python stub's IPC), so asking every
running request every step would cost the loop 25 ms a step at 256 requests. This thread sweeps the watched
requests instead, then sleeps long enough that sweeping takes at most `duty` of the time (and at least
`interval_s` between sweeps): a cancellation is noticed within about max(interval_s, sweep / duty), and the loop
only hears about the requests that were cancelled.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("loom.async_engine")


class CancelWatcher:
    def __init__(self, on_cancelled: Callable[[str, object], None], interval_s: float = 0.02, duty: float = 0.05):
        self._on_cancelled = on_cancelled
        self.interval_s = interval_s
        self.duty = duty
        self._cond = threading.Condition()
        self._watched: dict[str, object] = {}  # request id -> the request (has .is_cancelled)
        self._stopping = False
        self.sweeps = 0
        self.polls = 0
        self.sweep_s = 0.0
        self._thread = threading.Thread(target=self._run, name="loom-cancel-watch", daemon=True)
        self._thread.start()

    def watch(self, rid: str, req) -> None:
        with self._cond:
            if not self._watched:
                self._cond.notify()  # it waits for something to watch (not woken between sweeps)
            self._watched[rid] = req

    def unwatch(self, rid: str, req) -> None:
        """Stop asking; on return no is_cancelled() call for it is in progress (call before the final response)."""
        with self._cond:
            if self._watched.get(rid) is req:
                del self._watched[rid]

    def stop(self, timeout: float = 1.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watched and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                items = list(self._watched.items())
            t0 = time.perf_counter()
            for rid, req in items:
                # under the lock, and only while still watched: once unwatch() returns no call is in progress,
                # and the sender may be finished (asking a finished Triton response factory crashes the server)
                with self._cond:
                    if self._watched.get(rid) is not req:
                        continue
                    try:
                        cancelled = bool(req.is_cancelled())
                    except Exception:
                        cancelled = False
                    if cancelled:
                        del self._watched[rid]
                if cancelled:
                    try:
                        self._on_cancelled(rid, req)
                    except Exception:
                        log.exception("cancellation hand-over failed")
            took = time.perf_counter() - t0
            self.sweeps += 1
            self.polls += len(items)
            self.sweep_s += took
            with self._cond:
                if not self._stopping:
                    self._cond.wait(max(self.interval_s, took * (1 - self.duty) / self.duty))
