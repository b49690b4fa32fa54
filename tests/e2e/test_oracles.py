"""Through a real tritonserver, against the real oracles (not loom's own offline engine): streamed greedy output
equals transformers' greedy decoding, and an adapter's streamed output equals PEFT's, token for token."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from harness.lora import peft_greedy
from tests.e2e.conftest import Stream, make_inputs, text_of

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stream(server):
    s = Stream(server)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def oracle(tokenizer, model_dir, adapter_root):
    """adapter -> (prompt ids, HF/PEFT greedy tokens per prompt)."""
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return {a: (prompts, [t for t, _, _ in peft_greedy(model_dir, str(adapter_root / a) if a else None, prompts,
                                                        MAX_TOKENS)])
            for a in (None, "alpha")}


def streamed(stream, inputs) -> tuple[list[int], str, int]:
    """(output token ids, text, number of responses) of one streamed request."""
    results, err = stream.collect(stream.send(inputs))
    assert err is None, err
    ids = [int(t) for r in results for t in np.atleast_1d(r.as_numpy("output_ids"))]
    return ids, text_of(results), len(results)


@pytest.mark.parametrize("adapter", [None, "alpha"])
def test_streamed_greedy_equals_transformers_and_peft(stream, tokenizer, oracle, adapter):
    """input_ids in, output_ids and text out, streamed; the oracle decodes with HF (+ PEFT) by full recompute."""
    prompts, wants = oracle[adapter]
    params = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if adapter:
        params["lora_name"] = adapter
    for ids, want in zip(prompts, wants):
        got, text, n_responses = streamed(stream, make_inputs(None, params, input_ids=ids))
        assert n_responses > 1  # streamed, not one blob
        assert got == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)


def test_text_prompt_streamed_equals_transformers(stream, tokenizer, oracle):
    """text_input in: the server's own tokenization and detokenization against HF's."""
    want = oracle[None][1][0]
    results, err = stream.collect(stream.send(make_inputs(PROMPTS[0], {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                                        "ignore_eos": True})))
    assert err is None, err
    assert text_of(results) == tokenizer.decode(want, skip_special_tokens=True)
