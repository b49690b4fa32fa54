"""Speculative decoding (prompt lookup) against real oracles: greedy tokens identical to the engine without it,
sampled tokens distributed as the target's (chi-square), KV blocks all returned, bad configs refused by name."""
from __future__ import annotations

import math

import pytest
import torch

from harness.hf_models import (
    assert_no_leak,
    hf_config,
    hf_greedy,
    make_hf_model,
    make_peft_adapter,
    random_prompts,
)
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.engine.spec_decode.config import SpeculativeConfig
from loom.engine.spec_decode.ngram import propose_ngram
from loom.errors import ConfigError

pytestmark = pytest.mark.usefixtures("single_thread_torch")
SPEC = dict(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, backoff="off")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def repetitive_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so proposals exist) mixed with plain random ones, of various lengths."""
    base = random_prompts([7, 11, 5, 30, 19], vocab, seed)
    return [base[0] * 4, base[1] * 3 + base[2], base[3], base[2] * 6 + base[4], base[4] + base[4][:9]]


def run(llm: LLM, prompts, params, loras=None) -> list[list[int]]:
    outs = llm.generate(prompts, params, loras)
    return [o.token_ids for o in outs]


def spec_stats(llm: LLM):
    return llm.engine.stats().spec_decoding


# ---- proposals and config -----------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 1, 3) == [7, 5]  # latest occurrence of 1 2 3
    assert propose_ngram([4, 5, 6, 1, 2, 5, 6], 3, 2, 3) == [1, 2, 5]  # 5 6 matched (n = 2; 2 5 6 does not recur)
    assert propose_ngram([4, 5, 6, 1, 2, 5, 6], 3, 3, 3) == []  # no 3-gram recurs
    assert propose_ngram([1, 2, 3], 4, 1, 2) == []
    assert propose_ngram([7, 7, 7, 7], 3, 1, 2) == [7]  # what follows the latest earlier 7 7


@pytest.mark.parametrize("cfg, field", [
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
    ({"prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "eagle"}, "speculative_config.method"),
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"model": "/m"}, "speculative_config.model"),
    ({"disable_by_batch_size": -1}, "speculative_config.disable_by_batch_size"),
    ({"backoff": "auto"}, "speculative_config.backoff"),
    ({"num_spec_tokens": 3}, "speculative_config.num_spec_tokens"),
    ("[1]", "speculative_config"),
    ("{not json", "speculative_config"),
])
def test_bad_speculative_config_is_refused_naming_the_field(cfg, field):
    from loom.engine.config import EngineConfig

    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=cfg)
    assert e.value.field == field


def test_config_pbtxt_takes_a_json_object(tmp_path):
    from loom.serving.serve_config import parse_model_parameters

    raw = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    cfg = parse_model_parameters({"speculative_config": {"string_value": raw}}, str(tmp_path)).engine
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3)
    with pytest.raises(ConfigError) as e:
        parse_model_parameters({"speculative_config": {"string_value": '{"num_speculative_tokens": 99}'}},
                               str(tmp_path))
    assert e.value.field == "speculative_config.num_speculative_tokens"


# ---- greedy: the same tokens as without speculation --------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_greedy_identical_on_tiny_models(arch, tmp_path):
    """Mixed steps (verify rows beside decodes and chunked prefills), a tiny KV cache (preemption), prefix hits
    (the same prompts twice), n > 1 beside them; tokens identical, every block returned."""
    _, path = make_hf_model(arch, tmp_path)
    # 32 blocks of 8 tokens (2 layers, 2 KV heads of 16, float32): 4 running requests preempt each other
    kw = dict(block_size=8, kv_cache_memory_bytes=32 * 4096, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = repetitive_prompts(hf_config(arch).vocab_size)
    prompts = prompts + prompts[:2]  # prefix hits
    params = [SamplingParams(max_tokens=40, **GREEDY)] * len(prompts)
    base = LLM(path, **kw)
    want = run(base, prompts, params)
    spec = LLM(path, speculative_config=SPEC, **kw)
    got = run(spec, prompts, params)
    assert got == want
    st = spec_stats(spec)
    assert st.num_accepted_tokens > 0 and st.num_drafts > 0
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert spec.engine.stats().num_preemptions > 0 and spec.engine.stats().prefix_hit_tokens > 0
    assert_no_leak(spec.engine)
    # n > 1 (sampled) beside greedy requests: runs to its length, blocks returned
    outs = spec.generate(prompts[:2], [SamplingParams(max_tokens=24, n=3, seed=1, temperature=0.8, ignore_eos=True),
                                       SamplingParams(max_tokens=24, **GREEDY)])
    assert [len(s.token_ids) for s in outs[0].samples] == [24] * 3 and outs[1].token_ids == want[1][:24]
    assert_no_leak(spec.engine)


def test_greedy_identical_with_an_adapter_and_logprobs(tmp_path):
    """The verify row runs in its adapter's LoRA group; logprobs are the target's, per accepted token."""
    _, path = make_hf_model("llama", tmp_path)
    roots = tmp_path / "adapters"
    make_peft_adapter(path, str(roots / "a1"), seed=3, target_modules=["q_proj", "v_proj", "down_proj"])
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20, adapter_roots=[str(roots)], max_lora_rank=8)
    prompts = repetitive_prompts(hf_config("llama").vocab_size, seed=2)
    params = [SamplingParams(max_tokens=32, logprobs=2, **GREEDY)] * len(prompts)
    loras = ["a1", None, "a1", "a1", None]
    base, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    want, got = base.generate(prompts, params, loras), spec.generate(prompts, params, loras)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for a, b in zip(w.logprobs, g.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_no_leak(spec.engine)


def test_stops_inside_an_accepted_run(tmp_path):
    """max_tokens, stop_token_ids and eos reached inside a run cut it there; min_tokens holds the stop back;
    "speculative": false opts a request out."""
    _, path = make_hf_model("llama", tmp_path)
    prompts = repetitive_prompts(hf_config("llama").vocab_size, seed=4)
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20)
    base = LLM(path, **kw)
    free = run(base, prompts, [SamplingParams(max_tokens=40, **GREEDY)] * len(prompts))
    # stop on a token each output produces late (so earlier runs were accepted), with and without min_tokens
    cases = []
    for p, out in zip(prompts, free):
        tok = out[len(out) * 2 // 3]
        cases.append(SamplingParams(max_tokens=40, stop_token_ids=[tok], **GREEDY))
        cases.append(SamplingParams(max_tokens=40, stop_token_ids=[tok], min_tokens=out.index(tok) + 2, **GREEDY))
        cases.append(SamplingParams(max_tokens=13, **GREEDY))
        cases.append(SamplingParams(max_tokens=40, temperature=0.0, speculative=False))  # eos counts here
    prompts3 = [p for p in prompts for _ in range(4)]
    spec = LLM(path, speculative_config=SPEC, **kw)
    want = base.generate(prompts3, cases)
    got = spec.generate(prompts3, cases)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_no_leak(spec.engine)


def test_greedy_identical_on_the_default_model_with_stop_strings(default_model_dir):
    text = ("The block manager hands out KV-cache blocks on demand, counts references, and keeps full blocks in a "
            "prefix cache so that a prompt prefix computed once is reused by later requests.")
    prompts = [f"Repeat this sentence exactly: {text}\nRepeated: ", "List the numbers from 1 to 30: 1, 2, 3,",
               f"Quote the text and nothing else.\nText: {text}\nQuote:"]
    params = [SamplingParams(max_tokens=48, temperature=0.0),
              SamplingParams(max_tokens=60, temperature=0.0, stop=["17"]),
              SamplingParams(max_tokens=48, temperature=0.0, stop=["prefix cache"])]
    kw = dict(kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    want = LLM(default_model_dir, **kw).generate(prompts, params)
    spec = LLM(default_model_dir, speculative_config={"num_speculative_tokens": 4, "backoff": "off"}, **kw)
    got = spec.generate(prompts, params)
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    # token ids past a stop string may remain in a run (as in vLLM); the text is cut there
    for g, w in zip(got, want):
        assert g.token_ids[:len(w.token_ids)] == w.token_ids
    st = spec_stats(spec)
    assert st.num_accepted_tokens > 0
    assert_no_leak(spec.engine)


# ---- the back-off -----------------------------------------------------------------------------------------
def test_backoff_follows_the_measured_rates_and_probes_the_other_choice():
    from loom.engine.spec_decode.backoff import MIN_SAMPLES, PROBE_EVERY, BackOff, bucket

    assert [bucket(d) for d in (1, 2, 3, 4, 7, 8, 32)] == [1, 2, 2, 3, 3, 4, 6]
    b = BackOff()
    for _ in range(MIN_SAMPLES):  # nothing measured: speculate, then plain, in turn until each has its samples
        assert b.choose(32) is True
        b.observe(32, True, 40, 1.0)
        assert b.choose(32) is False
        b.observe(32, False, 32, 0.5)  # plain: 64 tokens/s beats speculation's 40
    picks = [b.choose(32) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 2 and not any(picks[:PROBE_EVERY - 2 * MIN_SAMPLES - 1])  # a probe every PROBE_EVERY
    for _ in range(MIN_SAMPLES):  # buckets are separate
        assert b.choose(1) is True
        b.observe(1, True, 4, 0.1)
        assert b.choose(1) is False
        b.observe(1, False, 1, 0.05)
    assert b.choose(1) is True  # 40 tokens/s against 20
    for _ in range(12):  # acceptance falls: speculative steps of batch 1 now generate one token a step, slower
        b.observe(1, True, 1, 0.06)
    assert b.choose(1) is False


def test_measured_backoff_keeps_greedy_tokens(tmp_path):
    """Whatever the back-off decides step by step, the tokens are the plain engine's."""
    _, path = make_hf_model("llama", tmp_path)
    prompts = repetitive_prompts(hf_config("llama").vocab_size, seed=3)
    params = [SamplingParams(max_tokens=24, **GREEDY)] * len(prompts)
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20)
    spec = LLM(path, speculative_config=dict(SPEC, backoff="measured"), **kw)
    assert run(spec, prompts, params) == run(LLM(path, **kw), prompts, params)
    assert spec.engine.spec.backoff.rates and spec_stats(spec).num_drafts > 0
    assert_no_leak(spec.engine)


def test_a_request_whose_proposals_miss_waits_longer_each_time(tmp_path):
    """Per request: after a verification that accepted none of its proposals (or a search that found none) it proposes
    again only 2, 4, ... 32 tokens later (an accepted proposal resets it); checked against every draft the requests
    made, tokens unchanged."""
    from loom.engine.spec_decode import decoder as dec

    _, path = make_hf_model("llama", tmp_path)
    prompts = repetitive_prompts(hf_config("llama").vocab_size, seed=5)
    params = [SamplingParams(max_tokens=48, **GREEDY)] * len(prompts)
    kw = dict(block_size=8, kv_cache_memory_bytes=4 << 20)
    spec = LLM(path, speculative_config=SPEC, **kw)
    drafts: dict[str, list[tuple[int, int]]] = {}  # request -> (its output tokens before the draft, accepted)
    verify = dec.SpecDecoder._verify

    def recording(self, drafted, logits):
        runs = verify(self, drafted, logits)
        for seq, r in zip(drafted, runs):
            drafts.setdefault(seq.request_id, []).append((seq.num_output_tokens - seq.num_draft_tokens, r.accepted))
        return runs

    dec.SpecDecoder._verify = recording
    try:
        got = run(spec, prompts, params)
    finally:
        dec.SpecDecoder._verify = verify
    assert got == run(LLM(path, **kw), prompts, params)
    misses = 0
    for history in drafts.values():
        run_of_misses = 0
        for (at, accepted), (nxt, _) in zip(history, history[1:]):
            run_of_misses = 0 if accepted else run_of_misses + 1
            if not accepted:  # the next draft waits for 1 + min(2^m, 32) tokens after this one's first output
                assert nxt >= at + 1 + min(1 << run_of_misses, dec.MAX_QUIET_TOKENS), (at, nxt, history)
        misses += sum(1 for _, a in history if a == 0)
    assert misses > 0 and any(a for h in drafts.values() for _, a in h)  # both branches of the rule ran
    assert_no_leak(spec.engine)


# ---- sampled: distributed as the target --------------------------------------------------------------------
def _chi2_ok(counts: dict, probs: dict, n: int) -> tuple[float, float]:
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items() if p > 0)
    df = sum(1 for p in probs.values() if p > 0) - 1
    z = 3.0902  # the 0.999 quantile (Wilson-Hilferty)
    return chi2, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    """The joint law of the first four output tokens (top_k 2: 16 outcomes) against transformers' target. The prompt
    holds every vocabulary token (a proposal follows any first token), then the model's own greedy loop (proposals
    the target often accepts): tokens 2-4 are accepted proposals, residual draws after a rejection, or the bonus
    token after an accepted run."""
    model, path = make_hf_model("llama", tmp_path)
    V = hf_config("llama").vocab_size
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(5)).tolist()
    prompt = perm + hf_greedy(model, perm, 60)
    temp, top_k, N, T = 1.2, 2, 1600, 4

    def dist(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double() / temp
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, 0).tolist()))

    probs = {(): 1.0}
    for _ in range(T):
        probs = {key + (t,): p * q for key, p in probs.items() for t, q in dist(prompt + list(key)).items()}
    spec = LLM(path, block_size=8, kv_cache_memory_bytes=16 << 20, max_num_seqs=256,
               speculative_config=dict(SPEC, num_speculative_tokens=2, prompt_lookup_max=2))
    params = [SamplingParams(max_tokens=T, temperature=temp, top_k=top_k, seed=s, ignore_eos=True) for s in range(N)]
    counts: dict = {}
    for out in spec.generate([prompt] * N, params):
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(probs), "a token outside the target's support"
    chi2, crit = _chi2_ok(counts, probs, N)
    assert chi2 < crit, (chi2, crit, counts, probs)
    st = spec_stats(spec)
    # every branch ran: proposals accepted (runs of two: a bonus token) and rejected
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[1] > 0
    assert_no_leak(spec.engine)


def test_vllm_spec_decode_counters_are_exported():
    import time

    from loom.engine.outputs import EngineStats, SpecDecodingStats
    from loom.serving.metrics import LoomMetrics
    from tests.serving.test_metrics_and_config import FakePb

    FakePb.MetricFamily.created.clear()
    m = LoomMetrics(FakePb, {"model": "m"}, interval_s=0.001, names=("vllm",))
    fams = {f.name: f for f in FakePb.MetricFamily.created}
    m.on_step(EngineStats(spec_decoding=SpecDecodingStats(3, 9, 5, [3, 2, 0])), 0, 0)
    time.sleep(0.02)
    m.on_step(EngineStats(spec_decoding=SpecDecodingStats(4, 12, 6, [4, 2, 0])), 0, 0)
    time.sleep(0.02)
    m.close()

    def incs(name, **lab):
        return sum(v for met in fams[name].metrics if all(met.labels.get(k) == x for k, x in lab.items())
                   for op, v in met.ops if op == "inc")
    assert incs("vllm:spec_decode_num_drafts_total") == 4
    assert incs("vllm:spec_decode_num_draft_tokens_total") == 12
    assert incs("vllm:spec_decode_num_accepted_tokens_total") == 6
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [incs(per_pos, position=str(j)) for j in range(3)] == [4, 2, 0]
