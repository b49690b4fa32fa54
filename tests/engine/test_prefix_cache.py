"""Prefix cache: every hashed block of a sequence is a registered block whose key chains to its parent.

The rule under test: a cache hit may only return KV computed for the same tokens at the same positions
after the same prefix. Checked as an invariant after every step of randomized schedules (duplicates in one
step, chunked prefill, preemption), and by the outputs: identical to each request run alone on a fresh engine.
"""
from __future__ import annotations

import random

import pytest

from harness.hf_models import assert_no_leak, make_hf_model, random_prompts
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams

BS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("pc"), num_hidden_layers=1)


def check_chain_invariant(engine) -> None:
    """For each sequence: blocks [0, num_hashed_blocks) are registered under (parent entry, adapter, tokens)."""
    bm = engine.block_manager
    for seq in engine.requests.values():
        parent = 0
        for i in range(seq.num_hashed_blocks):
            block = bm.blocks[seq.block_table[i]]
            expected = (parent, seq.adapter_version, tuple(seq.token_ids[i * BS:(i + 1) * BS]))
            assert block.key == expected, f"{seq.request_id} block {i}: key {block.key} != {expected}"
            assert bm.cached.get(block.key) == seq.block_table[i]
            parent = block.entry_id


def run_checked(llm: LLM, prompts, params) -> list[list[int]]:
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        check_chain_invariant(eng)
    assert_no_leak(eng)
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def alone(tiny):
    """Each request run by itself on an engine without a prefix cache."""
    ref = LLM(tiny[1], block_size=BS, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    return lambda prompt, sp: ref.generate([prompt], sp)[0].token_ids


def test_duplicate_prefill_then_third_request_gets_no_false_hit(tiny, alone):
    """Two identical prompts prefilled in one step, decoded past more full blocks; then a request whose
    prompt starts with the tokens of their SECOND block must not hit that chain (it is at another position)."""
    _, path = tiny
    llm = LLM(path, block_size=BS, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=256)
    base = random_prompts([2 * BS + 3], 320, seed=21)[0]
    sp = SamplingParams(max_tokens=2 * BS, **GREEDY)
    run_checked(llm, [base, base], [sp, sp])
    third = base[BS:2 * BS] + random_prompts([5], 320, seed=22)[0]
    out = llm.generate([third], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == alone(third, SamplingParams(max_tokens=8, **GREEDY))


def test_duplicate_blocks_are_shared_not_kept_twice(tiny):
    _, path = tiny
    llm = LLM(path, block_size=BS, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=256)
    prompt = random_prompts([3 * BS + 1], 320, seed=23)[0]
    eng = llm.engine
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=4, **GREEDY))
    eng.step()
    a, b = eng.requests["a"], eng.requests["b"]
    assert a.block_table[:3] == b.block_table[:3]  # the second copy adopted the registered blocks
    assert a.block_table[3] != b.block_table[3]  # the partial block stays private
    check_chain_invariant(eng)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_schedules_keep_the_chain_and_the_outputs(tiny, alone, seed):
    """Shared prefixes (often duplicated in one step), a small token budget (chunked prefill) and a small
    cache (preemption): the chain invariant holds after every step and each output equals its request alone."""
    _, path = tiny
    rng = random.Random(seed)
    stems = random_prompts([2 * BS, 3 * BS + 2, BS], 320, seed=100 + seed)
    prompts, params = [], []
    for i in range(10):
        stem = rng.choice(stems)
        cut = rng.choice([len(stem), BS, BS + 3, 2 * BS])
        tail = random_prompts([rng.randint(0, 6)], 320, seed=1000 * seed + i)[0] if rng.random() < 0.6 else []
        prompts.append(stem[:cut] + tail or stem)
        params.append(SamplingParams(max_tokens=rng.randint(1, 2 * BS), **GREEDY))
    per_block = 2 * 1 * BS * 2 * 16 * 4  # K and V, 1 layer, 2 KV heads, head_dim 16, float32
    llm = LLM(path, block_size=BS, kv_cache_memory_bytes=24 * per_block, max_num_batched_tokens=rng.choice([7, 16, 64]))
    got = run_checked(llm, prompts, params)
    for p, sp, toks in zip(prompts, params, got):
        assert toks == alone(p, sp)
    # a second round finds the first round's blocks, still correct
    got2 = run_checked(llm, prompts[::-1], params[::-1])
    assert got2 == got[::-1]
