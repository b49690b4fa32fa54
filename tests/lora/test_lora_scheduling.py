"""Adapter-aware admission (EngineConfig.max_lora_wait_steps, loom.engine.core.scheduler) and prefetch (a queued
request's adapter moves disk -> host -> device before it is admitted), step by step through the engine on the tiny
Llama.

Queue time is counted in steps: a request added before step s whose first token comes in step s waited 0 steps.
Adapters are read into host memory before a trace starts, so every trace is deterministic (no disk timing)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

import loom.lora.adapter_registry as registry_mod
from harness.lora import admission_bound, tiny_llama_config, write_raw_adapter
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import ConfigError
from loom.lora import LoraModelSpec, LoraPool
from loom.lora.lora_stats import HOST_TO_DEVICE

CFG = tiny_llama_config()
ROW = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(CFG), torch.float32, "cpu")
RANK = 4
TAIL = 20
NAMES = ["hot"] + [f"t{i}" for i in range(TAIL)]
MAX_TOKENS = 4  # a request runs 4 steps: its prompt (one step, first token) and 3 decodes


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched-adapters")
    for i, n in enumerate(NAMES):
        write_raw_adapter(str(root / n), CFG, seed=i, r=RANK, alpha=2 * RANK, target_modules=["q_proj", "v_proj"])
    return root


def make_llm(base, root, slots: int, **kw) -> LLM:
    """Device rows for `slots` adapters; every adapter of NAMES read into host memory up front. Loads unpaced
    (lora_load_cpu_share 1.0): a request whose rows the copier still writes is admitted once they are written, not
    at a later step that depends on the copier thread's timing (tests/lora/test_load_pace.py tests that)."""
    args = dict(adapter_roots=[str(root)], device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
                max_lora_rank=16, lora_memory_bytes=slots * RANK * ROW, max_host_adapters=64, max_num_seqs=64,
                lora_load_cpu_share=1.0)
    llm = LLM(base, **(args | kw))
    reg = llm.engine.adapters
    for n in NAMES:
        ref = reg.acquire(n)
        while not ref.ready:
            reg.wait_for_loads(5)
        reg.release(ref)
    return llm


def hot_and_tail(steps: int, p_hot: float, p_tail: float, seed: int = 0) -> list[tuple[int, str]]:
    """(arrival step, adapter): the hot adapter with probability p_hot each step, and with p_tail a request for one of
    the TAIL others, Zipf(1) over them (a few warm ones, a long tail)."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(TAIL)]
    out = []
    for s in range(steps):
        if rng.random() < p_hot:
            out.append((s, "hot"))
        if rng.random() < p_tail:
            out.append((s, rng.choices(NAMES[1:], weights)[0]))
    return out


def run_trace(llm: LLM, trace: list[tuple[int, str]]) -> dict:
    """Feed the trace step by step -> per request (index in trace) its arrival, first-token and last steps, and the
    evictions and host -> device writes it caused."""
    eng, reg = llm.engine, llm.engine.adapters
    loads0, evictions0 = len(reg.stats().loads), reg.num_evictions
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    i = step = 0
    while i < len(trace) or eng.has_unfinished_requests():
        while i < len(trace) and trace[i][0] <= step:
            eng.add_request(str(i), [5, 6, 7, 8], params, trace[i][1])
            i += 1
        for o in eng.step():
            assert o.error is None, o.error
            first.setdefault(int(o.request_id), step)
            if o.finished:
                last[int(o.request_id)] = step
        step += 1
    writes = sum(1 for x in reg.stats().loads[loads0:] if x.tier == HOST_TO_DEVICE)
    return {"arrival": [s for s, _ in trace], "first": [first[k] for k in range(len(trace))],
            "last": [last[k] for k in range(len(trace))], "evictions": reg.num_evictions - evictions0,
            "writes": writes}


def queue_times(run: dict) -> list[int]:
    return [f - a for f, a in zip(run["first"], run["arrival"])]


def stated_bound(run: dict, w: int) -> list[int]:
    return admission_bound(run["arrival"], run["first"], run["last"], w)


def test_grouping_thrashes_less_than_fcfs_and_no_request_waits_past_the_bound(tiny_base, root):
    """One hot adapter and a Zipf tail, rows for 3 adapters: every request waits at most the stated bound, and here
    at most W + one request's run; FCFS (W = 0) on the same trace evicts and writes rows more often; without the bound
    (W huge) the same trace keeps a request waiting longer than W + one run (grouping alone can starve)."""
    w = 8
    trace = hot_and_tail(150, p_hot=0.9, p_tail=0.5)
    grouped = run_trace(make_llm(tiny_base, root, slots=3, max_lora_wait_steps=w), trace)
    fcfs = run_trace(make_llm(tiny_base, root, slots=3, max_lora_wait_steps=0), trace)
    unbounded = run_trace(make_llm(tiny_base, root, slots=3, max_lora_wait_steps=1 << 20), trace)
    qt = queue_times(grouped)
    assert all(q <= b for q, b in zip(qt, stated_bound(grouped, w)))
    assert max(qt) <= w + MAX_TOKENS, max(qt)
    assert grouped["evictions"] < fcfs["evictions"] and grouped["writes"] < fcfs["writes"], (grouped, fcfs)
    assert max(queue_times(unbounded)) > w + MAX_TOKENS
    # more adapters wanted at once than 2 rows can serve (queues grow under any order): the stated bound still holds
    overloaded = run_trace(make_llm(tiny_base, root, slots=2, max_lora_wait_steps=w), trace)
    assert all(q <= b for q, b in zip(queue_times(overloaded), stated_bound(overloaded, w)))
    with pytest.raises(ConfigError, match="max_lora_wait_steps"):
        EngineConfig(max_lora_wait_steps=-1)


def test_prefetch_while_queued_and_a_slow_disk_does_not_hold_up_other_steps(tiny_base, root, monkeypatch):
    """A request's adapter is read from disk when the request is queued: while that read is held (an Event-gated
    loader), the other requests' steps go on; once it lands, the adapter is written into free device rows while the
    request still waits for a sequence slot, so its admission writes nothing."""
    llm = make_llm(tiny_base, root, slots=3, max_num_seqs=1)
    eng, reg = llm.engine, llm.engine.adapters
    gate, reading = threading.Event(), threading.Event()
    real = registry_mod.load_peft_adapter

    def slow(*a, **k):
        reading.set()
        assert gate.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(registry_mod, "load_peft_adapter", slow)
    write_raw_adapter(str(root / "cold"), CFG, seed=99, r=RANK, alpha=2 * RANK, target_modules=["q_proj"])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng.add_request("busy", [5, 6, 7, 8], params, "hot")
    eng.add_request("cold", [5, 6, 7, 8], params, "cold")  # queued behind "busy": max_num_seqs=1
    assert reading.wait(30)  # its read started at add_request
    tokens = {"busy": 0, "cold": 0}

    def step():
        for o in eng.step():
            tokens[o.request_id] += len(o.new_token_ids)

    for _ in range(3):  # the read is held: the hot adapter's request keeps decoding
        step()
    assert tokens == {"busy": 3, "cold": 0}
    assert {d["name"]: d["state"] for d in reg.list()}["cold"] == "loading"
    gate.set()
    while not reg.wait_for_loads(5):
        pass
    writes = len(reg.stats().loads)
    step()  # still queued (one sequence slot): its adapter goes into free rows now
    assert tokens == {"busy": 4, "cold": 0}
    assert {d["name"]: d["state"] for d in reg.list()}["cold"] == "device"
    assert [x.tier for x in reg.stats().loads[writes:]] == [HOST_TO_DEVICE]
    writes = len(reg.stats().loads)
    while eng.has_unfinished_requests():
        step()
    assert tokens == {"busy": 6, "cold": 6}
    assert len(reg.stats().loads) == writes  # admitted with its rows in place: nothing written at admission
