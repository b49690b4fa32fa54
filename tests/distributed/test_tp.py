"""Tensor parallelism on CPU (gloo): an engine over 2 (and 4) ranks gives the greedy tokens of transformers and of
TP=1 in float32 - mixed prefill/decode, chunked prefill, preemption, prefix hits, n > 1 - and the same seeded
samples as TP=1; its workers go with close(), with their parent, and a dead one fails the next step naming it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import loom.models.loader as loader
from harness.hf_models import make_hf_model, random_prompts
from loom.distributed.ranks import rank_devices
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import ConfigError
from tests.models.parity import GREEDY, block_bytes, check

LENGTHS = [1, 9, 33, 47]


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, overrides key) -> (transformers model, saved directory), built on first use."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("tp_models")

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_hf_model(family, root / f"{family}_{len(cache)}", **overrides)
        return cache[key]

    return get


def workers() -> list[psutil.Process]:
    """This process's tensor-parallel workers (multiprocessing's resource tracker, which lives as long as this
    process, is not one)."""
    return [c for c in psutil.Process().children(recursive=True)
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline())]


def tp_llm(path: str, cfg, tp: int, blocks: int = 64, **kw) -> LLM:
    """An engine whose KV cache holds `blocks` blocks on every rank (each rank holds its share of the KV heads)."""
    kv_per_rank = max(1, cfg.num_key_value_heads // tp)
    budget = blocks * block_bytes(cfg) * kv_per_rank // cfg.num_key_value_heads
    return LLM(path, block_size=16, kv_cache_memory_bytes=budget, cpu_threads=1, tensor_parallel_size=tp, **kw)


@pytest.fixture(autouse=True)
def _no_workers_left():
    yield
    assert workers() == [], "a test left tensor-parallel workers running"
    assert not dist.is_initialized()


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2", "qwen3_moe"])
def test_tp2_greedy_matches_transformers_with_chunked_prefill_and_preemption(models, family):
    """Dense (Llama), fused checkpoint tensors (Phi-3), soft-capped gathered logits (Gemma 2), experts split by
    their intermediate features (Qwen3-MoE): tokens identical to transformers, logprobs as close as float32 allows,
    alone and in a mixed batch of decodes beside chunked prefills where someone is preempted."""
    model, path = models(family)
    llm = tp_llm(path, model.config, 2, blocks=6, max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=11)
        check(llm, model, prompts[3:], 12)
        check(llm, model, prompts, 12)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.close()


def test_tp4_replicated_kv_heads_and_padded_vocabulary(models):
    """4 ranks over 2 KV heads (each on 2 ranks) and a vocabulary of 322 (padded to 4 x 81 rows)."""
    model, path = models("llama", num_attention_heads=8, num_key_value_heads=2, vocab_size=322)
    llm = tp_llm(path, model.config, 4, blocks=6, max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        assert llm.engine.runner.num_kv_heads == 1 and llm.engine.runner.model.lm_head.per_rank == 81
        check(llm, model, random_prompts(LENGTHS, model.config.vocab_size, seed=5), 8)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.close()


def test_tp2_uneven_kv_groups(models):
    """3 KV heads on 2 ranks (as the default model's): rank 0 one KV group, rank 1 two, each with its query heads."""
    model, path = models("llama", num_attention_heads=6, num_key_value_heads=3)
    llm = tp_llm(path, model.config, 2, max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        assert (llm.engine.runner.num_kv_heads, llm.engine.runner.model.model.layers[0].self_attn.num_heads) == (1, 2)
        check(llm, model, random_prompts(LENGTHS, model.config.vocab_size, seed=7), 8)
    finally:
        llm.engine.close()


def _generate(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    for o in outs:
        assert o.error is None, o.error
    return [[s.token_ids for s in (o.samples or [o])] for o in outs]


def test_prefix_hits_n_and_seeded_sampling_identical_to_tp1(models):
    """Shared prefixes (hits from the second round on), greedy and seeded sampling, n = 3 completions forking a
    partly filled block (every rank copies its own heads): TP=2 gives exactly TP=1's tokens."""
    model, path = models("qwen3")
    vocab = model.config.vocab_size
    prefix = random_prompts([37], vocab, seed=1)[0]
    prompts = [prefix + p for p in random_prompts([3, 8, 21], vocab, seed=2)]
    rounds = [SamplingParams(max_tokens=10, **GREEDY),
              SamplingParams(max_tokens=10, n=3, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=3, ignore_eos=True)]
    results = {}
    for tp in (1, 2):
        llm = tp_llm(path, model.config, tp, max_num_batched_tokens=32)
        try:
            results[tp] = [_generate(llm, prompts, params) for params in rounds]
            assert llm.engine.scheduler.prefix_hit_tokens >= 2 * 32  # the shared prefix's full blocks, reused
        finally:
            llm.engine.close()
    assert results[2] == results[1]
    assert any(len(set(map(tuple, samples))) > 1 for samples in results[1][1])  # seeded ones differ


def test_close_stops_every_worker(models):
    model, path = models("llama")
    llm = tp_llm(path, model.config, 2)
    assert len(workers()) == 1
    llm.engine.close()
    llm.engine.close()  # idempotent
    assert workers() == []


def test_dead_worker_fails_the_next_step_naming_its_rank(models):
    model, path = models("llama")
    llm = tp_llm(path, model.config, 2)
    try:
        prompt = random_prompts([9], model.config.vocab_size, seed=3)
        params = SamplingParams(max_tokens=4, **GREEDY)
        assert llm.generate(prompt, params)[0].error is None
        proc = llm.engine.ranks.processes[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        out = llm.generate(prompt, params)[0]
        assert out.finish_reason == "error" and "tensor-parallel rank 1" in out.error, out.error
        assert "tensor-parallel rank 1" in llm.engine.fatal_error  # the serving layer reports the engine unhealthy
    finally:
        llm.engine.close()


_ORPHAN = """
import os, signal, sys
from loom.engine.llm import LLM

if __name__ == "__main__":
    llm = LLM(sys.argv[1], kv_cache_memory_bytes=1 << 20, cpu_threads=1, tensor_parallel_size=2)
    print(" ".join(str(p.pid) for p in llm.engine.ranks.processes), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the worker must notice on its own
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_exit_when_the_engine_process_dies(models, tmp_path):
    _, path = models("llama")
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    run = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 60
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), f"workers {pids} outlived their engine's process"


def test_refusals_name_tensor_parallel_size(models, monkeypatch, tmp_path):
    for bad in (0, 65, True, "2"):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    EngineConfig(tensor_parallel_size=2, adapter_roots=[str(tmp_path)])  # adapters are sharded (test_tp_lora.py)
    with pytest.raises(ConfigError, match="tensor_parallel_size: cpu_compile"):
        EngineConfig(tensor_parallel_size=2, cpu_compile=True)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 1024 ranks need 1024 GPUs from cuda:0; \d+ visible"):
        rank_devices(torch.device("cuda"), 1024)
    model, path = models("llama")  # 6 query heads: not on 4 ranks (the workers fail too; all are stopped)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 4 does not divide num_attention_heads of "
                                          "LlamaForCausalLM"):
        LLM(path, kv_cache_memory_bytes=1 << 20, cpu_threads=1, tensor_parallel_size=4)
    assert workers() == [] and not dist.is_initialized()
    # an architecture without tensor parallelism is refused by name (here on rank 0 only: its workers loaded theirs
    # and wait in a collective when the engine stops them)
    monkeypatch.setattr(loader, "TENSOR_PARALLEL_ARCHITECTURES", frozenset())
    with pytest.raises(ConfigError, match="tensor_parallel_size: LlamaForCausalLM is not served with "
                                          "tensor_parallel_size > 1"):
        LLM(path, kv_cache_memory_bytes=1 << 20, cpu_threads=1, tensor_parallel_size=2)

