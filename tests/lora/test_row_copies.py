"""RowCopies' order of adapter row copies against the steps (loom.lora.row_copies): the CUDA path with a stand-in for
the streams that records what each operation waits on, and the CPU path with its helper thread."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from loom.lora.row_copies import RowCopies


class FakeStreams:
    """Records the stream operations RowCopies makes, as (what, on which stream, of what)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = "compute"
        self.copy = self._Stream(self, "copy")
        self._compute = self._Stream(self, "compute")
        self.events = 0

    class _Stream:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def wait_stream(self, other):
            self.owner.log.append(("wait_stream", self.name, other.name))

        def wait_event(self, ev):
            self.owner.log.append(("wait_event", self.name, ev.name))

    class _Event:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def record(self):
            self.owner.log.append(("record", self.owner.current, self.name))

    def compute(self):
        return self._compute

    @contextmanager
    def on_copy(self):
        prev, self.current = self.current, "copy"
        try:
            yield
        finally:
            self.current = prev

    def event(self):
        self.events += 1
        return self._Event(self, f"e{self.events}")


def test_cuda_copies_follow_queued_steps_and_steps_wait_for_their_rows():
    s = FakeStreams()
    rc = RowCopies(torch.device("cuda"), streams=s)
    rc.write("v1", lambda: s.log.append(("copy", s.current, "v1")))
    # the copy is queued after the compute stream's work (rows just freed may still be read), on the copy stream,
    # and marked by an event recorded there
    assert s.log == [("wait_stream", "copy", "compute"), ("copy", "copy", "v1"), ("record", "copy", "e1")]
    rc.write("v2", lambda: s.log.append(("copy", s.current, "v2")))
    rc.write("v1", lambda: s.log.append(("copy", s.current, "v1")))  # v1 again (evicted, placed anew): e3 its end
    s.log.clear()
    rc.sync("v1")
    assert s.log == [("wait_event", "compute", "e3")]  # the step waits for v1's latest copy only, on the device
    rc.sync("v1")
    rc.sync("never-written")
    assert s.log == [("wait_event", "compute", "e3")]  # nothing more to wait for
    assert rc.in_flight("v2")
    rc.forget("v2")  # freed before use: nobody waits on it ...
    rc.sync("v2")
    assert s.log == [("wait_event", "compute", "e3")]
    rc.write("v3", lambda: None)
    s.log.clear()
    rc.drain()  # ... but rows move only after every copy in flight, a forgotten one's included
    assert s.log == [("wait_stream", "compute", "copy")] and not rc.in_flight("v3")


def test_cpu_copies_run_on_the_helper_thread_in_order_and_sync_waits():
    rc = RowCopies(torch.device("cpu"))
    gate, order, main = threading.Event(), [], threading.get_ident()
    rc.write("v1", lambda: (gate.wait(10), order.append(("v1", threading.get_ident() != main))))
    rc.write("v2", lambda: order.append(("v2", threading.get_ident() != main)))
    assert order == [] and rc.in_flight("v1")  # the loop thread did not wait for the copy
    gate.set()
    rc.sync("v2")  # v2's copy done implies v1's (one worker, in order)
    assert order == [("v1", True), ("v2", True)]
    rc.write("v3", lambda: order.append(("v3", True)))
    rc.drain()
    assert order[-1] == ("v3", True) and not rc.in_flight("v1")
    rc.close()
