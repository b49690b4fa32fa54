"""The offline API as vLLM users write it: `from loom import LLM, SamplingParams`, vLLM's prompt forms, and
`RequestOutput.outputs[i]` (CompletionOutput) beside loom's own fields. A tiny random Llama with the default
model's tokenizer; transformers is the oracle for the tokens, the tokenizer's decode for the text."""
from __future__ import annotations

import subprocess
import sys

import pytest

from harness.hf_models import hf_greedy, save_tiny_models

pytestmark = pytest.mark.usefixtures("single_thread_torch")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    out = str(tmp_path_factory.mktemp("offline"))
    return save_tiny_models(out, ["llama"], tokenizer_dir=default_model_dir)["llama"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from loom import LLM

    return LLM(tiny_dir, block_size=16, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=64)


def decode(llm, ids):
    return llm.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def greedy(max_tokens=8, **kw):
    from loom import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_importing_loom_loads_no_torch_until_the_api_is_used():
    code = ("import sys, loom\n"
            "assert 'torch' not in sys.modules, 'import loom loaded torch'\n"
            "assert {'LLM', 'SamplingParams', 'RequestOutput', 'CompletionOutput'} <= set(dir(loom))\n"
            "from loom import LLM, SamplingParams\n"
            "import loom.engine.llm as m, loom.engine.sampling_params as s\n"
            "assert LLM is m.LLM and SamplingParams is s.SamplingParams\n"
            "assert loom.RequestOutput is m.RequestOutput and loom.CompletionOutput is m.CompletionOutput\n"
            "try:\n    loom.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_one_prompt_gives_vllm_shaped_output_with_transformers_tokens(llm, tiny_dir):
    from transformers import AutoModelForCausalLM

    (out,) = llm.generate(PROMPT, greedy())  # one string, one SamplingParams, as vLLM takes them
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert out.prompt == PROMPT and out.prompt_token_ids == ids and out.finished
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), ids, 8)
    (c,) = out.outputs
    assert c.index == 0 and c.token_ids == want and c.token_ids is out.token_ids
    assert c.text == decode(llm, want) == out.text
    assert c.finish_reason == out.finish_reason == "length" and c.finished() and c.stop_reason is None
    assert c.cumulative_logprob is None and c.logprobs is None  # none asked for, as vLLM
    # vLLM's other prompt forms give the same request
    assert llm.generate([{"prompt": PROMPT}], [greedy()])[0].token_ids == want
    by_ids = llm.generate({"prompt_token_ids": ids}, greedy())[0]
    assert by_ids.token_ids == want and by_ids.prompt is None


def test_n_completions_are_outputs_by_index(llm):
    from loom import SamplingParams

    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate([PROMPT, "Once upon a time"], sp)
    assert [o.prompt for o in outs] == [PROMPT, "Once upon a time"]
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1]
        for c, s in zip(out.outputs, out.samples):
            assert c.token_ids is s.token_ids and c.logprobs is s.logprobs and len(c.token_ids) == 6
            assert c.text == s.text == decode(llm, c.token_ids)
            assert [lp.token_id for lp in c.logprobs] == c.token_ids
            assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs), abs=1e-4)
        assert out.outputs[0].token_ids == out.token_ids and out.outputs[0].text == out.text


def test_stop_reason_is_the_stop_token_or_string(llm):
    full = llm.generate(PROMPT, greedy(12))[0]
    ids, text = full.token_ids, full.text
    # the last position whose token is new there: stopping on it ends the output exactly at it
    j = max(i for i, t in enumerate(ids) if t not in ids[:i])
    by_token = llm.generate(PROMPT, greedy(12, stop_token_ids=[ids[j]]))[0].outputs[0]
    assert by_token.token_ids == ids[:j + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", ids[j])
    assert len(text) >= 4, text
    stop = text[2:4]
    by_text = llm.generate(PROMPT, greedy(12, stop=[stop]))[0].outputs[0]
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", stop)
    assert by_text.text == text[:text.index(stop)]


def test_streamed_outputs_carry_their_completion(llm):
    from loom import SamplingParams

    seen = {}
    for out in llm.stream(PROMPT, SamplingParams(n=2, seed=1, max_tokens=4, ignore_eos=True)):
        (c,) = out.outputs
        assert c.index == out.index and c.token_ids is out.token_ids
        seen[c.index] = c.finished()
    assert seen == {0: True, 1: True}


def test_bad_prompts_are_refused_naming_the_argument(llm):
    with pytest.raises(ValueError, match="prompts: a dict prompt takes prompt or prompt_token_ids"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {}}, greedy())
    with pytest.raises(ValueError, match="prompts: a prompt is a string"):
        llm.generate([3.5], greedy())
