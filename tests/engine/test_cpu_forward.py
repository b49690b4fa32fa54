"""The CPU forwards against the reference: the compiled forward (torch.compile, cpu_compile) and the eager fast
path (pre-packed oneDNN GEMMs, in-place C++ attention and LoRA) give the same greedy tokens as the PyTorch
reference path (LOOM_CPU_KERNELS=0), through decodes of one sequence, mixed batches, prefill chunks that sample
nothing, prefix-cache hits and several LoRA adapters in one batch; and the thread count follows the cores."""
from __future__ import annotations

import gc
import os
import platform
import random
import resource

import pytest
import torch

from harness.hf_models import random_prompts
from harness.lora import make_peft_adapter, make_tiny_llama
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.engine.worker import cpu
from loom.engine.worker.compiled_forward import CompiledForward, EagerForward
from loom.layers.linear import LoRALinear

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpufwd")
    model = make_tiny_llama(str(root / "model"), seed=3, vocab=320, hidden=96, inter=128, heads=6, kv_heads=2)
    adapters = root / "adapters"
    make_peft_adapter(model, str(adapters / "a"), seed=1, r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    make_peft_adapter(model, str(adapters / "b"), seed=2, r=8,
                      target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    return model, str(adapters)


def _run(llm: LLM) -> list[list[int]]:
    """Every situation the step can be in, each a separate generate() call."""
    out = []
    prompts = random_prompts([1, 9, 23, 40, 64], 320, seed=5)
    out += [o.token_ids for o in llm.generate(prompts[:1], GREEDY)]  # one sequence: steps of one token
    out += [o.token_ids for o in llm.generate(prompts, GREEDY)]  # mixed prefill + decode, chunked (budget 32)
    out += [o.token_ids for o in llm.generate([prompts[4][:32] + [7, 8]], GREEDY)]  # a prefix-cache hit
    loras = ["a", None, "b", "a", "b"]
    out += [o.token_ids for o in llm.generate(prompts, GREEDY, lora_names=loras)]  # adapters mixed in one batch
    out += [o.token_ids for o in llm.generate(prompts[2:4], GREEDY, lora_names="b")]  # one adapter, all rows
    return out


def _llm(model, adapters, **kw) -> LLM:
    return LLM(model, adapter_roots=[adapters], max_lora_rank=8, lora_memory_bytes=1 << 20, block_size=16,
               max_num_batched_tokens=32, kv_cache_memory_bytes=2 << 20, **kw)


@pytest.fixture(scope="module")
def reference_tokens(setup):
    model, adapters = setup
    old = os.environ.get("LOOM_CPU_KERNELS")
    os.environ["LOOM_CPU_KERNELS"] = "0"  # the PyTorch references everywhere, MKL GEMMs
    try:
        llm = _llm(model, adapters)
        assert not any(m.dense for m in llm.engine.runner.model.modules() if isinstance(m, LoRALinear))
        return _run(llm)
    finally:
        if old is None:
            del os.environ["LOOM_CPU_KERNELS"]
        else:
            os.environ["LOOM_CPU_KERNELS"] = old


def test_eager_fast_path_matches_reference(setup, reference_tokens):
    model, adapters = setup
    llm = _llm(model, adapters)
    fwd = llm.engine.runner.forward
    assert isinstance(fwd, EagerForward)
    packed = [m.dense for m in fwd.model.modules() if isinstance(m, LoRALinear)]
    assert all(p is not None for p in packed)  # packed GEMMs, all in one buffer (on huge pages where it can)
    assert len({p.panels.untyped_storage().data_ptr() for p in packed}) == 1
    assert _run(llm) == reference_tokens


def test_failed_build_runs_the_references(setup, reference_tokens, monkeypatch, tmp_path, caplog):
    """No usable compiler (the C++ kernels cannot be built): the engine starts, packs nothing and gives the
    reference path's tokens, with one warning saying so."""
    from loom.kernels import cpu_ext

    model, adapters = setup
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    cpu_ext.build.cache_clear()
    try:
        with caplog.at_level("INFO", logger="loom"):
            llm = _llm(model, adapters)
        assert not any(m.dense for m in llm.engine.runner.model.modules() if isinstance(m, LoRALinear))
        # the step with everything (prefills and decodes, two adapters and none): tokens 7..11 of _run
        prompts = random_prompts([1, 9, 23, 40, 64], 320, seed=5)
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora_names=["a", None, "b", "a", "b"])]
        assert got == reference_tokens[7:12]
    finally:
        cpu_ext.build.cache_clear()  # the next engine loads the real library again
    lines = [r.getMessage() for r in caplog.records if "CPU kernels" in r.getMessage()]
    assert len(lines) == 1 and "unavailable" in lines[0] and r"no C++ compiler" in lines[0]


def test_compiled_forward_matches_reference(setup, reference_tokens):
    model, adapters = setup
    llm = _llm(model, adapters, cpu_compile=True)
    fwd = llm.engine.runner.forward
    assert isinstance(fwd, CompiledForward) and fwd.compile_s > 0  # compiled at the engine's start
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert _run(llm) == reference_tokens
    # one dynamic graph served every step: token counts of 1, chunks sampling nothing, LoRA on and off
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


def test_compute_threads_follow_the_cores(monkeypatch):
    monkeypatch.setattr(cpu, "available_cores", lambda: 2)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert cpu.compute_threads(0) == 2  # torch's count, capped at the cores
        torch.set_num_threads(1)
        assert cpu.compute_threads(0) == 1  # never raised above what the process chose
        assert cpu.compute_threads(2) == 2 and cpu.compute_threads(8) == 2
        assert cpu.serving_threads() == 2  # the cores, shared by the instances, at least one thread each
        assert cpu.serving_threads(instances=2) == 1 and cpu.serving_threads(instances=3) == 1
        monkeypatch.setattr(cpu, "available_cores", lambda: 16)
        assert cpu.serving_threads() == 16 and cpu.serving_threads(instances=3) == 5
    finally:
        torch.set_num_threads(prev)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")
def test_steps_reuse_freed_activations_without_page_faults(default_model_dir):
    """The engine's CPU start keeps freed blocks for reuse (cpu.keep_freed_memory): once a batch has run, the same
    batch again (prefill chunks of 1,024 tokens, decode steps, the default model's 3,072-wide MLP) gets its activations
    back from malloc's heap without the kernel mapping and zeroing pages (by default glibc's trimming and fresh maps
    cost ~12,000 page faults a batch here). The layers run their Python path, which allocates every activation (the
    C++ layer pass, models/layer_pass.py, reuses one workspace and would hide it)."""
    rnd = random.Random(0)
    prompts = [[rnd.randrange(100, 40000) for _ in range(64)] for _ in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(default_model_dir, cpu_threads=1, enable_prefix_caching=False)
    llm.engine.runner.model.model.layer_pass = None
    for _ in range(2):  # the heap reaches its size (in a long test run it may still grow in the second)
        llm.generate(prompts, params)
    gc.collect()  # earlier tests' engines freed now, not by a collection inside the measured batch (they count too)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, params)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 500
