"""KV sizing on CUDA (loom.engine.memory_profile), its logic run on CPU with the CUDA memory counters faked: the
profile forwards run (a prefill of max_num_batched_tokens split at max_model_len, the sampler's working set, the
largest graph batch) against a one-block stand-in cache, and the budget is the free memory left under
gpu_memory_utilization after the measured peaks, the LoRA pools (dense and expert) and the margin."""
from __future__ import annotations

import torch

from harness.hf_models import make_hf_model
from loom.engine.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.memory_profile import MARGIN, kv_cache_budget

GIB = 1 << 30


def test_budget_from_free_memory_after_profiling(tmp_path, monkeypatch):
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=64)
    cfg = EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=150, max_num_seqs=6, cuda_graph_max_batch=4, gpu_memory_utilization=0.9)
    runner = LLMEngine(cfg, load_tokenizer=False).runner
    cfg.lora_memory_bytes, cfg.lora_expert_memory_bytes = 3 * GIB, GIB  # set aside, not allocated here
    peaks = iter([5 * GIB, 2 * GIB, GIB])  # prefill, sampler, graph batch (as the profile measures them)
    steps = []
    orig = runner.prepare

    def spy(batch, lora, *a, **k):
        steps.append([n for n in batch.num_scheduled_tokens])
        assert all(layer.k_cache.shape[0] == 1 for layer in runner.model.attention_layers())  # the stand-in
        return orig(batch, lora, *a, **k)

    runner.prepare = spy
    fake = dict(synchronize=lambda *a: None, reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
                memory_allocated=lambda *a: 0, max_memory_allocated=lambda *a: next(peaks),
                mem_get_info=lambda *a: (70 * GIB, 80 * GIB))
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    budget = kv_cache_budget(runner)
    used = 10 * GIB  # total - free
    assert budget == int(80 * GIB * 0.9) - used - 5 * GIB - GIB - 4 * GIB - MARGIN
    # the largest prefill (prompts of at most max_model_len), then the largest graph batch of decodes
    assert steps == [[64, 64, 22], [1, 1, 1, 1]]
    assert all(layer.k_cache is None for layer in runner.model.attention_layers())
