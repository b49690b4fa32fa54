"""LOOM_TIMING_LOG=<path>: one JSON line per request when its first token is sent, with the stages of its time to
first token (time.monotonic(), comparable across the processes of one machine). For the serving benchmark's
waterfall; off (and free) unless the variable is set."""
from __future__ import annotations

import json
import threading

from loom.serving.responses import ResponseState


class TimingLog:
    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, state: ResponseState, timing: dict | None, t_sent: float) -> None:
        rec = {"id": state.request_id, "arrival": state.t_arrival, "parsed": state.t_parsed,
               "tokenized": state.t_tokenized, "submitted": state.t_submitted, **(timing or {}), "first_sent": t_sent}
        with self._lock:
            self._f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self._f.close()
