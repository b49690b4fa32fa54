"""Multi-LoRA through the engine (loom.engine.llm.LLM) vs HF PEFT, hot load/unload/reload, LRU, refusals.

CPU, float32, tiny random Llama models made here (no tokenizer: prompts are token ids).
"""
from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

import loom.lora.adapter_registry as registry_mod
from harness.lora import make_peft_adapter, peft_greedy, tiny_llama_config, write_raw_adapter
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.lora import LoraModelSpec, LoraPool

CFG = tiny_llama_config()
ROW = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(CFG), torch.float32, "cpu")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_base):
    return tiny_base


@pytest.fixture(scope="module")
def root(adapter_set):
    return adapter_set


def make_llm(base, roots, **kw):
    args = dict(adapter_roots=[str(r) for r in roots], device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
                max_lora_rank=16, block_size=16)
    args.update(kw)
    return LLM(base, **args)


def prompts_for(n, seed=0, lo=4, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CFG.vocab_size, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def check_against_oracle(base, root, outs, prompts, names, n_tokens, check_logprobs=True):
    by_adapter = {}
    for i, n in enumerate(names):
        by_adapter.setdefault(n, []).append(i)
    for n, rows in by_adapter.items():
        oracle = peft_greedy(base, str(root / n) if n else None, [prompts[i] for i in rows], n_tokens)
        for i, (toks, lps, _) in zip(rows, oracle):
            assert outs[i].error is None, outs[i].error
            assert outs[i].token_ids == toks, f"request {i} (adapter {n}): {outs[i].token_ids} vs PEFT {toks}"
            if check_logprobs:
                got = [lp.logprob for lp in outs[i].logprobs]
                assert got == pytest.approx(lps, abs=2e-4), f"request {i} (adapter {n})"


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_mixed_batch_matches_peft(base, root, kernels, monkeypatch):
    """Adapters of ranks 1-16 and no-adapter rows in one step; with kernels="triton" every kernel (LoRA
    shrink/expand, attention, norms, rotary) runs its Triton version under the interpreter (fewer rows and
    tokens there: the interpreter is slow)."""
    if kernels == "triton":
        monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
        names, n_tokens = [None, "a1", "a3", None, "a5", "a7", "a9"], 3
    else:
        names, n_tokens = [None, "a1", "a2", None, "a3", "a4", "a5", "a6", "a7", "a8", "a9", "a3", None, "a6", "a10"], 8
    llm = make_llm(base, [root])
    prompts = prompts_for(len(names), seed=1)
    params = SamplingParams(max_tokens=n_tokens, logprobs=2, **GREEDY)
    groups = []
    reg = llm.engine.adapters
    for n in sorted({n for n in names if n}):  # loaded up front: first uses load in the background
        reg.load(n)
    orig = reg.build_lora_meta

    def spy(refs, num_tokens):
        m = orig(refs, num_tokens)
        groups.append(0 if m is None else m.num_groups)
        return m

    reg.build_lora_meta = spy
    outs = llm.generate(prompts, params, lora_names=names)
    assert max(groups) == len({n for n in names if n})  # all adapters in one step
    check_against_oracle(base, root, outs, prompts, names, n_tokens)


def test_256_distinct_adapters_in_one_step(base, tmp_path):
    many = tmp_path / "many"
    n = 260
    targets = [["q_proj"], ["v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"], ["k_proj", "down_proj"]]
    for i in range(n):
        write_raw_adapter(str(many / f"ad{i:03d}"), CFG, seed=i, r=1 + i % 4, alpha=2 + i % 3,
                          target_modules=targets[i % 4], scale=2.0)
    rows = sum(1 + i % 4 for i in range(n))
    llm = make_llm(base, [many], max_num_seqs=n + 4, max_num_batched_tokens=4096, lora_memory_bytes=rows * ROW,
                   max_host_adapters=n)
    reg = llm.engine.adapters
    for i in range(n):  # loaded up front, so the first step does not depend on background load timing
        reg.load(f"ad{i:03d}", str(many / f"ad{i:03d}"))
    groups = []
    orig = reg.build_lora_meta
    reg.build_lora_meta = lambda refs, nt: (lambda m: (groups.append(0 if m is None else m.num_groups), m)[1])(
        orig(refs, nt))
    names = [f"ad{i:03d}" for i in range(n)] + [None] * 4
    prompts = prompts_for(len(names), seed=2, lo=3, hi=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, logprobs=0, **GREEDY), lora_names=names)
    assert max(groups) >= 256, groups
    sample = [0, 1, 2, 3, 130, 259, n, n + 3]
    check_against_oracle(base, many, [outs[i] for i in sample], [prompts[i] for i in sample],
                         [names[i] for i in sample], 3)


def test_hot_reload_in_flight_and_prefix_cache(base, root, tmp_path):
    serve = tmp_path / "serve"
    serve.mkdir()
    shutil.copytree(root / "a6", serve / "x")  # v1 = a6
    llm = make_llm(base, [serve, root])
    eng, reg = llm.engine, llm.engine.adapters
    assert reg.load("x", "x")["name"] == "x"
    prompt = prompts_for(1, seed=3, lo=40, hi=41)[0]  # > 2 KV blocks: prefix-cacheable
    other = prompts_for(1, seed=4)[0]
    p = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    eng.add_request("r1", prompt, p, "x")
    eng.add_request("bystander", other, p, "a2")
    eng.add_request("plain", other, p, None)
    got = {"r1": [], "bystander": [], "plain": []}
    while len(got["r1"]) < 4:
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    # same-name reload with different weights (files replaced in place), while requests stream
    shutil.rmtree(serve / "x")
    shutil.copytree(root / "a9", serve / "x")  # v2 = a9
    info = reg.reload("x")
    assert info["rank"] == 12
    eng.add_request("r2", prompt, p, "x")  # after the reload: new weights, no stale prefix-cache blocks
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got.setdefault(o.request_id, [])
            got[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = o
    v1 = peft_greedy(base, str(root / "a6"), [prompt], 12)[0][0]
    v2 = peft_greedy(base, str(root / "a9"), [prompt], 12)[0][0]
    assert v1 != v2
    assert got["r1"] == v1  # the in-flight request kept its version
    assert got["r2"] == v2
    assert done["r2"].num_cached_tokens == 0  # blocks computed with v1 are not reused
    assert got["bystander"] == peft_greedy(base, str(root / "a2"), [other], 12)[0][0]
    assert got["plain"] == peft_greedy(base, None, [other], 12)[0][0]
    # the same prompt again on v2 may use v2's cached blocks, and still matches
    out = llm.generate([prompt], p, lora_names=["x"])[0]
    assert out.num_cached_tokens >= 32 and out.token_ids == v2
    # the old version is gone once its last request finished
    assert [d["version"] for d in reg.list() if d["name"] == "x"] == [info["version"]]
    assert reg.info()["versions"] == len(reg.list())
    # unload while serving: the running request finishes with its weights; new ones re-resolve from the root
    eng.add_request("r3", prompt, p, "x")
    outs = {}
    for o in eng.step():
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    reg.unload("x")
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert outs["r3"] == v2 and "x" not in [d["name"] for d in reg.list()]


def test_lru_eviction_gives_identical_outputs(base, root):
    # room for one rank-16 adapter at a time: every switch evicts
    llm = make_llm(base, [root], lora_memory_bytes=16 * ROW, max_host_adapters=1)
    reg = llm.engine.adapters
    prompts = prompts_for(1, seed=5)
    p = SamplingParams(max_tokens=6, logprobs=0, **GREEDY)
    first = {n: llm.generate(prompts, p, lora_names=[n])[0].token_ids for n in ("a5", "a9", "a4", "a6")}
    again = {n: llm.generate(prompts, p, lora_names=[n])[0].token_ids for n in ("a5", "a9", "a4", "a6")}
    assert first == again
    assert reg.num_evictions >= 6 and reg.num_disk_loads > 4  # host cache of 1: re-read from disk too
    for n in first:
        assert first[n] == peft_greedy(base, str(root / n), prompts, 6)[0][0]
    # all at once with room for one: they take turns, nobody deadlocks
    names = ["a5", "a9", None, "a4", "a6", "a5"]
    ps = prompts * len(names)
    outs = llm.generate(ps, p, lora_names=names)
    for o, n in zip(outs, names):
        assert o.error is None and (n is None or o.token_ids == first[n])


def test_first_use_load_does_not_block_others(base, root, monkeypatch):
    llm = make_llm(base, [root])
    eng = llm.engine
    gate = threading.Event()
    real = registry_mod.load_peft_adapter
    monkeypatch.setattr(registry_mod, "load_peft_adapter", lambda *a, **k: (gate.wait(20), real(*a, **k))[1])
    p = SamplingParams(max_tokens=6, **GREEDY)
    prompt = prompts_for(1, seed=6)[0]
    eng.add_request("plain", prompt, p, None)
    t0 = time.time()
    eng.add_request("lazy", prompt, p, "a4")  # not loaded: resolved under the root, loaded in the background
    assert time.time() - t0 < 0.5
    seen = {"plain": [], "lazy": []}
    for _ in range(20):
        for o in eng.step():
            seen[o.request_id] += o.new_token_ids
        if len(seen["plain"]) == 6:
            break
    assert len(seen["plain"]) == 6 and seen["lazy"] == []  # the plain request finished while the load waited
    gate.set()
    deadline = time.time() + 20
    while eng.has_unfinished_requests() and time.time() < deadline:
        for o in eng.step():
            seen[o.request_id] += o.new_token_ids
    assert seen["lazy"] == peft_greedy(base, str(root / "a4"), [prompt], 6)[0][0]


def test_refusals(base, root, tmp_path):
    outside = tmp_path / "outside"
    make_peft_adapter(base, str(outside / "o"), seed=1, r=2, alpha=2, target_modules=["q_proj"])
    bad = tmp_path / "bad"
    write_raw_adapter(str(bad / "lmhead"), CFG, 0, 2, 2, ["q_proj"],
                      extra_config={"target_modules": ["q_proj", "lm_head"]})
    write_raw_adapter(str(bad / "broken"), CFG, 0, 2, 2, ["q_proj"])
    with open(bad / "broken" / "adapter_model.safetensors", "wb") as f:
        f.write(b"\x01" * 100)
    llm = make_llm(base, [root, bad])
    eng, reg = llm.engine, llm.engine.adapters
    p = SamplingParams(max_tokens=2, **GREEDY)
    with pytest.raises(RequestError) as ei:
        eng.add_request("u", [5, 6, 7], p, "no-such-adapter")
    assert ei.value.field == "lora_name"
    with pytest.raises(RequestError, match="lm_head"):
        eng.add_request("l", [5, 6, 7], p, "lmhead")
    with pytest.raises(RequestError, match="outside the configured adapter roots"):
        reg.load("o", str(outside / "o"))
    with pytest.raises(RequestError, match="'..'"):
        reg.load("o", "../outside/o")
    # weights found broken by the background load: that request fails, the engine keeps serving
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], p, lora_names=["broken", "a1"])
    assert outs[0].finish_reason == "error" and "not a valid safetensors" in (outs[0].error or "")
    assert outs[1].error is None and len(outs[1].token_ids) == 2


@pytest.mark.parametrize("pool", ["bfloat16", "float16"])
def test_16_bit_pools_keep_16_bit_adapters_exactly(base, tmp_path, pool):
    """lora_dtype=bfloat16 / float16 under a float32 model: adapters saved in that type are kept as they are (pools
    of half the bytes a row, so twice the rows in the same memory) and give PEFT's tokens, and bitwise the tokens
    and logprobs of float32 pools (widening in the kernels is exact)."""
    dt = getattr(torch, pool)
    root16 = tmp_path / pool
    targets = [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["v_proj", "down_proj"]]
    for i in range(4):
        write_raw_adapter(str(root16 / f"h{i}"), CFG, seed=40 + i, r=(3, 8, 16, 5)[i], alpha=4 + i,
                          target_modules=targets[i % 2], dtype=dt, scale=3.0)
    names = [None, "h0", "h1", "h2", "h3", "h1", None, "h0"]
    prompts = prompts_for(len(names), seed=4)
    params = SamplingParams(max_tokens=6, logprobs=2, **GREEDY)
    outs = {}
    for lora_dtype in ("auto", pool):
        llm = make_llm(base, [root16], lora_dtype=lora_dtype, lora_memory_bytes=64 * ROW)
        reg = llm.engine.adapters
        assert {a.dtype for a in reg.pool.a.values()} == {torch.float32 if lora_dtype == "auto" else dt}
        assert reg.pool.capacity == 64 * ROW // reg.pool.row_bytes  # 64; 16 bits: 128 (129: less padding)
        assert reg.pool.capacity == 64 if lora_dtype == "auto" else reg.pool.capacity >= 128
        outs[lora_dtype] = llm.generate(prompts, params, lora_names=names)
    for got, want in zip(outs[pool], outs["auto"]):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    check_against_oracle(base, root16, outs[pool], prompts, names, 6)


def test_lora_dtype_refusals():
    from loom.engine.config import EngineConfig
    from loom.errors import ConfigError

    with pytest.raises(ConfigError, match="lora_dtype") as ei:
        EngineConfig(lora_dtype="int8")
    assert ei.value.field == "lora_dtype"
    conf = EngineConfig(lora_dtype="float16")
    assert conf.resolve_lora_dtype(torch.float32) == torch.float16
    assert conf.resolve_lora_dtype(torch.float16) == torch.float16
    with pytest.raises(ConfigError, match="need a float32 model") as ei:
        conf.resolve_lora_dtype(torch.bfloat16)  # float16 pools read as bfloat16 would lose bits
    assert ei.value.field == "lora_dtype"
    assert EngineConfig().resolve_lora_dtype(torch.bfloat16) == torch.bfloat16
