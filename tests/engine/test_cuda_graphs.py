"""The decode graph path on CPU, without capture (ModelRunner.enable_graph_emulation): batch-size buckets, padded
rows, the persistent buffers a graph reads, LoRA metadata in static buffers. Greedy tokens must be identical to
the eager path (and to transformers); padded rows must store nothing in the KV cache."""
from __future__ import annotations

import pytest
import torch

from harness.hf_models import assert_no_leak, hf_greedy, make_hf_model, random_prompts
from harness.lora import ADAPTERS, make_peft_adapter, make_tiny_llama, peft_greedy, tiny_llama_config
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.engine.worker.cuda_graphs import check_same_graphs, describe_graphs, graph_batch_sizes

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    b = graph_batch_sizes(256)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256 and all(y - x <= 8 for x, y in zip(b, b[1:]))


def drive(llm, plan, params):
    """plan: (step to add it at, prompt, lora name). -> per request: (tokens, logprobs)."""
    eng = llm.engine
    pending = sorted(enumerate(plan), key=lambda p: p[1][0])
    out: dict[str, tuple[list, list]] = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, lora) = pending.pop(0)
            eng.add_request(f"r{i}", prompt, params, lora)
        for o in eng.step():
            key = f"{o.request_id}#{o.index}"
            toks, lps = out.setdefault(key, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(lp.logprob for lp in (o.new_logprobs or []))
            assert o.error is None, o.error
        step += 1
    return out


def nan_cache(llm):
    llm.engine.runner.kv_cache.fill_(float("nan"))  # a slot something stored in becomes finite


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):  # sliding window 24 on every layer, GQA 3
    return make_hf_model("mistral", tmp_path_factory.mktemp("g"))


def test_graph_path_matches_eager_and_transformers(mistral):
    model, path = mistral
    kw = dict(device="cpu", dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=24,
              max_num_seqs=8, cuda_graph_max_batch=4)
    eager, graphs = LLM(path, **kw), LLM(path, **kw)
    graphs.engine.runner.enable_graph_emulation()
    g = graphs.engine.runner.graphs
    assert g.buckets == [1, 2, 4]
    seen = []
    orig = g.run

    def spy(batch, lora, fill=None):  # sizes of the decode-only steps offered to the graph path
        if batch.num_decode_seqs == len(batch.seqs):
            seen.append(len(batch.seqs))
        return orig(batch, lora, fill)

    g.run = spy
    prompts = random_prompts([5, 30, 3, 12, 9, 17, 26], 320, seed=5)
    prompts.append(prompts[1][:16] + [7, 8])  # a prefix hit
    # arrivals spread out: decode batches of 1 to 7 (buckets 1, 2, 4 padded; 5-7 eager), chunked prefills
    plan = [(0, prompts[0], None), (2, prompts[1], None), (3, prompts[2], None), (3, prompts[3], None),
            (6, prompts[4], None), (9, prompts[5], None), (9, prompts[6], None), (14, prompts[7], None)]
    params = SamplingParams(max_tokens=14, logprobs=0, **GREEDY)
    for llm in (eager, graphs):
        nan_cache(llm)
    got_e, got_g = drive(eager, plan, params), drive(graphs, plan, params)
    for k in got_e:
        assert got_g[k][0] == got_e[k][0], k
        assert max(abs(a - b) for a, b in zip(got_g[k][1], got_e[k][1])) < 1e-4, k
    for i in (0, 4, 7):  # and transformers (eager = transformers everywhere is test_parity's)
        assert got_g[f"r{i}#0"][0] == hf_greedy(model, plan[i][1], 14), f"request {i} diverged from transformers"
    assert {1, 2, 3, 4} <= set(seen) and max(seen) >= 5  # padded buckets used; larger batches left to eager
    assert g.replays == sum(1 for n in seen if n <= 4)
    # padding rows stored nothing: the same slots hold K/V in both caches
    assert torch.equal(torch.isfinite(graphs.engine.runner.kv_cache), torch.isfinite(eager.engine.runner.kv_cache))
    assert_no_leak(graphs.engine)


def test_static_buffers_are_reused(mistral):
    """Every step reads the same persistent tensors: a graph's inputs never move."""
    _, path = mistral
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20, max_num_seqs=4)
    runner = llm.engine.runner
    runner.enable_graph_emulation()
    ptrs = {t.untyped_storage().data_ptr() for t in runner.buffers.dev.values()}
    seen = set()
    orig = runner.prepare

    def spy(*a, **k):
        ids, ctx, sampled = orig(*a, **k)
        if ctx is not None:
            for t in (ids, ctx.positions, ctx.slot_mapping, ctx.logits_indices):
                seen.add(t.untyped_storage().data_ptr())
        return ids, ctx, sampled

    runner.prepare = spy
    llm.generate(random_prompts([4, 9, 6], 320, seed=1), SamplingParams(max_tokens=5, **GREEDY))
    assert seen and seen <= ptrs and runner.graphs.replays > 0
    for (b, _), entry in runner.graphs._graphs.items():
        assert entry.fn is not None and b in runner.graphs.buckets


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    base = make_tiny_llama(str(tmp_path_factory.mktemp("base")), seed=0, layers=1)
    root = tmp_path_factory.mktemp("adapters")
    chosen = [a for a in ADAPTERS if a[0] in ("a1", "a2", "a4", "a6", "a9")]  # q; k,v; gate,up; all; attention
    for i, (name, r, alpha, tm, kw) in enumerate(chosen):
        make_peft_adapter(base, str(root / name), seed=100 + i, r=r, alpha=alpha, target_modules=tm, scale=2.0, **kw)
    return base, root, [a[0] for a in chosen]


def _lora_llm(base, root, **kw):
    return LLM(base, adapter_roots=[str(root)], device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20,
               max_lora_rank=16, block_size=16, max_num_seqs=8, **kw)


def test_mixed_adapter_decode_replays_with_static_lora_rows(lora_setup):
    """Adapters on different module groups, and rows without one, decoding in the same steps through the graph
    path (the step's grouping copied into static buffers): tokens identical to eager and to PEFT."""
    base, root, names = lora_setup
    eager, graphs = _lora_llm(base, root), _lora_llm(base, root)
    graphs.engine.runner.enable_graph_emulation()
    for llm in (eager, graphs):
        for n in names:
            llm.engine.adapters.load(n)
    rows = [names[0], None, names[1], names[2], names[3], None, names[4], names[0]]
    g = torch.Generator().manual_seed(3)
    vocab = tiny_llama_config(layers=1).vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 14, (len(rows),))]
    plan = [(i // 3, p, r) for i, (p, r) in enumerate(zip(prompts, rows))]  # three arrival waves
    params = SamplingParams(max_tokens=8, logprobs=0, **GREEDY)
    got_e, got_g = drive(eager, plan, params), drive(graphs, plan, params)
    for k in got_e:
        assert got_g[k][0] == got_e[k][0], k
    keys = {key for _, key in graphs.engine.runner.graphs._graphs}
    assert len(keys - {None}) >= 2  # graphs for different module-group sets
    name = names[3]  # all-linear (eager = PEFT for every adapter is tests/lora's)
    idx = [i for i, r in enumerate(rows) if r == name]
    for i, (toks, _, _) in zip(idx, peft_greedy(base, str(root / name), [prompts[i] for i in idx], 8)):
        assert got_g[f"r{i}#0"][0] == toks, f"row {i} (adapter {name}) diverged from PEFT"


def test_graph_path_with_triton_kernels(lora_setup, monkeypatch):
    """The same with the Triton kernels (interpreted): padded rows, static LoRA groups and the decode split count
    chosen from the bucket, as a captured graph would launch them."""
    base, root, names = lora_setup
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    eager, graphs = _lora_llm(base, root), _lora_llm(base, root)
    graphs.engine.runner.enable_graph_emulation()
    rows = [names[3], None, names[4]]
    prompts = random_prompts([4, 2, 3], tiny_llama_config().vocab_size, seed=8)
    params = SamplingParams(max_tokens=3, **GREEDY)
    outs = [llm.generate(prompts, params, lora_names=rows) for llm in (eager, graphs)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert graphs.engine.runner.graphs.replays > 0


class _Ranks:
    """What check_same_graphs reads of a tensor-parallel group: every rank's list (rank 1's given)."""

    def __init__(self, rank1):
        self.rank1 = rank1

    def gather_objects(self, mine):
        return [mine, self.rank1]


def test_tp_ranks_must_capture_the_same_graphs_in_the_same_order():
    """Under tensor parallelism a rank capturing other graphs, or the same ones in another order, would record its
    collectives out of step with rank 0's: every rank refuses, naming both lists."""
    key = frozenset({"qkv_proj", "o_proj"})
    plan = [(2, None), (1, None), (2, key), (1, key)]
    check_same_graphs(_Ranks(describe_graphs(plan)), plan, "captured")
    with pytest.raises(RuntimeError, match=r"rank 1 plan to capture \[\(2, None\), \(1, None\)\], rank 0 "
                                           r"\[\(2, None\), \(1, None\), \(2, \['o_proj', 'qkv_proj'\]\), .*order"):
        check_same_graphs(_Ranks(describe_graphs(plan[:2])), plan, "plan to capture")
    with pytest.raises(RuntimeError, match=r"rank 1 captured \[\(1, None\), \(2, None\)"):
        check_same_graphs(_Ranks(describe_graphs(plan[1::-1] + plan[2:])), plan, "captured")


def test_verify_steps_replay_graphs_token_identical_to_eager(lora_setup):
    """Speculative decoding's verify steps (rows of 1 + k tokens beside plain decode rows, adapters and rows without
    one mixed) through the verify-graph path: packed rows in a bucket of b rows x (1 + k) tokens, empty rows and
    padding tokens past them, LoRA groups in static buffers. Tokens and logprobs as the eager path's; the padding
    stores nothing in the KV cache."""
    base, root, names = lora_setup
    spec = dict(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, backoff="off")
    kw = dict(max_num_batched_tokens=32, cuda_graph_max_batch=8, speculative_config=spec)
    eager, graphs = _lora_llm(base, root, **kw), _lora_llm(base, root, **kw)
    graphs.engine.runner.enable_graph_emulation()
    vg = graphs.engine.runner.verify_graphs
    assert vg.buckets == [1, 2, 4, 8] and vg.tokens_of(8) == 32
    for llm in (eager, graphs):
        nan_cache(llm)
        for n in names:  # loaded before the steps: both engines schedule alike, whatever the loader's timing
            llm.engine.adapters.load(n)
    vocab = tiny_llama_config(layers=1).vocab_size
    parts = random_prompts([3, 5, 4, 6, 2, 7], vocab, seed=4)
    prompts = [parts[0] * 4, parts[1] * 3, parts[2] + parts[3], parts[3] * 3, parts[4] * 6, parts[5] * 2]
    rows = [names[3], None, names[0], names[4], None, names[3]]
    plan = [(i // 2, p, r) for i, (p, r) in enumerate(zip(prompts, rows))]
    params = SamplingParams(max_tokens=16, logprobs=0, **GREEDY)
    got_e, got_g = drive(eager, plan, params), drive(graphs, plan, params)
    for k in got_e:
        assert got_g[k][0] == got_e[k][0], k
        assert max(abs(a - b) for a, b in zip(got_g[k][1], got_e[k][1])) < 1e-4, k
    st = graphs.engine.stats().spec_decoding
    assert vg.replays > 0 and st.num_accepted_tokens > 0, (vg.replays, st)
    assert st == eager.engine.stats().spec_decoding
    assert torch.equal(torch.isfinite(graphs.engine.runner.kv_cache), torch.isfinite(eager.engine.runner.kv_cache))
    assert_no_leak(graphs.engine)


def test_verify_graph_path_with_triton_kernels(lora_setup, monkeypatch):
    """The same with the Triton kernels (interpreted; against the eager C++ path), as a captured verify graph
    launches them: the prefill attention over every row (query length 1 + k at most, rows past the step's empty,
    padding tokens in no row), the fused rope + store skipping the padding's slots, LoRA groups in static buffers.
    The target is its own draft (every step after the first verifies k proposals, all accepted)."""
    base, root, names = lora_setup
    spec = dict(method="draft_model", model=base, num_speculative_tokens=2, backoff="off")
    eager = _lora_llm(base, root, max_num_batched_tokens=16, speculative_config=spec)  # the C++ path: seconds faster
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    graphs = _lora_llm(base, root, max_num_batched_tokens=16, speculative_config=spec)
    graphs.engine.runner.enable_graph_emulation()
    prompts = random_prompts([3, 2, 2], tiny_llama_config().vocab_size, seed=9)
    rows = [names[3], None, names[3]]
    # rows of 3, 2 and 3 tokens (max_tokens cuts the second's proposals) in bucket 4: padding tokens, an empty row
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (4, 3, 4)]
    for llm in (eager, graphs):
        llm.engine.adapters.load(names[3])
    outs = [llm.generate(prompts, params, lora_names=rows) for llm in (eager, graphs)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert graphs.engine.runner.verify_graphs.replays > 0
    assert graphs.engine.stats().spec_decoding.num_accepted_tokens > 0
