"""Greedy tokens identical to transformers' generate (float32) across families and scheduling situations.
With LOOM_TEST_DEVICE=cuda the engine runs on the GPU (float32, compiled kernels); the oracle stays on the CPU."""
from __future__ import annotations

import pytest

from harness.hf_models import assert_no_leak, hf_greedy, make_hf_model, random_prompts
from harness.suite_device import engine_kwargs
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
ENGINE = engine_kwargs()  # explicit device and float32 (on CUDA, dtype auto would be bf16)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def family(request, tmp_path_factory):
    tie = request.param == "qwen2"  # cover tied embeddings too
    model, path = make_hf_model(request.param, tmp_path_factory.mktemp("m"), tie=tie)
    return request.param, model, path


def _check(llm, model, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length"
        assert o.token_ids == hf_greedy(model, p, max_tokens), f"prompt of {len(p)} tokens diverged"
    assert_no_leak(llm.engine)
    return outs


def test_single_and_mixed_batch(family):
    _, model, path = family
    llm = LLM(path, **ENGINE, block_size=16, kv_cache_memory_bytes=4 << 20)
    prompts = random_prompts([1, 7, 16, 33, 70], 320)
    _check(llm, model, prompts[:1], 12)  # single prompt
    _check(llm, model, prompts, 12)  # all at once, mixed lengths


def test_chunked_prefill_tiny_token_budget(family):
    _, model, path = family
    llm = LLM(path, **ENGINE, block_size=16, max_num_batched_tokens=7, kv_cache_memory_bytes=4 << 20)
    prompts = random_prompts([30, 45, 9], 320, seed=1)
    _check(llm, model, prompts, 10)


def test_shared_prefix_hits_counted(family):
    _, model, path = family
    llm = LLM(path, **ENGINE, block_size=16, kv_cache_memory_bytes=4 << 20)
    prefix = random_prompts([48], 320, seed=2)[0]
    tails = random_prompts([5, 11, 3], 320, seed=3)
    prompts = [prefix + t for t in tails]
    _check(llm, model, prompts[:1], 8)
    hits_before = llm.engine.scheduler.prefix_hit_tokens
    _check(llm, model, prompts[1:], 8)  # both find the first request's 3 cached prefix blocks
    assert llm.engine.scheduler.prefix_hit_tokens - hits_before == 2 * 48
    # A prompt equal to a cached prefix still computes its last token (logits are needed).
    outs = _check(llm, model, [prefix], 8)
    assert outs[0].num_cached_tokens == 32


def test_preemption_under_tiny_kv_budget(family):
    _, model, path = family
    c = model.config
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    llm = LLM(path, **ENGINE, block_size=16, kv_cache_memory_bytes=7 * per_block, enable_prefix_caching=False)
    prompts = random_prompts([20, 25, 18, 30], 320, seed=4)
    _check(llm, model, prompts, 30)
    assert llm.engine.scheduler.num_preemptions > 0


def test_triton_kernel_path_parity(tmp_path, monkeypatch):
    """The same greedy tokens with every kernel switched to its Triton version (interpreted on CPU)."""
    model, path = make_hf_model("llama", tmp_path)
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    llm = LLM(path, **ENGINE, block_size=16, max_num_batched_tokens=20, kv_cache_memory_bytes=1 << 20)
    _check(llm, model, random_prompts([3, 21, 35], 320, seed=11), 6)


def test_default_model_matches_transformers(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(default_model_dir, **ENGINE, block_size=16, max_num_batched_tokens=24)
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    texts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):", chat]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    outs = _check(llm, model, prompts, 16)
    assert outs[0].text.startswith(" Paris")
    assert "Paris" in outs[3].text
