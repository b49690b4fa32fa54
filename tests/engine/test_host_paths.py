"""The engine's host-side fast paths against the simple path, token for token: the persistent sampling state
(vs SamplingBatch.build from the sequences' lists every step, harness.simple_sampling) and async scheduling (step
N+1 scheduled and launched before step N's tokens reach the host, also over the decode-graph path), emulated on
CPU, on tiny random models: with preemption, chunked prefill, n > 1, penalties, logprobs, min_tokens, stop ids,
logit_bias / allowed_token_ids and bad_words; and with structured outputs (choice, regex, JSON schema) and LoRA
adapters loaded, reloaded, unloaded and evicted while they serve mixed batches. Then the overlap itself with a
slow fake device."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from harness.default_model import ensure_default_model
from harness.hf_models import assert_no_leak, make_hf_model, random_prompts
from harness.lora import make_peft_adapter
from harness.simple_sampling import use_simple_sampling
from loom.engine.config import EngineConfig
from loom.engine.llm_engine import PLACEHOLDER, LLMEngine
from loom.engine.sample.structured_output import StructuredOutputsParams as SO
from loom.engine.sampling_params import SamplingParams as SP
from loom.lora import LoraModelSpec, LoraPool

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


MODES = ("simple", "sync", "async", "async_graphs")
PER_BLOCK = 2 * 2 * 8 * 2 * 16 * 4  # KV bytes of one 8-token block of the tiny models (2 layers, 2 KV heads of 16)


def make_engine(cfg: EngineConfig, mode: str, load_tokenizer: bool = False) -> LLMEngine:
    """An engine on one of the paths: the simple sampling path, or the persistent state synchronous, async, or
    async over the decode-graph path (static buffers, padded buckets). CPU ignores cfg.async_scheduling (on by
    default for CUDA): the path is set on the engine."""
    eng = LLMEngine(cfg, load_tokenizer=load_tokenizer)
    assert eng.async_scheduling == (eng.runner.device.type == "cuda")
    if mode == "simple":
        use_simple_sampling(eng)
    eng.async_scheduling = mode.startswith("async")
    if mode == "async_graphs":
        eng.runner.enable_graph_emulation()
    return eng


def drive(eng: LLMEngine, requests, actions=None) -> dict:
    """Run requests [(arrival step, request id, prompt, params, lora name)] to the end, calling actions[step](eng)
    before that step; -> (request id, index) -> tokens, logprobs, finish reason, cumulative logprob."""
    checked = check_block_tables(eng)
    actions = dict(actions or {})
    pending = sorted(requests, key=lambda r: r[0])
    got: dict = {}
    step = 0
    while pending or actions or eng.has_unfinished_requests():
        if step in actions:
            actions.pop(step)(eng)
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, lora = pending.pop(0)
            eng.add_request(rid, prompt, params, lora)
        for o in eng.step():
            rec = got.setdefault((o.request_id, o.index), {"tokens": [], "lps": [], "reason": None, "cum": None,
                                                           "error": None})
            rec["tokens"] += o.new_token_ids
            rec["lps"] += [(lp.logprob, [t for t, _ in lp.top]) for lp in (o.new_logprobs or [])]
            rec["cum"] = o.cumulative_logprob
            if o.finished:
                rec["reason"], rec["error"] = o.finish_reason, o.error
        step += 1
        assert step < 2000
    assert_no_leak(eng)
    assert checked
    return got


def run(model_dir: str, mode: str, arrivals=(0, 0, 1, 2, 2, 3, 5, 5, 6, 8, 9, 11)):
    # a KV cache small enough that requests get preempted
    cfg = EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=24 * PER_BLOCK, max_num_batched_tokens=48,
                       max_num_seqs=8)
    eng = make_engine(cfg, mode)
    eng.tokenizer = LetterTokenizer()
    prompts, params = workload()
    return drive(eng, [(t, f"q{i}", prompts[i], params[i], None) for i, t in enumerate(arrivals)]), eng


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


def test_async_scheduling_is_the_default_on_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig().resolve_async_scheduling(cuda)
    assert not EngineConfig(async_scheduling=False).resolve_async_scheduling(cuda)
    assert not EngineConfig().resolve_async_scheduling(cpu)


def test_persistent_state_and_async_scheduling_match_the_simple_path(model_dir):
    simple, eng_s = run(model_dir, "simple")
    persistent, eng_p = run(model_dir, "sync")
    overlapped, eng_a = run(model_dir, "async")
    assert eng_a.async_scheduling and not eng_p.async_scheduling and not eng_s.async_scheduling
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


# ---- structured outputs and adapter churn ------------------------------------------------------------------

FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}
CHOICE, REGEX = ("yes", "no"), r"[0-9]{3}-[a-z]{2}"
ADAPTERS = {"a": (4, ["q_proj", "v_proj"]), "b": (8, "all-linear"), "c": (6, ["o_proj", "down_proj"]),
            "d": (4, ["k_proj", "up_proj"])}  # name: rank, targets


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (structured outputs need a real one) and PEFT
    adapters for it -> (model dir, adapter root)."""
    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    path = make_hf_model("llama", tmp_path_factory.mktemp("tok"), vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)[1]
    tok.save_pretrained(path)
    root = tmp_path_factory.mktemp("adapters")
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        make_peft_adapter(path, str(root / name), seed=40 + i, r=r, alpha=2 * r, target_modules=targets, scale=2.0)
    return path, root


def run_churn(model_dir: str, root, mode: str):
    """Structured requests (n = 2 among them) and plain ones, with and without adapters, in a KV cache that
    preempts and LoRA pools that hold two adapters at a time (every switch evicts); meanwhile an adapter is loaded,
    reloaded with other weights and unloaded while its requests run, and another is unloaded and re-read from its
    folder on first use."""
    row = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir)), torch.float32,
                                 "cpu")
    cfg = EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=16 * PER_BLOCK, max_num_batched_tokens=48,
                       max_num_seqs=8, adapter_roots=[str(root)], max_lora_rank=8, lora_memory_bytes=14 * row,
                       max_host_adapters=2)
    eng = make_engine(cfg, mode, load_tokenizer=True)
    reg = eng.adapters
    for name in ("a", "b"):
        reg.load(name)
    prompts = random_prompts([9, 30, 14, 22, 6, 52, 17, 11, 25, 8, 19], len(eng.tokenizer), seed=31)
    so = dict(temperature=1.0, max_tokens=24)
    reqs = [  # arrival step, request id, params, adapter
        (0, "plain-a", SP(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True), "a"),
        (0, "choice", SP(seed=1, structured_outputs=SO(choice=CHOICE), **so), None),
        (1, "json-b", SP(seed=2, n=2, structured_outputs=SO(json=FLAG_SCHEMA, disable_any_whitespace=True), **so),
         "b"),
        (1, "regex-a", SP(seed=3, structured_outputs=SO(regex=REGEX), **so), "a"),
        (2, "n3-b", SP(temperature=0.9, seed=4, n=3, max_tokens=10, frequency_penalty=0.5, ignore_eos=True), "b"),
        (2, "long", SP(temperature=0.0, max_tokens=14, ignore_eos=True), None),
        (4, "x-v1", SP(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True), "x"),
        (6, "choice-x", SP(seed=6, structured_outputs=SO(choice=CHOICE), **so), "x"),
        (9, "x-v2", SP(temperature=0.8, seed=7, n=2, max_tokens=12, ignore_eos=True), "x"),
        (12, "b-again", SP(temperature=0.0, max_tokens=10, ignore_eos=True), "b"),
        (13, "json-d", SP(seed=8, structured_outputs=SO(json=FLAG_SCHEMA, disable_any_whitespace=True), **so), "d"),
    ]
    actions = {
        3: lambda e: reg.load("x", "c"),  # x = c
        8: lambda e: reg.reload("x", "d"),  # x-v1 keeps c; requests from now on get d
        10: lambda e: (reg.unload("x"), reg.unload("b")),  # their running requests keep their weights
    }
    got = drive(eng, [(t, rid, prompts[i], p, lora) for i, (t, rid, p, lora) in enumerate(reqs)], actions)
    return got, eng


def test_async_scheduling_matches_under_structured_outputs_and_adapter_churn(tok_model):
    model_dir, root = tok_model
    simple, eng_s = run_churn(model_dir, root, "simple")
    tok = eng_s.tokenizer
    assert len(simple) == 15  # 11 requests, two with n = 2, one with n = 3
    assert all(r["error"] is None for r in simple.values())
    # the workload exercises what it should: grammars that end their requests, preemption, evictions
    for k in (("choice", 0), ("choice-x", 0)):
        assert simple[k]["reason"] == "stop" and tok.decode(simple[k]["tokens"], skip_special_tokens=True) in CHOICE
    for k in (("json-b", 0), ("json-b", 1), ("json-d", 0)):
        text = tok.decode(simple[k]["tokens"], skip_special_tokens=True)
        assert simple[k]["reason"] == "stop" and isinstance(json.loads(text)["ok"], bool), text
    assert re.fullmatch(REGEX, tok.decode(simple[("regex-a", 0)]["tokens"], skip_special_tokens=True))
    assert len({tuple(simple[("n3-b", i)]["tokens"]) for i in range(3)}) == 3  # seed + index: completions differ
    assert eng_s.scheduler.num_preemptions > 0 and eng_s.adapters.num_evictions > 0
    for mode in MODES[1:]:
        got, eng = run_churn(model_dir, root, mode)
        assert_same(simple, got)
        assert eng.scheduler.num_preemptions > 0 and eng.adapters.num_evictions > 0, mode
        assert mode != "async_graphs" or eng.runner.graphs.replays > 0
        # x is gone; b and d were read from their folders at first use
        assert [d["name"] for d in eng.adapters.list()] == ["a", "b", "d"] and eng.adapters.info()["refs"] == 0, mode


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_block_table_rows_follow_every_table_change(model_dir, mode):
    """The runner writes only the blocks appended since a row was last written; every other change of a table -
    a prefix-cache hit at admission, a duplicate block adopted from the cache, preemption and re-admission, a
    fork for n > 1, a finished sequence's row taken by another - must rewrite the row. Outputs equal a fresh
    engine that runs each request alone (greedy, and seeded sampling for the n = 2 request)."""
    cfg = dict(model=model_dir, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    eng = make_engine(EngineConfig(**cfg, kv_cache_memory_bytes=20 * PER_BLOCK), mode)
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
    eng = make_engine(EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=1 << 20), "async")
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
    cfg = EngineConfig(model=model_dir, block_size=8, kv_cache_memory_bytes=4 << 20, max_num_seqs=16)
    eng = make_engine(cfg, "async" if async_scheduling else "sync")
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
