"""CPU time spent by this process tree and by everything else on the machine during a timed part (Linux /proc).

Stdlib only: harness/vllm_peer.py imports it from inside the vLLM venv too.

    with CpuMeter() as m:
        ...timed work...
    m.result  # {"wall_s", "own_cpu_s", "other_cpu_s", "machine_busy_s", "cores"}

own = this process and all its descendants (threads included, e.g. vLLM's engine-core process); other = the
machine's busy time (/proc/stat, all CPUs, excluding idle and iowait) minus own. On a quiet machine other is
near 0; a second benchmark, a test run or a compile shows up there.
"""
from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    steal = vals[7] if len(vals) > 7 else 0  # time the hypervisor gave to another guest: not ours either
    return (sum(vals[:8]) - idle - steal) / _TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in s) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may contain spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds of a process and its live descendants (finished children count once reaped: see below)."""
    root = os.getpid() if root is None else root
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, []))
    if root == os.getpid():  # children that exited and were waited for (e.g. compile workers)
        ru = os.times()
        total += ru.children_user + ru.children_system
    return total


class CpuMeter:
    def __init__(self, root: int | None = None):
        self.root = root
        self.result: dict = {}

    def __enter__(self) -> "CpuMeter":
        self._t, self._own, self._busy = time.perf_counter(), tree_cpu_s(self.root), machine_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t
        own = tree_cpu_s(self.root) - self._own
        busy = machine_busy_s() - self._busy
        self.result = {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": max(0.0, busy - own), "machine_busy_s": busy,
                       "cores": os.cpu_count()}
