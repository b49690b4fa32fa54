"""vLLM's request-level parameters, each against a direct computation: logit_bias, allowed_token_ids, bad_words,
the grammar mask (sampler level, known logits), and n, prompt_logprobs, truncate_prompt_tokens, logit_bias /
allowed_token_ids through the engine (a small random HF model is the oracle)."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from harness.hf_models import assert_no_leak, make_hf_model, random_prompts
from loom.engine.llm import LLM
from loom.engine.sample.logits_processors import bad_words_token_ids, banned_by_bad_words, build_constraints
from loom.engine.sample.sampler import Sampler, SamplingBatch
from loom.engine.sample.structured_output import StructuredOutputsParams as SO
from loom.engine.sampling_params import SamplingParams as SP
from loom.errors import RequestError
from tests.oracle import assert_float32_close, float32_error_scale, log_softmax_32_64

V = 64


def batch(params, outputs=None, constraints=None, matchers=None, seeds=None, prompts=None, vocab=V):
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), prompts or [[1, 2, 3]] * n, outputs or [[]] * n,
                               [[]] * n, vocab, "cpu", constraints=constraints, matchers=matchers)


def cons(params, tokenizer=None, grammars=None, vocab=V):
    return [build_constraints(p, vocab, tokenizer, grammars) for p in params]


# ------------------------------------------------------------------ sampler level


def test_logit_bias_then_penalties_in_vllms_order():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    ps = [SP(temperature=0, logit_bias={5: 2.5, 7: -300}),  # clamped to -100
          SP(temperature=0, logit_bias={5: 1.0}, repetition_penalty=1.7, presence_penalty=0.5),
          SP(temperature=0)]
    outs = [[5, 9], [5, 9, 9], [1]]
    b = batch(ps, outputs=outs, constraints=cons(ps), prompts=[[2], [3, 5], [4]])
    got = Sampler().process_logits(logits.clone(), b)
    want = logits.clone()
    want[0, 5] += 2.5
    want[0, 7] += -100.0
    want[1, 5] += 1.0  # bias first, then the penalties see the biased logit (vLLM's order)
    for t in {3, 5, 9}:  # repetition penalty over prompt + output ids
        want[1, t] = want[1, t] / 1.7 if want[1, t] > 0 else want[1, t] * 1.7
    for t in {5, 9}:  # presence over output ids
        want[1, t] -= 0.5
    torch.testing.assert_close(got, want)
    assert Sampler()(logits.clone(), b).token_ids.tolist() == want.argmax(-1).tolist()


def test_allowed_token_ids_restricts_the_distribution():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(V, generator=g)
    allowed = [3, 10, 11, 40]
    p = SP(temperature=1.0, allowed_token_ids=allowed)
    n = 4000
    b = batch([p] * n, constraints=cons([p] * n), seeds=list(range(n)))
    toks = Sampler()(row[None].expand(n, V).contiguous(), b).token_ids
    expected = torch.zeros(V, dtype=torch.float64)
    expected[allowed] = torch.softmax(row[allowed].double(), 0)
    freqs = torch.bincount(toks, minlength=V).double() / n
    assert set(toks.tolist()) <= set(allowed)
    assert (freqs - expected).abs().max() < 0.03, (freqs[allowed], expected[allowed])
    greedy = SP(temperature=0, allowed_token_ids=allowed)
    assert Sampler()(row[None].clone(), batch([greedy], constraints=cons([greedy]))).token_ids.item() == \
        allowed[int(row[allowed].argmax())]


def test_bad_words_rule_against_a_direct_check():
    words = [[7], [1, 2], [4, 5, 6]]
    rng = random.Random(0)
    for _ in range(300):
        out = [rng.randrange(8) for _ in range(rng.randrange(0, 6))]
        want = sorted({w[-1] for w in words if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:]
                                                                 == w[:-1])})
        assert sorted(set(banned_by_bad_words(words, out))) == want, out


class WordTokenizer:
    """Words to ids: 'a' -> [1], ' a' -> [11], 'ab' -> [1, 2], ' ab' -> [11, 2]."""
    def encode(self, text, add_special_tokens=False):
        ids = []
        for i, ch in enumerate(text):
            if ch == " ":
                continue
            ids.append(ord(ch) - 96 + (10 if i > 0 and text[i - 1] == " " else 0))
        return ids


def test_bad_words_tokenized_with_and_without_a_leading_space_and_masked():
    assert bad_words_token_ids(WordTokenizer(), ["ab", " c"]) == [[1, 2], [11, 2], [3], [13]]
    p = SP(temperature=0, bad_words=["ab"])
    c = cons([p, p], tokenizer=WordTokenizer())
    b = batch([p, p], outputs=[[5, 1], [5, 11]], constraints=c)
    x = Sampler().process_logits(torch.zeros(2, V), b)
    assert torch.isinf(x[0, 2]) and torch.isinf(x[1, 2])  # 'b' after 'a' / after ' a'
    assert torch.isfinite(x[:, [0, 1, 3, 11]]).all()
    b = batch([p], outputs=[[5, 2]], constraints=c[:1])
    assert torch.isfinite(Sampler().process_logits(torch.zeros(1, V), b)).all()


def test_out_of_vocabulary_ids_are_refused_naming_the_field():
    for p, field in ((SP(logit_bias={V: 1.0}), "logit_bias"), (SP(allowed_token_ids=[V + 3]), "allowed_token_ids")):
        with pytest.raises(RequestError) as ei:
            build_constraints(p, V)
        assert ei.value.field == field


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from harness.default_model import ensure_default_model
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from loom.engine.sample.structured_output import GrammarCompiler
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_grammar_mask_is_exactly_what_the_matcher_accepts(tokenizer, grammars):
    """Every token left finite must be accepted by a copy of the matcher, and a sample of the masked ones must be
    refused (the direct check: xgrammar's own accept_token)."""
    vocab = len(tokenizer)
    p = SP(temperature=0, structured_outputs=SO(regex=r"(yes|no)-[0-9]{2}"))
    c = cons([p], tokenizer, grammars, vocab)
    m = grammars.matcher(c[0].grammar)
    for tok in tokenizer.encode("ye", add_special_tokens=False):
        assert m.accept_token(tok)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2))
    b = batch([p], constraints=c, matchers=[m], vocab=vocab)
    masked = b.processors.apply_grammar(logits.clone())[0]
    out = Sampler()(logits.clone(), b)
    allowed = torch.nonzero(torch.isfinite(masked)).flatten().tolist()
    assert allowed and out.token_ids.item() in allowed
    for t in allowed:
        assert m.fork().accept_token(t), tokenizer.decode([t])
    rng = random.Random(3)
    for t in rng.sample(sorted(set(range(vocab)) - set(allowed)), 300):
        assert not m.fork().accept_token(t)
    # logprobs under a grammar are those of the masked distribution (vLLM applies the mask before sampling)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(masked, -1)[out.token_ids])


def test_grammar_rows_anywhere_in_the_batch_get_their_own_mask(tokenizer, grammars):
    """Grammar rows after plain rows (a step's usual order): each is masked by its own matcher, exactly, and the plain
    rows keep every token. The bitmask is indexed by logits row, not by the matcher's place among the grammar rows
    (the second grammar row here once raised xgrammar's index check and failed the whole step)."""
    vocab = len(tokenizer)
    specs = [None, SO(regex=r"(yes|no)-[0-9]{2}"), None, None, SO(choice=("Positive", "Negative"))]
    params = [SP(temperature=1.0, structured_outputs=s) for s in specs]
    c = cons(params, tokenizer, grammars, vocab)
    matchers = [grammars.matcher(x.grammar) if x is not None and x.grammar is not None else None for x in c]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(4))
    b = batch(params, constraints=c, matchers=matchers, vocab=vocab)
    masked = b.processors.apply_grammar(logits.clone())
    out = Sampler()(logits.clone(), b)
    for row, m in enumerate(matchers):
        allowed = torch.nonzero(torch.isfinite(masked[row])).flatten().tolist()
        if m is None:
            assert torch.equal(masked[row], logits[row])
            continue
        direct = [t for t in range(vocab) if m.fork().accept_token(t)]  # the direct check: xgrammar's own matcher
        assert allowed == direct and out.token_ids[row].item() in allowed


def test_contradicting_constraints_fall_back_to_the_grammar(tokenizer, grammars):
    """min_tokens bans eos but a completed grammar allows only eos: the row is not left without a token."""
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    p = SP(temperature=1.0, min_tokens=5, structured_outputs=SO(choice=("ok",)))
    c = cons([p], tokenizer, grammars, vocab)
    m = grammars.matcher(c[0].grammar)
    for tok in tokenizer.encode("ok", add_special_tokens=False):
        assert m.accept_token(tok)
    b = SamplingBatch.build([p], [0], [[1]], [[5, 6]], [[eos]], vocab, "cpu", constraints=c, matchers=[m])
    assert Sampler()(torch.randn(1, vocab), b).token_ids.item() == eos


# ------------------------------------------------------------------ engine level (HF model as the oracle)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("m"))


@pytest.fixture()
def llm(tiny):
    return LLM(tiny[1], block_size=16, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=64)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# a JSON schema whose whole output is a few tokens: {"ok":true} or {"ok":false}
FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    """The default model (a real tokenizer, which structured outputs need), shared by this module's grammar tests."""
    return LLM(default_model_dir, max_num_seqs=8)


def test_structured_and_plain_requests_share_a_step(default_llm):
    """Through the engine: structured requests (choice, regex, JSON schema) batched after and between plain ones all
    finish within their grammars, and each plain one samples what it samples alone (seeded)."""
    llm = default_llm
    prompt = "Tell me about the sea."
    specs = [None, SO(choice=("Positive", "Negative")), None, SO(regex=r"[0-9]{3}-[a-z]{2}"),
             SO(json=FLAG_SCHEMA, disable_any_whitespace=True)]
    params = [SP(temperature=1.0, seed=10 + i, max_tokens=24, structured_outputs=s) for i, s in enumerate(specs)]
    outs = llm.generate([prompt] * len(params), params)
    for spec, p, o in zip(specs, params, outs):
        assert o.error is None, o.error
        if spec is None:
            assert o.token_ids == llm.generate([prompt], p)[0].token_ids
        elif spec.choice:
            assert o.text in spec.choice
        elif spec.regex:
            assert re.fullmatch(spec.regex, o.text), o.text
        else:
            assert isinstance(json.loads(o.text)["ok"], bool), o.text
    assert_no_leak(llm.engine)


def test_a_complete_grammar_ends_its_request_whatever_ignore_eos_and_min_tokens_ask(default_llm):
    """Once a request's grammar has taken its stop token no token may follow: the request ends there ("stop"), also
    with ignore_eos or a min_tokens beyond the structure's length. Before, the next step asked the finished matcher
    for a mask, xgrammar raised, and the step failed with every request in it (the plain one here too)."""
    llm = default_llm
    prompt = "Is the sea big?"
    specs = [SO(choice=("yes", "no")), SO(json=FLAG_SCHEMA, disable_any_whitespace=True)]
    plain = SP(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    for extra in (dict(ignore_eos=True), dict(min_tokens=20)):
        params = [plain] + [SP(temperature=1.0, seed=5, max_tokens=30, structured_outputs=s, **extra) for s in specs]
        outs = llm.generate([prompt] * len(params), params)
        assert [(o.error, o.finish_reason) for o in outs] == [(None, "length"), (None, "stop"), (None, "stop")]
        assert outs[0].token_ids == llm.generate([prompt], plain)[0].token_ids
        assert outs[1].text in ("yes", "no")
        assert isinstance(json.loads(outs[2].text)["ok"], bool), outs[2].text
    assert_no_leak(llm.engine)


class _FailingMatcher:
    """A matcher xgrammar refuses to fill a mask for (what a finished matcher did): raises as xgrammar raises."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill_next_token_bitmask(self, *args):
        raise RuntimeError("grammar_matcher.cc: Check failed")

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def test_a_failing_grammar_matcher_ends_its_own_request_only(default_llm):
    """xgrammar raising for one request's matcher ends that request with an error naming structured_outputs; the
    plain request and the other structured one of the same steps go on as alone."""
    llm = default_llm
    eng, tok = llm.engine, llm.tokenizer
    ids = tok.encode("Is the sea big?", add_special_tokens=False)
    plain = SP(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    choice = SP(max_tokens=6, structured_outputs=SO(choice=("yes", "no")))
    for rid, p in (("plain", plain), ("bad", choice), ("good", choice)):
        eng.add_request(rid, ids, p)
    eng.requests["bad"].matcher = _FailingMatcher(eng.requests["bad"].matcher)
    outs: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    last = {rid: o[-1] for rid, o in outs.items()}
    assert last["bad"].finish_reason == "error" and last["bad"].error.startswith("structured_outputs:")
    assert last["good"].finish_reason == "stop" and last["plain"].finish_reason == "length"
    tokens = {rid: [t for o in o_list for t in o.new_token_ids] for rid, o_list in outs.items()}
    assert tok.decode(tokens["good"], skip_special_tokens=True) in ("yes", "no")
    assert tokens["plain"] == llm.generate([ids], plain)[0].token_ids
    assert_no_leak(eng)


def test_n_completions_equal_single_requests_with_seed_plus_index_and_share_the_prompt(llm):
    prompt = random_prompts([40], 320, seed=5)[0]  # 2 full blocks + a partial one
    p = SP(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    eng = llm.engine
    eng.add_request("r", prompt, p)
    outs = eng.step()  # the prompt is computed once; the 4 completions sample from its logits row
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    tables = [eng.requests[k].block_table for k in ("r", "r#1", "r#2", "r#3")]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full blocks shared ...
    assert all(eng.block_manager.blocks[b].ref_count == 4 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 4  # ... the partial one copied per completion
    assert eng.block_manager.num_used_blocks == 2 + 4
    while eng.has_unfinished_requests():
        outs += eng.step()
    got = {i: [t for o in outs if o.index == i for t in o.new_token_ids] for i in range(4)}
    assert_no_leak(eng)
    for i in range(4):  # the direct computation: one request per seed
        single = llm.generate([prompt], SP(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True))[0]
        assert got[i] == single.token_ids, i
    assert len({tuple(v) for v in got.values()}) > 1
    full = llm.generate([prompt], p)[0]
    assert [s.token_ids for s in full.samples] == [got[i] for i in range(4)]
    assert_no_leak(eng)


def test_n_completions_survive_preemption_and_abort(tiny):
    llm = LLM(tiny[1], block_size=16, kv_cache_memory_bytes=12 * 2 * 2 * 16 * 2 * 16 * 4, max_num_batched_tokens=64)
    prompt = random_prompts([20], 320, seed=6)[0]
    outs = llm.generate([prompt, prompt], [SP(n=3, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True),
                                           SP(n=2, temperature=1.0, seed=9, max_tokens=40, ignore_eos=True)])
    assert [len(o.samples) for o in outs] == [3, 2] and all(len(s.token_ids) == 40 for o in outs for s in o.samples)
    assert llm.engine.scheduler.num_preemptions > 0
    for i, s in enumerate(outs[0].samples):
        assert s.token_ids == llm.generate([prompt], SP(temperature=1.0, seed=1 + i, max_tokens=40,
                                                        ignore_eos=True))[0].token_ids
    llm.engine.add_request("x", prompt, SP(n=3, temperature=1.0, max_tokens=30, ignore_eos=True))
    llm.engine.step()
    llm.engine.abort_request("x")
    llm.engine.step()
    assert_no_leak(llm.engine)


def test_prompt_logprobs_match_the_model(llm, tiny):
    model, _ = tiny
    prompt = random_prompts([37], 320, seed=7)[0]
    out = llm.generate([prompt], SP(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    lp, lp64 = log_softmax_32_64(model, prompt)
    scale = float32_error_scale(lp, lp64)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        e = out.prompt_logprobs[j]
        want = lp[j - 1]
        assert e.token_id == prompt[j]
        assert_float32_close(e.logprob, lp64[j - 1, prompt[j]], scale, f"prompt token {j}")
        assert e.rank == int((want >= want[prompt[j]]).sum())  # vLLM's rank
        assert [t for t, _ in e.top] == want.topk(3).indices.tolist()
    # the prefix cache is skipped for prompt logprobs; a second identical request gets all of them again
    again = llm.generate([prompt], SP(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert [e.token_id for e in again.prompt_logprobs[1:]] == prompt[1:]
    assert all(e.top == [] for e in again.prompt_logprobs[1:])


def test_prompt_logprobs_with_chunked_prefill(tiny):
    model, path = tiny
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16)
    prompt = random_prompts([50], 320, seed=8)[0]
    out = llm.generate([prompt], SP(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    lp, lp64 = log_softmax_32_64(model, prompt)
    got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
    rows, toks = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    assert_float32_close(got, lp64[rows, toks], float32_error_scale(lp, lp64), "prompt")


def test_logit_bias_and_allowed_token_ids_through_the_engine(llm, tiny):
    model, _ = tiny
    prompt = random_prompts([12], 320, seed=9)[0]
    last = hf_logits(model, prompt)[-1]
    top = int(last.argmax())
    out = llm.generate([prompt], SP(temperature=0, max_tokens=1, logit_bias={top: -100, 17: 5.0}))[0]
    biased = last.clone()
    biased[top] -= 100
    biased[17] += 5
    assert out.token_ids == [int(biased.argmax())]
    allowed = [5, 50, 150, 250]
    out = llm.generate([prompt], SP(temperature=0, max_tokens=4, allowed_token_ids=allowed))[0]
    assert out.token_ids[0] == allowed[int(last[allowed].argmax())] and set(out.token_ids) <= set(allowed)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = random_prompts([30], 320, seed=10)[0]
    a = llm.generate([prompt], SP(temperature=0, max_tokens=5, truncate_prompt_tokens=9))[0]
    b = llm.generate([prompt[-9:]], SP(temperature=0, max_tokens=5))[0]
    assert a.token_ids == b.token_ids
    llm.engine.add_request("t", prompt, SP(max_tokens=1, truncate_prompt_tokens=9))
    assert llm.engine.requests["t"].num_prompt_tokens == 9
    llm.engine.abort_request("t")
    llm.engine.step()
