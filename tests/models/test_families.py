"""Every family against transformers in float32: greedy tokens identical to `generate`, logprobs within 1e-4 of a
full-recompute forward, alone and in a mixed batch with chunked prefill and preemption; plus what each family
adds (sliding windows longer prompts than the window, expert coverage, fused checkpoint tensors)."""
from __future__ import annotations

import pytest
import torch

import loom.layers.moe as moe_mod
from harness.hf_models import FAMILIES, hf_greedy_logprobs, random_prompts
from loom.engine.llm import LLM
from tests.models.parity import block_bytes, check

LENGTHS = [1, 9, 33, 47]  # the longer two exceed every windowed family's sliding window (24)


@pytest.mark.parametrize("family", FAMILIES)
def test_alone_and_mixed_batch_with_chunked_prefill_and_preemption(tiny_model, family):
    model, path = tiny_model(family)
    cfg = model.config
    # 6 blocks of 16 for prompts needing 1+2+3+4: someone is preempted; 16 tokens a step: long prompts are chunked
    llm = LLM(path, block_size=16, max_num_batched_tokens=16, kv_cache_memory_bytes=6 * block_bytes(cfg),
              enable_prefix_caching=False)
    prompts = random_prompts(LENGTHS, cfg.vocab_size, seed=11)
    check(llm, model, prompts[3:], 12)  # alone
    check(llm, model, prompts, 12)  # mixed: decodes beside chunked prefills, preempted and recomputed
    assert llm.engine.scheduler.num_preemptions > 0


def test_windowed_families_attend_within_the_window(tiny_model):
    """The prompts above are longer than each window; a model without its window gives other tokens there, so the
    parity above checks the window (not just full attention)."""
    for family in ("mistral", "qwen2", "phi3", "gemma2", "gemma3"):
        model, _ = tiny_model(family)
        assert model.config.sliding_window == 24
        prompt = random_prompts(LENGTHS, model.config.vocab_size, seed=11)[3]
        windowed = hf_greedy_logprobs(model, prompt, 1)[1][0]
        saved = model.config.sliding_window
        try:
            model.config.sliding_window = 4096
            for m in model.modules():
                if getattr(m, "sliding_window", None) == saved:
                    m.sliding_window = 4096
            full = hf_greedy_logprobs(model, prompt, 1)[1][0]
        finally:
            model.config.sliding_window = saved
            for m in model.modules():
                if getattr(m, "sliding_window", None) == 4096:
                    m.sliding_window = saved
        assert abs(windowed - full) > 1e-3, family


def test_mistral_serves_its_full_context(tiny_model):
    """A 20-token prompt with a 24-token window gets every token it asks for (no cap at the window)."""
    model, path = tiny_model("mistral")
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20)
    assert llm.engine.runner.max_model_len == model.config.max_position_embeddings
    prompt = random_prompts([20], model.config.vocab_size, seed=3)
    out = check(llm, model, prompt, 40)[0]
    assert len(out.token_ids) == 40


def test_mixtral_batches_where_every_expert_and_where_some_expert_gets_tokens(tiny_model, monkeypatch):
    model, path = tiny_model("mixtral")
    E = model.config.num_local_experts
    seen = []
    real = moe_mod.SparseMoeBlock.route

    def spy(self, x):  # the routing every expert path (packed on CPU, fused_moe elsewhere) is given
        weights, ids = real(self, x)
        seen.append(torch.bincount(ids.flatten(), minlength=E))
        return weights, ids

    monkeypatch.setattr(moe_mod.SparseMoeBlock, "route", spy)
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20)
    check(llm, model, random_prompts([40], model.config.vocab_size, seed=5), 4)
    assert any(bool((c > 0).all()) for c in seen), "no layer call where every expert got tokens"
    assert any(bool((c == 0).any()) for c in seen), "no layer call where some expert got none"
    seen.clear()
    check(llm, model, random_prompts([1], model.config.vocab_size, seed=6), 4)  # one token: 2 of 8 experts
    assert all(int((c > 0).sum()) == 2 for c in seen)


def test_phi3_fused_checkpoint_tensors_land_in_their_slices(tiny_model):
    model, path = tiny_model("phi3")
    llm = LLM(path, kv_cache_memory_bytes=4 << 20)
    ours, theirs = llm.engine.runner.model.model.layers, model.model.layers
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    sizes = [cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd]
    for a, b in zip(ours, theirs):
        assert a.self_attn.qkv_proj.output_sizes == sizes
        q, k, v = a.self_attn.qkv_proj.weight.split(sizes)
        hf = b.self_attn.qkv_proj.weight
        assert torch.equal(q, hf[:sizes[0]]) and torch.equal(k, hf[sizes[0]:sizes[0] + sizes[1]])
        assert torch.equal(v, hf[sizes[0] + sizes[1]:])
        gate, up = a.mlp.gate_up_proj.weight.chunk(2)
        hf_gate, hf_up = b.mlp.gate_up_proj.weight.chunk(2)  # Phi3MLP: gate first, then up
        assert torch.equal(gate, hf_gate) and torch.equal(up, hf_up)
