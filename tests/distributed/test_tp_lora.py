"""Multi-LoRA under tensor parallelism on CPU (gloo): with adapters on every projection (fused q|k|v and gate|up with a
KV head replicated on both ranks; Mixtral's experts) a mixed batch of several adapters and the base model gives on 2
ranks the greedy tokens of transformers + PEFT and of TP=1, and TP=1's seeded samples; adapters loaded, compacted,
evicted, reloaded and unloaded while requests stream keep every rank's rows equal to rank 0's, which each worker
checks before a step; LoRA on lm_head stays refused."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from harness.hf_models import (
    DEFAULT_PEFT_TARGETS,
    PEFT_TARGETS,
    hf_greedy_logprobs,
    make_hf_model,
    make_peft_adapter,
    peft_model,
    random_prompts,
)
from harness.lora import holder_model, tiny_llama_config, write_raw_adapter
from loom.engine.config import EngineConfig
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.layers.forward_context import LoraBatchMeta
from loom.lora import LoraModelSpec, LoraPool
from loom.lora.peft_loader import load_peft_adapter
from loom.lora.tp_pools import PeerLog, PeerPools
from tests.distributed.test_tp import tp_llm, workers
from tests.models.parity import GREEDY, check

LORA = dict(max_lora_rank=16, lora_memory_bytes=2 << 20, lora_expert_memory_bytes=8 << 20,
            max_num_batched_tokens=16, enable_prefix_caching=False)


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.fixture(autouse=True)
def _no_workers_left():
    yield
    assert workers() == [], "a test left tensor-parallel workers running"
    assert not dist.is_initialized()


def _family(tmp_path, family: str, **overrides):
    """(model, path, adapter root): the family's model and adapters a and b of different ranks and scalings on every
    projection kind it has (llama: one KV head, replicated on both ranks, unless `overrides` say otherwise)."""
    overrides = {"num_key_value_heads": 1, **overrides} if family == "llama" else overrides
    model, path = make_hf_model(family, tmp_path / "model", **overrides)
    targets = PEFT_TARGETS.get(family, DEFAULT_PEFT_TARGETS)
    root = tmp_path / "adapters"
    make_peft_adapter(path, str(root / "a"), seed=3, r=4, alpha=8, **targets)
    make_peft_adapter(path, str(root / "b"), seed=4, r=2, alpha=6, **targets)
    return model, path, root


def _sampled(llm, prompts, names):
    params = SamplingParams(max_tokens=6, n=2, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_names=names)
    for o in outs:
        assert o.error is None, o.error
    return [[s.token_ids for s in (o.samples or [o])] for o in outs]


# Llama's TP=2 decode-only steps take the decode-graph path (its eager dense-LoRA steps: the mixed prefill / decode
# steps here, and test_tp2_load_compact_evict_reload_unload_while_serving); Mixtral's expert LoRA runs eagerly anyway.
@pytest.mark.parametrize("family,graphs", [("llama", True), ("mixtral", False)])
def test_tp2_mixed_adapters_match_peft_and_tp1(tmp_path, family, graphs):
    """Chunked prefills beside decodes, each sequence with adapter a, b or none: TP=2's greedy tokens equal
    transformers + PEFT's (logprobs as close as float32 allows) and TP=1's, its seeded samples TP=1's. graphs: TP=2's
    decode-only steps take the decode-graph path (CPU emulation: buckets, padded rows, static buffers; both ranks set
    up in the same order and checked), rank 0 naming each step's bucket and LoRA key; TP=1 stays eager."""
    model, path, root = _family(tmp_path, family)
    oracles = {None: model, "a": peft_model(path, str(root / "a")), "b": peft_model(path, str(root / "b"))}
    names = [None, "a", "b", "a", "b", None]
    prompts = random_prompts([5, 30, 3, 18, 9], model.config.vocab_size, seed=21)
    prompts.append(prompts[1])  # a's prompt without it: the adapters matter
    greedy, sampled = {}, {}
    for tp in (1, 2):
        llm = tp_llm(path, model.config, tp, adapter_roots=[str(root)], **LORA)
        try:
            replayed = []  # the LoRA key of each step rank 0 replayed
            if tp == 2 and graphs:
                llm.engine.runner.enable_graph_emulation()
                g = llm.engine.runner.graphs
                replay = g._replay
                g._replay = lambda b, key, idx: (replayed.append(key), replay(b, key, idx))[1]
            if tp == 2:
                outs = check(llm, model, prompts, 6, lora_names=names, oracle=lambda i: oracles[names[i]])
            else:
                outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), lora_names=names)
            greedy[tp] = [o.token_ids for o in outs]
            sampled[tp] = _sampled(llm, prompts, names)
            if tp == 2 and graphs:  # decode-only steps replayed: mixed-adapter ones (a, b: every group), base ones
                assert set(replayed) == {None, g.lora_groups} == {k for _, k in g._graphs}, replayed
        finally:
            llm.engine.close()
    assert greedy[2] == greedy[1] and sampled[2] == sampled[1]
    assert greedy[2][1] != greedy[2][5]
    assert any(len(set(map(tuple, samples))) > 1 for samples in sampled[1])  # the seeded ones differ


def _serve(eng, got: dict, until=lambda: False) -> dict:
    """Step until `until()` or nothing is left; -> the finished outputs by request id."""
    done = {}
    while eng.has_unfinished_requests() and not until():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.error is None, o.error
                done[o.request_id] = o
    return done


def test_tp2_load_compact_evict_reload_unload_while_serving(tmp_path):
    """Rows written, moved by compaction and reused after an eviction on rank 0 are written and moved alike on
    rank 1 before the step that reads them: every request gets its adapter version's PEFT tokens - one streaming
    across a reload keeps the old version, the next gets the new one - an unloaded adapter leaves the rest serving,
    and one on lm_head is refused. 3 KV heads on 2 ranks: rank 1 holds two, so its part of a row is larger and the
    ranks agree on its (smaller) count of rows."""
    model, path, root = _family(tmp_path, "llama", num_key_value_heads=3)
    spec_row = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(model.config), torch.float32, "cpu")
    llm = tp_llm(path, model.config, 2, adapter_roots=[str(root)], **{**LORA, "lora_memory_bytes": 9 * spec_row})
    eng, reg = llm.engine, llm.engine.adapters
    try:
        info = reg.info()  # rows every rank holds, sized by rank 1's larger part of a row (each smaller than a row)
        cap, row = info["capacity_rows"], info["row_bytes"]
        rank0_row = LoraPool.row_bytes_for(reg.pool.spec, torch.float32, "cpu")
        assert 7 <= cap <= 20 and cap == 9 * spec_row // row and rank0_row < row < spec_row, (cap, row, rank0_row)
        ranks = {"x": 2, "y": 4, "z": cap - 6, "w": cap - 4}
        for name, r in ranks.items():
            make_peft_adapter(path, str(root / name), seed=10 + r, r=r, alpha=2 * r, **DEFAULT_PEFT_TARGETS)
        oracle = {n: peft_model(path, str(root / n)) for n in ranks}
        oracle[None] = model
        prompts = random_prompts([7, 12, 4], model.config.vocab_size, seed=8)
        p = SamplingParams(max_tokens=5, **GREEDY)

        def expect(name, prompt, out, n=5):
            """`out`: an output (its error None) or the tokens a streamed request got; n tokens of PEFT's."""
            tokens = out if isinstance(out, list) else out.token_ids
            assert isinstance(out, list) or out.error is None, out.error
            ref = hf_greedy_logprobs(oracle[name], prompt, n)[0]
            assert tokens == ref, f"adapter {name}: {tokens} vs PEFT {ref}"

        for name in ("x", "y", "z"):
            reg.load(name)
        outs = llm.generate(prompts, p, lora_names=["x", "y", "z"])  # x, y, z fill the pool in that order
        for name, prompt, o in zip("xyz", prompts, outs):
            expect(name, prompt, o)
        assert [reg.list()[i]["row_start"] for i in range(3)] == [0, 2, 6]
        reg.unload("x")
        reg.unload("z")  # free: rows [0, 2) and [6, cap): w needs cap - 4 together, so y moves out of [0, cap - 4)
        reg.load("w")
        outs = llm.generate(prompts[:2], p, lora_names=["y", "w"])
        assert reg.num_compactions == 1 and {d["name"]: d["row_start"] for d in reg.list()} == {"w": 0, "y": cap - 4}
        expect("y", prompts[0], outs[0])
        expect("w", prompts[1], outs[1])
        # y streams while its files are replaced and it is reloaded (rank 2: w is evicted for its rows)
        got: dict = {}
        eng.add_request("old", prompts[2], SamplingParams(max_tokens=8, **GREEDY), "y")
        _serve(eng, got, until=lambda: len(got.get("old", [])) >= 3)
        shutil.rmtree(root / "y")
        make_peft_adapter(path, str(root / "y"), seed=99, r=2, alpha=3, **DEFAULT_PEFT_TARGETS)
        reg.reload("y")
        eng.add_request("new", prompts[2], SamplingParams(max_tokens=8, **GREEDY), "y")
        eng.add_request("base", prompts[1], SamplingParams(max_tokens=8, **GREEDY), None)
        _serve(eng, got)
        assert reg.num_evictions >= 1
        expect("y", prompts[2], got["old"], 8)
        oracle["y"] = peft_model(path, str(root / "y"))
        expect("y", prompts[2], got["new"], 8)
        assert got["old"] != got["new"]
        expect(None, prompts[1], got["base"], 8)
        reg.unload("y")
        outs = llm.generate(prompts[:2], p, lora_names=["w", None])  # w placed again, into rows y's versions held
        expect("w", prompts[0], outs[0])
        # no LoRA on the vocabulary-parallel embedding / lm_head (none without TP either): refused by name
        write_raw_adapter(str(root / "head"), model.config, 0, 2, 2, ["q_proj"],
                          extra_config={"target_modules": ["q_proj", "lm_head"]})
        with pytest.raises(RequestError, match="lora_name: adapter 'head': unsupported target module 'lm_head'"):
            eng.add_request("head", prompts[0], p, "head")
    finally:
        eng.close()


def _meta(rows: list[int], ranks: list[int], versions: list[int]) -> LoraBatchMeta:
    """What PeerPools.check reads of a step's grouping."""
    z = torch.zeros(0)
    return LoraBatchMeta(token_indices=z, seg_starts=z, row_start=z, ranks=z, scalings=z, max_rank=max(ranks),
                         max_seg_len=1, row_start_cpu=rows, ranks_cpu=ranks, versions_cpu=versions)


def test_peer_pools_repeat_rank0s_writes_and_moves_and_refuse_other_versions(tmp_path):
    """In one process: a peer's pools replay rank 0's log (writes of two adapters with different targets, a move)
    into the same rows, and a step reading rows that hold another version than the one it names is refused."""
    cfg = tiny_llama_config()
    spec = LoraModelSpec.from_hf_config(cfg)
    conf = EngineConfig(lora_memory_bytes=8 * LoraPool.row_bytes_for(spec, torch.float32, "cpu"))
    rank0, peer = (PeerPools(conf, holder_model(cfg), torch.device("cpu"), torch.float32, None) for _ in range(2))
    log = PeerLog(rank0.pools)
    x = load_peft_adapter(write_raw_adapter(str(tmp_path / "x"), cfg, seed=1, r=2, alpha=4, target_modules=["q_proj",
                          "down_proj"]), "x", spec, torch.float32, 16)
    y = load_peft_adapter(write_raw_adapter(str(tmp_path / "y"), cfg, seed=2, r=3, alpha=3, target_modules=["v_proj",
                          "o_proj", "up_proj"]), "y", spec, torch.float32, 16)
    dense = rank0.pools[0]
    for start, w, version in ((0, x, 7), (2, y, 8)):
        dense.write(start, w)
        log.write(0, start, dense.rank_of(w), w, version)
    dense.move(2, 5, 3)
    log.move(0, 2, 5, 3)
    peer.apply(*log.take())
    assert log.take() is None
    for mine, theirs in zip(dense.read(0, 8), peer.pools[0].read(0, 8)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert dense.read(5, 3)[0]["qkv_proj"].abs().sum() > 0  # y's rows, moved
    peer.check(_meta([0, 5], [2, 3], [7, 8]))
    with pytest.raises(RuntimeError, match=r"rows \[5, 8\) of row space 0 hold adapter versions \[8\], the step reads "
                                           "version 9"):
        peer.check(_meta([5], [3], [9]))
    with pytest.raises(RuntimeError, match=r"rows \[1, 4\) .* versions \[7, 8\]"):
        peer.check(_meta([1], [3], [8]))
