"""The parity check the family tests share: loom's greedy tokens and logprobs against transformers (+ PEFT)."""
from __future__ import annotations

import pytest

from harness.hf_models import assert_no_leak, hf_greedy, hf_greedy_logprobs
from loom.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def block_bytes(cfg, block_size=16) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


def check(llm, model, prompts, max_tokens, lora_names=None, oracle=None):
    """Tokens equal to HF generate, logprobs of the chosen tokens within 1e-4 of the oracle's full recompute."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY), lora_names=lora_names)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.error is None, o.error
        assert o.finish_reason == "length" and len(o.token_ids) == max_tokens
        ref = oracle(i) if oracle else model
        toks, lps = hf_greedy_logprobs(ref, p, max_tokens)
        if oracle is None:
            assert o.token_ids == hf_greedy(model, p, max_tokens), f"prompt of {len(p)} tokens diverged from generate"
        assert o.token_ids == toks, f"prompt {i} ({len(p)} tokens) diverged"
        got = [lp.logprob for lp in o.logprobs]
        assert got == pytest.approx(lps, abs=1e-4), f"prompt {i} logprobs"
    assert_no_leak(llm.engine)
    return outs
