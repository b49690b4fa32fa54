"""Engine behaviour beyond greedy parity: seeds, stops, logprobs, aborts, refusals, faults, no leaks."""
from __future__ import annotations

import pytest

from harness.hf_models import assert_no_leak, make_hf_model, random_prompts
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from tests.oracle import assert_float32_close, float32_error_scale, log_softmax_32_64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, path = make_hf_model("llama", tmp_path_factory.mktemp("m"))
    return model, path


@pytest.fixture()
def llm(tiny):
    return LLM(tiny[1], block_size=16, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=64)


def test_seeded_sampling_independent_of_batch(llm):
    prompt = random_prompts([12], 320, seed=5)[0]
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].token_ids
    others = random_prompts([3, 40, 17, 25], 320, seed=6)
    mix = [SamplingParams(temperature=t, seed=s, max_tokens=m, ignore_eos=True, repetition_penalty=r)
           for t, s, m, r in ((1.0, 1, 5, 1.0), (0.0, None, 30, 1.2), (0.5, 3, 12, 1.0), (1.3, None, 25, 1.1))]
    outs = llm.generate(others[:2] + [prompt] + others[2:], mix[:2] + [p] + mix[2:])
    assert outs[2].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=8, max_tokens=20,
                                                       ignore_eos=True))
    assert other_seed[0].token_ids != alone
    assert_no_leak(llm.engine)


def test_logprobs_match_model_distribution(llm, tiny):
    """The chosen and top logprobs as close to the float64 model as float32 allows (tests/oracle.py); the top ids
    are the float64 model's."""
    model = tiny[0]
    prompt = random_prompts([9], 320, seed=8)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    lsm32, lsm64 = (t[len(prompt) - 1:-1] for t in log_softmax_32_64(model, prompt + out.token_ids))
    assert len(out.logprobs) == 6
    scale = float32_error_scale(lsm32, lsm64)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        top_vals, top_ids = lsm64[i].topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert_float32_close([lp.logprob] + [v for _, v in lp.top], [lsm64[i, lp.token_id].item()] + top_vals.tolist(),
                             scale, f"token {i}")
    # the sum of 6 float32 values, each within the bound: their sum within 6 times it
    assert_float32_close(out.cumulative_logprob, sum(lp.logprob for lp in out.logprobs), 6 * scale, "cumulative")


def test_token_level_stops_and_finish_reasons(llm):
    prompt = random_prompts([10], 320, seed=9)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    # min_tokens suppresses the stop token until reached: generation continues past it
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=first + 2,
                                                stop_token_ids=[stop_tok]))[0]
    assert len(out.token_ids) >= first + 2 and stop_tok not in out.token_ids[:first + 2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == free.token_ids[:3]
    assert_no_leak(llm.engine)


def test_abort_frees_blocks_at_once(llm):
    eng = llm.engine
    for i, p in enumerate(random_prompts([40, 50], 320, seed=10)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    eng.abort_request("r0")
    eng.abort_request("r1")
    assert eng.block_manager.num_used_blocks == 0
    outs = eng.step()
    assert sorted((o.request_id, o.finished, o.finish_reason) for o in outs) == [("r0", True, "abort"),
                                                                                  ("r1", True, "abort")]
    assert_no_leak(eng)


def test_bad_requests_refused_with_field(llm):
    eng = llm.engine
    p = SamplingParams(max_tokens=4)
    cases = [([], "prompt"), ([1] * 2000, "prompt"), ([99999], "prompt")]
    for ids, field in cases:
        with pytest.raises(RequestError) as e:
            eng.add_request("bad", ids, p)
        assert e.value.field == field
    eng.add_request("dup", [1, 2, 3], p)
    with pytest.raises(RequestError) as e:
        eng.add_request("dup", [1, 2, 3], p)
    assert e.value.field == "request_id"
    eng.abort_request("dup")
    eng.step()
    with pytest.raises(RequestError) as e:
        eng.add_request("x", [1, 2], p, lora_name="no-such-adapter")
    assert e.value.field == "lora_name"
    assert_no_leak(eng)


def test_a_refused_prompt_leaves_nothing_of_its_call_behind(llm):
    """LLM.generate with a bad prompt after good ones raises the RequestError naming the field, and the prompts it
    had added before (one of them with n=2) are ended, not left to run into the next call."""
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    two = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=2)
    with pytest.raises(RequestError) as e:
        llm.generate([[5, 6, 7], [8, 9], [99999]], [two, p, p])
    assert e.value.field == "prompt"
    assert_no_leak(llm.engine)
    outs = llm.generate([[5, 6, 7]], p)
    assert len(outs) == 1 and len(outs[0].token_ids) == 4
    assert_no_leak(llm.engine)


def test_prompt_larger_than_whole_cache_refused_up_front(tiny):
    c = tiny[0].config
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    llm = LLM(tiny[1], block_size=16, kv_cache_memory_bytes=2 * per_block)
    with pytest.raises(RequestError, match="KV cache"):
        llm.engine.add_request("big", list(range(3, 60)), SamplingParams(max_tokens=2))
    # a request that fits alone but not with its whole output is capped, not retried forever
    out = llm.generate([list(range(3, 20))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 17


def test_step_fault_fails_only_that_step(llm, monkeypatch):
    eng = llm.engine
    real_run = eng.runner.run
    calls = {"n": 0}

    def flaky(batch, lora):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real_run(batch, lora)

    monkeypatch.setattr(eng.runner, "run", flaky)
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.step()
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert "injected fault" in outs[0].error
    assert_no_leak(eng)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_strings_on_default_model(default_model_dir):
    llm = LLM(default_model_dir, kv_cache_memory_bytes=64 << 20)
    free = llm.generate(["The capital of France is"],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert free.text.startswith(" Paris")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12, stop=["ris"]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:free.text.index("ris")]
    assert_no_leak(llm.engine)
