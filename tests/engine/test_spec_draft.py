"""Speculative decoding with a draft model, and what every method must keep (structured outputs, penalties, stops,
cancellation) against real oracles: greedy tokens identical to the engine without speculation, sampled tokens
distributed as the target's (chi-square against transformers), KV blocks all returned, bad configs refused."""
from __future__ import annotations

import os

import pytest
import torch

from harness.hf_models import (
    assert_no_leak,
    build_hf_model,
    hf_config,
    make_hf_model,
    make_peft_adapter,
    random_prompts,
)
from loom.engine.llm import LLM
from loom.engine.sample.structured_output import StructuredOutputsParams as SO
from loom.engine.sampling_params import SamplingParams
from loom.errors import ConfigError
from tests.engine.test_spec_decode import GREEDY, _chi2_ok, repetitive_prompts, run, spec_stats

pytestmark = pytest.mark.usefixtures("single_thread_torch")
NGRAM = dict(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, backoff="off")


def draft_cfg(path: str, k: int = 3) -> dict:
    return dict(method="draft_model", model=path, num_speculative_tokens=k, backoff="off")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama, a smaller random one of the same vocabulary (the draft), and an adapter of the first."""
    tmp = tmp_path_factory.mktemp("draft")
    _, path = make_hf_model("llama", tmp)
    _, small = make_hf_model("llama", tmp / "small", num_hidden_layers=1, hidden_size=48, intermediate_size=64,
                             num_attention_heads=3, num_key_value_heads=1)
    make_peft_adapter(path, str(tmp / "adapters" / "a1"), seed=3, target_modules=["q_proj", "v_proj", "down_proj"])
    return path, small, str(tmp / "adapters")


@pytest.fixture(scope="module")
def tok_models(tmp_path_factory, default_model_dir):
    """A tiny Llama with the default model's tokenizer (structured outputs and stop strings need a real one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("tokdraft"), vocab_size=len(tok),
                            eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    tok.save_pretrained(path)
    return path, tok


# ---- config ----------------------------------------------------------------------------------------------------
def test_a_draft_model_that_does_not_fit_is_refused_naming_the_field(models, tmp_path):
    from loom.engine.config import EngineConfig

    path, small, _ = models
    for cfg in ({"method": "draft_model"}, {"model": small}):
        with pytest.raises(ConfigError) as e:
            EngineConfig(speculative_config=cfg)
        assert e.value.field == "speculative_config.model"
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=draft_cfg(small), tensor_parallel_size=2)
    assert e.value.field == "speculative_config.method"
    _, other = make_hf_model("llama", tmp_path, vocab_size=hf_config("llama").vocab_size + 8)
    for bad, words in ((other, "vocab_size"), (str(tmp_path / "none"), "not a model directory")):
        with pytest.raises(ConfigError) as e:
            LLM(path, kv_cache_memory_bytes=1 << 20, speculative_config=draft_cfg(bad))
        assert e.value.field == "speculative_config.model" and words in str(e.value)


# ---- greedy: the same tokens as without speculation ---------------------------------------------------------------
def test_draft_model_greedy_identical_with_preemption_prefix_hits_and_adapters(models):
    """The target as its own draft accepts every proposal (greedy, float32: the draft's KV, mirrored over every
    target forward, shared prefix blocks, forks and preemption, is right); a smaller draft gives the same tokens.
    Adapters: the target runs with the request's, the draft without (acceptance drops, tokens do not change)."""
    path, small, roots = models
    # a tiny KV cache (preemption), chunked prefill, the same prompts twice (prefix hits)
    kw = dict(block_size=8, max_num_batched_tokens=24, max_num_seqs=4, adapter_roots=[roots], max_lora_rank=8)
    prompts = random_prompts([7, 11, 5, 30, 19], hf_config("llama").vocab_size, seed=1)
    prompts = prompts + prompts[:2]
    params = [SamplingParams(max_tokens=32, **GREEDY)] * len(prompts)
    base = LLM(path, kv_cache_memory_bytes=16 << 20, **kw)
    want = run(base, prompts, params)
    want_lora = run(base, prompts, params, ["a1", None] * 3 + ["a1"])
    # 16 blocks of 8 tokens beside the draft's share (2 layers, 2 KV heads of 16, float32: 4096 bytes a block)
    for draft, all_accepted, share in ((path, True, 4096), (small, False, 1024)):
        spec = LLM(path, speculative_config=draft_cfg(draft), kv_cache_memory_bytes=16 * (4096 + share), **kw)
        assert run(spec, prompts, params) == want
        st = spec_stats(spec)
        assert st.num_drafts > 0 and sum(st.accepted_per_pos) == st.num_accepted_tokens
        assert (st.num_accepted_tokens == st.num_draft_tokens) == all_accepted, st
        es = spec.engine.stats()
        assert es.num_preemptions > 0 and es.prefix_hit_tokens > 0
        assert run(spec, prompts, params, ["a1", None] * 3 + ["a1"]) == want_lora
        assert_no_leak(spec.engine)
    # n > 1 (forks copy the partly filled block of both caches) beside greedy: runs to its length
    outs = spec.generate(prompts[:2], [SamplingParams(max_tokens=20, n=3, seed=1, temperature=0.8, ignore_eos=True),
                                       SamplingParams(max_tokens=20, **GREEDY)])
    assert [len(s.token_ids) for s in outs[0].samples] == [20] * 3 and outs[1].token_ids == want[1][:20]
    assert_no_leak(spec.engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_penalties_stops_and_max_tokens_inside_runs_greedy_identical(models, method):
    """Repetition, frequency and presence penalties in the verify rows (each row's penalties from the outputs before
    it; the penalty state rewritten after a run), beside requests whose stop token or max_tokens falls inside a run."""
    path, _, _ = models
    prompts = repetitive_prompts(hf_config("llama").vocab_size, seed=6)
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20)
    pens = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(presence_penalty=0.6),
            dict(repetition_penalty=0.8, frequency_penalty=-0.3)]  # < 1 and < 0: favour repeats (long accepted runs)
    params = [SamplingParams(max_tokens=28, **pens[i % len(pens)], **GREEDY) for i in range(len(prompts))]
    base = LLM(path, **kw)
    free = run(base, prompts, [SamplingParams(max_tokens=28, **GREEDY)] * len(prompts))
    params += [SamplingParams(max_tokens=28, stop_token_ids=[o[len(o) * 2 // 3]], **GREEDY) for o in free]
    params += [SamplingParams(max_tokens=11, **GREEDY) for _ in free]
    prompts3 = prompts * 3
    cfg = NGRAM if method == "ngram" else draft_cfg(path)
    spec = LLM(path, speculative_config=cfg, **kw)
    want, got = base.generate(prompts3, params), spec.generate(prompts3, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_no_leak(spec.engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_structured_outputs_and_stop_strings_greedy_identical(tok_models, method):
    """Proposals checked against each request's grammar, whose masks the verify rows use; the run's tokens then
    advance the matcher (the grammar's end inside a run ends the output there). The target as its own draft accepts
    every proposal only if the verify rows' masks are the draft's. Stop strings inside a run cut the text."""
    path, tok = tok_models
    text = "yes no yes yes no no yes"
    prompts = [tok.encode(f"{text} {text} {text}")] * 4 + [tok.encode("1 2 3 1 2 3 1 2 3")] * 2
    params = [SamplingParams(max_tokens=30, structured_outputs=SO(regex=r"(yes|no)( (yes|no)){0,40}"), **GREEDY),
              SamplingParams(max_tokens=30, structured_outputs=SO(choice=("yes no yes", "no")), **GREEDY),
              SamplingParams(max_tokens=30, structured_outputs=SO(json={"type": "object", "properties": {
                  "a": {"type": "string"}}, "required": ["a"]}, disable_any_whitespace=True), **GREEDY),
              SamplingParams(max_tokens=30, structured_outputs=SO(regex=r"[0-9]( [0-9]){5,20}"), **GREEDY),
              SamplingParams(max_tokens=30, stop=["3 1"], **GREEDY),
              SamplingParams(max_tokens=30, temperature=0.0)]
    kw = dict(block_size=8, kv_cache_memory_bytes=8 << 20)
    want = LLM(path, **kw).generate(prompts, params)
    spec = LLM(path, speculative_config=NGRAM if method == "ngram" else draft_cfg(path), **kw)
    got = spec.generate(prompts, params)
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    for g, w in zip(got, want):
        assert g.token_ids[:len(w.token_ids)] == w.token_ids  # past a stop string a run may hold more ids
    st = spec_stats(spec)
    assert st.num_accepted_tokens > 0
    if method == "draft_model":
        assert st.num_accepted_tokens == st.num_draft_tokens
    assert_no_leak(spec.engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_cancellation_mid_run_leaves_the_others_unchanged(models, method):
    path, small, _ = models
    prompts = repetitive_prompts(hf_config("llama").vocab_size, seed=8)
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=30, **GREEDY)
    want = run(LLM(path, **kw), prompts, [params] * len(prompts))
    spec = LLM(path, speculative_config=NGRAM if method == "ngram" else draft_cfg(small), **kw)
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
        if steps in (3, 6):  # after a few runs were accepted: cancel one request, then another
            eng.abort_request(str(steps // 3))
    for i in range(len(prompts)):
        if i in (1, 2):
            assert got[str(i)] == want[i][:len(got[str(i)])] and len(got[str(i)]) < 30
        else:
            assert got[str(i)] == want[i]
    assert spec_stats(spec).num_drafts > 0
    assert_no_leak(eng)


# ---- sampled: distributed as the target --------------------------------------------------------------------------
def test_draft_model_sampled_tokens_follow_the_target_distribution(tmp_path):
    """The joint law of the first four output tokens (top_k 2: 16 outcomes) against transformers' target, the draft
    a perturbation of the target (its proposals are accepted often, rejected often: every branch of the rejection
    sampler with q the draft's distribution, the residual max(p - q, 0) and the bonus token)."""
    cfg = hf_config("llama")
    model, path = make_hf_model("llama", tmp_path)
    draft = build_hf_model(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.08 * p.std())
    dpath = str(tmp_path / "draft")
    draft.save_pretrained(dpath, safe_serialization=True)
    prompt = random_prompts([12], cfg.vocab_size, seed=10)[0]
    temp, top_k, N, T = 1.3, 2, 1500, 4

    def dist(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double() / temp
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, 0).tolist()))

    probs = {(): 1.0}
    for _ in range(T):
        probs = {key + (t,): p * q for key, p in probs.items() for t, q in dist(prompt + list(key)).items()}
    spec = LLM(path, block_size=8, kv_cache_memory_bytes=16 << 20, max_num_seqs=256,
               speculative_config=draft_cfg(dpath, k=2))
    params = [SamplingParams(max_tokens=T, temperature=temp, top_k=top_k, seed=s, ignore_eos=True) for s in range(N)]
    counts: dict = {}
    for out in spec.generate([prompt] * N, params):
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(probs), "a token outside the target's support"
    chi2, crit = _chi2_ok(counts, probs, N)
    assert chi2 < crit, (chi2, crit, counts, probs)
    st = spec_stats(spec)
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[1] > 0, st
    assert_no_leak(spec.engine)
    # seeded requests reproduce
    first, again = (spec.generate([prompt] * 8, params[:8]) for _ in range(2))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_target_as_its_own_draft_accepts_everything_on_other_families(arch, tmp_path):
    """Sliding windows, soft-capping, q/k/v biases: the draft's mirrored KV is the target's own, so in float32
    greedy every proposal is accepted and the tokens are the plain engine's."""
    _, path = make_hf_model(arch, tmp_path)
    prompts = random_prompts([9, 40, 17], hf_config(arch).vocab_size, seed=12)
    params = [SamplingParams(max_tokens=24, **GREEDY)] * len(prompts)
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=32)
    want = run(LLM(path, **kw), prompts, params)
    spec = LLM(path, speculative_config=draft_cfg(path), **kw)
    assert run(spec, prompts, params) == want
    st = spec_stats(spec)
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens, st
    assert_no_leak(spec.engine)


# ---- the draft model's own adapters (draft_adapter_roots) ------------------------------------------------------
def _gen_with_twins_loaded(llm, prompts, params, lora):
    """Greedy tokens per prompt; the requests are added (their twins' reads start), the twins' loads awaited, then
    stepped: so every prefill's draft KV is computed with the twin, whatever the loader thread's timing."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params, lora)
    while not eng.draft.adapters.registry.wait_for_loads(1.0):
        pass
    out = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def test_draft_adapter_twin_raises_acceptance_and_follows_target_reloads(models, tmp_path):
    """The target as its own draft: with the twin of the request's adapter (the same adapter, under
    draft_adapter_roots) the draft is the adapted target and every proposal is accepted; with no twin of that name the
    bare draft's proposals mostly fail. Tokens are the plain engine's either way. After the target's adapter is
    reloaded with other weights (and its twin rewritten alike), the draft reads its twin again: a stale twin would
    drop the acceptance."""
    import shutil

    path, _, shared = models
    roots, twins, empty = str(tmp_path / "adapters"), tmp_path / "twins", tmp_path / "none"
    empty.mkdir()
    shutil.copytree(os.path.join(shared, "a1"), os.path.join(roots, "a1"))  # rewritten below: not the module's
    shutil.copytree(os.path.join(shared, "a1"), twins / "a1")
    prompts = random_prompts([9, 14, 6], hf_config("llama").vocab_size, seed=21)
    params = SamplingParams(max_tokens=12, **GREEDY)
    kw = dict(block_size=8, kv_cache_memory_bytes=8 << 20, adapter_roots=[roots], max_lora_rank=8)
    base = LLM(path, **kw)
    want = run(base, prompts, [params] * len(prompts), ["a1"] * len(prompts))
    rates = {}
    for twin_root in (twins, empty):
        spec = LLM(path, speculative_config=dict(draft_cfg(path), draft_adapter_roots=[str(twin_root)]), **kw)
        assert _gen_with_twins_loaded(spec, prompts, params, "a1") == want
        st = spec_stats(spec)
        rates[twin_root] = (st.num_accepted_tokens, st.num_draft_tokens)
        assert_no_leak(spec.engine)
    (acc, drafted), (acc0, drafted0) = rates[twins], rates[empty]
    assert drafted > 0 and acc == drafted, rates  # the twin: the adapted target itself
    assert acc0 / drafted0 < 0.5, rates
    # reload: new weights for the target's a1 and its twin; the engine with twins keeps accepting everything
    spec = LLM(path, speculative_config=dict(draft_cfg(path), draft_adapter_roots=[str(twins)]), **kw)
    assert _gen_with_twins_loaded(spec, prompts[:1], params, "a1") == want[:1]  # the old twin read and used
    for d in (os.path.join(roots, "a1"), str(twins / "a1")):
        make_peft_adapter(path, d, seed=77, target_modules=["q_proj", "v_proj", "down_proj"])
    for llm in (base, spec):
        llm.engine.adapters.reload("a1")
    new = run(base, prompts, [params] * len(prompts), ["a1"] * len(prompts))
    assert new != want
    before = spec_stats(spec)
    assert _gen_with_twins_loaded(spec, prompts, params, "a1") == new
    after = spec_stats(spec)
    assert after.num_draft_tokens > before.num_draft_tokens
    assert after.num_accepted_tokens - before.num_accepted_tokens == after.num_draft_tokens - before.num_draft_tokens
    assert_no_leak(spec.engine)


def test_bad_draft_adapter_roots_are_refused_naming_the_field(models, tmp_path):
    from loom.engine.config import EngineConfig

    path, _, _ = models
    (tmp_path / "file").write_text("x")
    for roots in ([str(tmp_path / "missing")], [str(tmp_path / "file")], "dir", [3]):
        with pytest.raises(ConfigError) as e:
            EngineConfig(speculative_config=dict(draft_cfg(path), draft_adapter_roots=roots))
        assert e.value.field == "speculative_config.draft_adapter_roots"
    with pytest.raises(ConfigError) as e:  # prompt lookup has no draft model
        EngineConfig(speculative_config=dict(NGRAM, draft_adapter_roots=[str(tmp_path)]))
    assert e.value.field == "speculative_config.draft_adapter_roots"
