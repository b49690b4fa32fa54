"""Families tests/distributed/test_tp.py does not run under tensor parallelism whose sharded paths differ from those it
runs: Gemma 3 (q/k norms with Gemma's (1 + w), a rope per layer type) and Mixtral (softmax top-k routing, experts
split by their intermediate features). TP=2 gives transformers' greedy tokens in float32. (Mistral and Qwen2 shard as
Phi-3's every-layer window and Qwen3's q/k/v biases do; both were checked the same way once, in 2026-12.)"""
from __future__ import annotations

import pytest

from harness.hf_models import make_hf_model, random_prompts
from loom.engine.llm import LLM
from tests.models.parity import check


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.mark.parametrize("family", ["gemma3", "mixtral"])
def test_tp2_greedy_matches_transformers(tmp_path, family):
    model, path = make_hf_model(family, tmp_path / family)
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=1 << 20, cpu_threads=1, tensor_parallel_size=2,
              max_num_batched_tokens=16)
    try:
        check(llm, model, random_prompts([7, 30], model.config.vocab_size, seed=2), 8)  # past the 24-token window
    finally:
        llm.engine.close()
