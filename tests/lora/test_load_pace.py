"""Adapter loads paced to a CPU share (loom.lora.load_pace): the share rule against a direct computation, the pacer's
pauses against the CPU time it saw, the loader process held to a share the engine sets, the engine's loop never
waiting for a paced copy into rows, and the share the engine sets from its running and waiting requests."""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from harness.lora import peft_greedy, write_raw_adapter
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.lora import LoraModelSpec, load_pace
from loom.lora import adapter_registry as registry_mod
from loom.lora.load_pace import LoadShare, Pacer, load_share
from loom.lora.load_process import LoaderProcess
from loom.lora.peft_config import read_adapter_config

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("min_share,waiting,running,overdue", [
    (0.03, 0, 32, False), (0.03, 1, 32, False), (0.03, 1, 3, False), (0.03, 5, 5, False), (0.5, 1, 9, False),
    (0.03, 40, 1, False), (0.03, 0, 0, False), (0.03, 3, 0, False), (0.03, 1, 32, True), (1.0, 0, 8, False)])
def test_share_rule(min_share, waiting, running, overdue):
    want = 1.0 if running == 0 or overdue else min(1.0, max(min_share, waiting / (waiting + running)))
    assert load_share(min_share, waiting, running, overdue) == want


def test_pacer_sleeps_its_cpu_time_over_the_share(monkeypatch):
    """A fake thread clock: each pause sleeps used * (1 / share - 1) once `used` reaches the quantum; never at 1.0."""
    clock, slept = [0.0], []
    monkeypatch.setattr(load_pace.time, "thread_time", lambda: clock[0])
    monkeypatch.setattr(load_pace.time, "sleep", slept.append)
    share = [0.25]
    pace = Pacer(lambda: share[0], quantum=1e-3)
    pace()  # starts the count
    for used in (0.4e-3, 0.4e-3, 0.4e-3, 2e-3, 0.2e-3):
        clock[0] += used
        pace()
    assert slept == pytest.approx([1.2e-3 * 3, 2e-3 * 3])  # 1.2 ms reached the quantum, then 2 ms; 0.2 ms waits
    share[0] = 1.0
    clock[0] += 5e-3
    pace()
    assert len(slept) == 2


def test_pacer_pause_ends_when_woken():
    """A pause of ~1 s (1 ms of CPU at 0.001 of a core) ends as soon as its wake event is set (the loop waits for the
    copier: RowCopies' urgent waits)."""
    wake = threading.Event()
    pace = Pacer(lambda: 0.001, quantum=1e-3, wake=wake)
    pace()
    t = time.thread_time()
    while time.thread_time() - t < 1.5e-3:
        pass
    threading.Timer(0.05, wake.set).start()
    t0 = time.perf_counter()
    pace()
    assert time.perf_counter() - t0 < 0.9  # unwoken it would pause >= 1.5 s


def _schedstat_cpu(pid: int) -> float:
    """Seconds on a CPU of every thread of process pid (/proc/<pid>/schedstat: nanoseconds)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def test_loader_process_holds_the_share_the_engine_sets(tmp_path):
    """The child maps the engine's LoadShare: at 0.1 of a core, its CPU time for a load is at most 0.1 of the load's
    wall time plus what runs after its last pause (a bound only pacing meets: unpaced, its CPU time is about its
    wall time); the weights are those it loads unpaced."""
    cfg = types.SimpleNamespace(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1536,
                                num_hidden_layers=12, architectures=["LlamaForCausalLM"])
    spec = LoraModelSpec.from_hf_config(cfg)
    names = ("warm", "paced", "again")
    for i, name in enumerate(names):  # ~13 MB of float32 weights each
        write_raw_adapter(str(tmp_path / name), cfg, seed=i, r=32, alpha=64,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    share = LoadShare()
    lp = LoaderProcess(spec, torch.float32, 64, share)
    try:
        def load(name):
            path = str(tmp_path / name)
            return lp.load(path, name, read_adapter_config(path, name, 64))

        load("warm")  # the process started (its imports are not a load)
        share.set(0.1)
        c0, t0 = _schedstat_cpu(lp.pid), time.perf_counter()
        paced = load("paced")
        cpu, wall = _schedstat_cpu(lp.pid) - c0, time.perf_counter() - t0
        assert cpu > 0.005, cpu  # enough work for the bound to mean something
        assert cpu <= 0.1 * wall + 0.006, (cpu, wall)  # the last piece and the reply are not paused for
        share.set(1.0)
        unpaced = load("paced")
        assert all(torch.equal(paced.a[g], unpaced.a[g]) and torch.equal(paced.b[g], unpaced.b[g]) for g in paced.a)
    finally:
        lp.close()
        share.close()


def _engine(tiny_base, adapter_set, wait_steps: int) -> LLM:
    return LLM(tiny_base, adapter_roots=[str(adapter_set)], device="cpu", dtype="float32",
               kv_cache_memory_bytes=16 << 20, max_lora_rank=16, lora_load_cpu_share=0.1,
               max_lora_wait_steps=wait_steps)


@pytest.fixture
def engine(tiny_base, adapter_set):
    llm = _engine(tiny_base, adapter_set, 3)
    yield llm
    llm.close()


@pytest.fixture
def patient_engine(tiny_base, adapter_set):
    llm = _engine(tiny_base, adapter_set, 100)  # no request becomes overdue in the test
    yield llm
    llm.close()


def test_the_loop_never_waits_for_a_paced_copy(patient_engine, tiny_base, adapter_set, monkeypatch):
    """The copier held inside its first piece while a request runs (loads paced): the adapter's request is not run
    (its rows are not written) while the base request gets a token every step; released, the adapter's tokens are
    PEFT's."""
    eng, reg = patient_engine.engine, patient_engine.engine.adapters
    monkeypatch.setattr(registry_mod, "PIECE_BYTES", 0)  # the tiny adapter's copy counts as several pieces
    reg.load("a4")  # read into host memory first
    gate, guard = threading.Event(), threading.Timer(60, lambda: gate.set())
    guard.start()
    copies = reg.residency.copies
    real = copies.pace
    copies.pace = lambda: (gate.wait(), real())
    try:
        prompt, n = [5, 9, 14, 3, 8], 6
        eng.add_request("base", prompt, SamplingParams(max_tokens=40, **GREEDY))
        tokens = {"base": [], "lora": []}
        for o in eng.step():  # a request runs: loads are paced from here on (nothing running: a whole core)
            tokens[o.request_id] += o.new_token_ids
        assert reg.load_share.get() == pytest.approx(0.1)
        eng.add_request("lora", prompt, SamplingParams(max_tokens=n, **GREEDY), "a4")  # its rows placed ahead
        for _ in range(8):
            for o in eng.step():
                tokens[o.request_id] += o.new_token_ids
        assert not gate.is_set(), "the steps waited for the copy (the guard released it)"
        assert len(tokens["base"]) == 9 and tokens["lora"] == []
        assert reg.residency.copying(reg._names["a4"])
        gate.set()
        deadline = time.monotonic() + 60
        while len(tokens["lora"]) < n:
            assert time.monotonic() < deadline
            for o in eng.step():
                tokens[o.request_id] += o.new_token_ids
        assert tokens["lora"] == peft_greedy(tiny_base, str(adapter_set / "a4"), [prompt], n)[0][0]
    finally:
        gate.set()
        guard.cancel()
        copies.pace = real


def test_engine_share_from_running_waiting_and_overdue(engine, monkeypatch):
    """Three base requests run, one waits for an adapter whose read is held: the share is 1 / (1 + 3); once that
    request has waited max_lora_wait_steps (3) a whole core; with its adapter in rows and running, the minimum."""
    eng, reg = engine.engine, engine.engine.adapters
    gate = threading.Event()
    real = registry_mod.load_peft_adapter
    monkeypatch.setattr(registry_mod, "load_peft_adapter", lambda *a, **k: (gate.wait(60), real(*a, **k))[1])
    p = SamplingParams(max_tokens=30, **GREEDY)
    for i in range(3):
        eng.add_request(f"base{i}", [5, 9, 14, 3 + i], p)
    eng.step()
    eng.add_request("lora", [5, 9, 14, 3, 8], SamplingParams(max_tokens=4, **GREEDY), "a2")
    seen = []
    for _ in range(5):
        eng.step()
        seen.append(reg.load_share.get())
    assert seen[0] == pytest.approx(0.25) and seen[-1] == 1.0, seen
    gate.set()
    deadline = time.monotonic() + 60
    while "lora" not in eng.last_step_request_ids:
        assert time.monotonic() < deadline
        eng.step()
    assert reg.load_share.get() == pytest.approx(0.1)
