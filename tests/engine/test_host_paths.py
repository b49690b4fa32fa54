"""The engine's host-side fast paths against the simple path, token for token: the persistent sampling state
(vs SamplingBatch.build from the sequences' lists every step) and async scheduling (step N+1 scheduled and
launched before step N's tokens reach the host, also over the decode-graph path), on a tiny random model, with
preemption, chunked prefill, n > 1, penalties, logprobs, min_tokens, stop ids, logit_bias / allowed_token_ids
and bad_words; and the overlap itself with a slow fake device."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from harness.hf_models import assert_no_leak, make_hf_model, random_prompts
from loom.engine.config import EngineConfig
from loom.engine.llm_engine import PLACEHOLDER, LLMEngine
from loom.engine.sampling_params import SamplingParams as SP

VOCAB = 320


class LetterTokenizer:
    """bad_words needs a tokenizer: letters a..z are token ids 3..28."""
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) - ord("a")) % 26 for c in text if c.isalpha()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("host"))[1]


def workload():
    prompts = random_prompts([5, 40, 17, 3, 60, 9, 25, 12, 33, 7, 21, 50], VOCAB, seed=11)
    params = [
        SP(temperature=0.0, max_tokens=14, ignore_eos=True),
        SP(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True),
        SP(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True),
        SP(temperature=1.2, min_p=0.05, seed=6, max_tokens=12, cumulative_logprob=True, ignore_eos=True),
        SP(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=7,
           max_tokens=18, logprobs=2, ignore_eos=True),
        SP(temperature=0.0, repetition_penalty=1.6, max_tokens=12, ignore_eos=True),
        SP(temperature=0.9, seed=8, min_tokens=6, stop_token_ids=[40, 41, 42, 43, 44, 45], max_tokens=20),
        SP(temperature=1.0, seed=9, logit_bias={10: 4.0, 11: -100.0}, allowed_token_ids=list(range(3, 90)),
           max_tokens=10, ignore_eos=True),
        SP(temperature=1.0, seed=10, n=3, max_tokens=9, ignore_eos=True, frequency_penalty=0.5),
        SP(temperature=1.1, seed=12, bad_words=["ab", "c"], max_tokens=12, ignore_eos=True),
        SP(temperature=0.9, seed=13, stop_token_ids=list(range(100, 116)), max_tokens=25),
        SP(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
    ]
    return prompts, params


def check_block_tables(eng) -> list[int]:
    """Wrap the runner's prepare: after every call, the step's block-table rows (kept from step to step, only
    appended blocks written) must equal each sequence's block table. Returns a list counting the checks."""
    runner, checked = eng.runner, []
    prepare = runner.prepare

    def checked_prepare(batch, *a, **kw):
        out = prepare(batch, *a, **kw)
        width = runner.max_blocks_per_seq
        tables = runner.buffers.host("block_tables", len(batch.seqs), width)
        for i, seq in enumerate(batch.seqs):
            assert tables[i, :len(seq.block_table)].tolist() == seq.block_table, (i, seq.request_id)
        checked.append(len(batch.seqs))
        return out
    runner.prepare = checked_prepare
    return checked


def run(model_dir: str, mode: str, arrivals=(0, 0, 1, 2, 2, 3, 5, 5, 6, 8, 9, 11)):
    cfg = EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=0, max_num_batched_tokens=48,
                       max_num_seqs=8, async_scheduling=mode.startswith("async"))
    # a KV cache small enough that requests get preempted
    per_block = 2 * 2 * 8 * 2 * 16 * 4
    cfg.kv_cache_memory_bytes = 24 * per_block
    eng = LLMEngine(cfg, load_tokenizer=False)
    eng.tokenizer = LetterTokenizer()
    if mode == "simple":
        eng.use_simple_sampling()
    if mode == "async_graphs":  # decode steps through the CUDA-graph path (static buffers, padded buckets)
        eng.runner.enable_graph_emulation()
    checked = check_block_tables(eng)
    prompts, params = workload()
    got: dict = {}
    step = 0
    pending = sorted(zip(arrivals, range(len(prompts))))
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            eng.add_request(f"q{i}", prompts[i], params[i])
        for o in eng.step():
            rec = got.setdefault((o.request_id, o.index), {"tokens": [], "lps": [], "reason": None, "cum": None})
            rec["tokens"] += o.new_token_ids
            rec["lps"] += [(lp.logprob, [t for t, _ in lp.top]) for lp in (o.new_logprobs or [])]
            rec["cum"] = o.cumulative_logprob
            if o.finished:
                rec["reason"] = o.finish_reason
        step += 1
        assert step < 2000
    assert_no_leak(eng)
    assert checked
    return got, eng


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k]["tokens"] == b[k]["tokens"], k
        assert a[k]["reason"] == b[k]["reason"], k
        assert [t for _, t in a[k]["lps"]] == [t for _, t in b[k]["lps"]], k
        assert all(abs(x - y) < 1e-4 for (x, _), (y, _) in zip(a[k]["lps"], b[k]["lps"])), k
        assert (a[k]["cum"] is None) == (b[k]["cum"] is None), k
        if a[k]["cum"] is not None:
            assert abs(a[k]["cum"] - b[k]["cum"]) < 1e-3, k


def test_persistent_state_and_async_scheduling_match_the_simple_path(model_dir):
    simple, eng_s = run(model_dir, "simple")
    persistent, eng_p = run(model_dir, "sync")
    overlapped, eng_a = run(model_dir, "async")
    assert eng_s.sampling_state is None and eng_p.sampling_state is not None and eng_a.async_scheduling
    # the workload exercises what it should
    assert eng_s.scheduler.num_preemptions > 0 and eng_a.scheduler.num_preemptions > 0
    assert len(simple) == 14  # 12 requests, one with n = 3
    assert simple[("q6", 0)]["reason"] == "stop" or simple[("q10", 0)]["reason"] == "stop"
    assert len(simple[("q1", 0)]["lps"]) == 10 and simple[("q3", 0)]["cum"] is not None
    assert simple[("q0", 0)]["cum"] is None  # nobody asked: no logprob computed
    assert_same(simple, persistent)
    assert_same(simple, overlapped)
    # async scheduling over the graph path: the placeholders are filled in the graph's static input ids
    graphed, eng_g = run(model_dir, "async_graphs")
    assert eng_g.runner.graphs.replays > 0
    assert_same(simple, graphed)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_table_rows_follow_every_table_change(model_dir, async_scheduling):
    """The runner writes only the blocks appended since a row was last written; every other change of a table -
    a prefix-cache hit at admission, a duplicate block adopted from the cache, preemption and re-admission, a
    fork for n > 1, a finished sequence's row taken by another - must rewrite the row. Outputs equal a fresh
    engine that runs each request alone (greedy, and seeded sampling for the n = 2 request)."""
    per_block = 2 * 2 * 8 * 2 * 16 * 4
    cfg = dict(model=model_dir, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    eng = LLMEngine(EngineConfig(**cfg, kv_cache_memory_bytes=20 * per_block, async_scheduling=async_scheduling),
                    load_tokenizer=False)
    checked = check_block_tables(eng)
    base = random_prompts([30], VOCAB, seed=21)[0]
    prompts = [base, list(base), base + [5, 6, 7], base[:17]] + random_prompts([12, 26, 9], VOCAB, seed=22)
    params = [SP(temperature=0.0, max_tokens=20, ignore_eos=True) for _ in prompts]
    params[5] = SP(temperature=0.8, seed=3, n=2, max_tokens=20, ignore_eos=True)  # seeded: the same alone
    outs: dict = {}
    for step in range(400):
        if step in (0, 3):  # the first four together (duplicate blocks in one step), the rest a little later
            for i in (range(4) if step == 0 else range(4, len(prompts))):
                eng.add_request(f"r{i}", prompts[i], params[i])
        for o in eng.step():
            outs.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        if step > 3 and not eng.has_unfinished_requests():
            break
    assert eng.scheduler.num_preemptions > 0 and eng.block_manager._next_epoch > len(prompts) + 1
    assert len(checked) > 20
    assert_no_leak(eng)
    for i, p in enumerate(prompts):  # greedy: each request alone gives the same tokens
        alone = LLMEngine(EngineConfig(**cfg, kv_cache_memory_bytes=1 << 20), load_tokenizer=False)
        alone.add_request("x", p, params[i])
        want: dict = {}
        while alone.has_unfinished_requests():
            for o in alone.step():
                want.setdefault(o.index, []).extend(o.new_token_ids)
        for k, toks in want.items():
            assert outs[(f"r{i}", k)] == toks, (i, k)


def test_async_abort_and_stop_while_a_step_is_in_flight(model_dir):
    cfg = EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=1 << 20, async_scheduling=True)
    eng = LLMEngine(cfg, load_tokenizer=False)
    prompts = random_prompts([6, 9, 12], VOCAB, seed=3)
    ref = LLMEngine(EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=1 << 20), load_tokenizer=False)
    free = {}
    for i, p in enumerate(prompts):
        ref.add_request(f"a{i}", p, SP(temperature=0.0, max_tokens=12, ignore_eos=True))
    while ref.has_unfinished_requests():
        for o in ref.step():
            free.setdefault(o.request_id, []).extend(o.new_token_ids)
    stop_tok = free["a1"][4]
    eng.add_request("a0", prompts[0], SP(temperature=0.0, max_tokens=12, ignore_eos=True))
    eng.add_request("a1", prompts[1], SP(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]))
    eng.add_request("a2", prompts[2], SP(temperature=0.0, max_tokens=12, ignore_eos=True))
    got: dict = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
        steps += 1
        if steps == 4:
            assert eng._inflight is not None  # a0 is aborted while its next token is being sampled
            eng.abort_request("a0")
    a0 = [t for o in got["a0"] for t in o.new_token_ids]
    assert got["a0"][-1].finish_reason == "abort" and a0 == free["a0"][:len(a0)]
    a1 = [t for o in got["a1"] for t in o.new_token_ids]
    assert got["a1"][-1].finish_reason == "stop" and a1 == free["a1"][:free["a1"].index(stop_tok) + 1]
    assert [t for o in got["a2"] for t in o.new_token_ids] == free["a2"]
    assert all(PLACEHOLDER not in s.token_ids for s in eng.requests.values())
    assert_no_leak(eng)


# ---- overlap: a slow fake device ---------------------------------------------------------------------------

class FakeDevice:
    """A stream that takes `step_s` per launched step; an event waits until its step is done."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.busy_until = 0.0
        self.queued = 0  # steps launched and not waited for
        self.lock = threading.Lock()

    def launch(self) -> None:
        with self.lock:
            self.busy_until = max(self.busy_until, time.monotonic()) + self.step_s
            self.queued += 1

    def event(self):
        dev, until = self, self.busy_until

        class Event:
            def synchronize(self):
                time.sleep(max(0.0, until - time.monotonic()))
                with dev.lock:
                    dev.queued -= 1
        return Event()


def fake_forward(eng: LLMEngine, device: FakeDevice):
    """The runner's input preparation for real (with async scheduling's token fill), then logits that are a fixed
    function of each sampled row's input id and position, so a wrong fill changes the tokens."""
    runner = eng.runner
    table = torch.randn(97, runner.vocab_size, generator=torch.Generator().manual_seed(0)) * 4

    def run(batch, lora, extra_rows=None, fill=None):
        ids, ctx, sampled = runner.prepare(batch, lora, extra_rows, fill=fill)
        last = ids[ctx.logits_indices]
        pos = ctx.positions[ctx.logits_indices]
        device.launch()
        return table[(last * 7 + pos * 3) % 97], sampled
    return run


def overlap_run(model_dir: str, async_scheduling: bool, host_s: float, device_s: float):
    cfg = EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=4 << 20, max_num_seqs=16,
                       async_scheduling=async_scheduling)
    eng = LLMEngine(cfg, load_tokenizer=False)
    device = FakeDevice(device_s)
    eng.runner.run = fake_forward(eng, device)
    eng._new_event = device.event
    queued_at_schedule: list[int] = []
    schedule = eng.scheduler.schedule

    def slow_schedule():  # host work of a step, made slow enough to see
        queued_at_schedule.append(device.queued)
        time.sleep(host_s)
        return schedule()
    eng.scheduler.schedule = slow_schedule
    prompts = random_prompts([4, 7, 5, 9, 6, 3, 8, 5], VOCAB, seed=21)
    for i, p in enumerate(prompts):
        eng.add_request(f"o{i}", p, SP(temperature=0.8, seed=i, max_tokens=10 + i, ignore_eos=i % 2 == 0))
    toks: dict = {}
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    wall = time.perf_counter() - t0
    assert_no_leak(eng)
    return toks, queued_at_schedule, wall


def test_async_scheduling_hides_host_work_behind_the_device(model_dir):
    host_s, device_s = 0.004, 0.012
    sync_toks, sync_q, sync_wall = overlap_run(model_dir, False, host_s, device_s)
    async_toks, async_q, async_wall = overlap_run(model_dir, True, host_s, device_s)
    assert async_toks == sync_toks
    # synchronous: the host schedules only once the device is idle; async: while the previous step runs
    assert set(sync_q) == {0}
    busy = sum(1 for q in async_q if q >= 1)
    assert busy >= len(async_q) - 2, async_q  # all but the first step and the drain
    print(f"\n{len(sync_q)} steps, host {host_s * 1e3:.0f} ms + device {device_s * 1e3:.0f} ms per step: "
          f"sync {sync_wall * 1e3 / len(sync_q):.1f} ms/step, async {async_wall * 1e3 / len(async_q):.1f} ms/step; "
          f"host work done while the device was busy: sync 0/{len(sync_q)} steps, async {busy}/{len(async_q)}")
