"""The parity check the family tests share: loom's greedy tokens and logprobs against transformers (+ PEFT)."""
from __future__ import annotations

import torch

from harness.hf_models import assert_no_leak, hf_greedy, hf_greedy_logprobs
from loom.engine.sampling_params import SamplingParams
from tests.oracle import assert_float32_close, float64_twin, pooled_scales

GREEDY = dict(temperature=0.0, ignore_eos=True)


def block_bytes(cfg, block_size=16) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


@torch.no_grad()
def float64_logprobs(model64, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each token's log-probability under the float64 model, given the prompt and the tokens before it."""
    lsm = torch.log_softmax(model64(input_ids=torch.tensor([prompt + tokens])).logits[0].double(), -1)
    return [float(lsm[len(prompt) - 1 + j, t]) for j, t in enumerate(tokens)]


def check(llm, model, prompts, max_tokens, lora_names=None, oracle=None):
    """Tokens equal to HF generate (float32); logprobs of the chosen tokens as close to the float64 oracle (the same
    transformers (+ PEFT) model in float64) as float32 arithmetic allows: within tests.oracle.FACTOR of the float32
    oracle's own distance from it, pooled over the prompts that oracle model runs."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY), lora_names=lora_names)
    twins: dict[int, torch.nn.Module] = {}  # one float64 copy per oracle model
    got, ref32, ref64, keys = [], [], [], []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.error is None, o.error
        assert o.finish_reason == "length" and len(o.token_ids) == max_tokens
        ref = oracle(i) if oracle else model
        toks, lps = hf_greedy_logprobs(ref, p, max_tokens)
        if oracle is None:
            assert o.token_ids == hf_greedy(model, p, max_tokens), f"prompt of {len(p)} tokens diverged from generate"
        assert o.token_ids == toks, f"prompt {i} ({len(p)} tokens) diverged"
        if id(ref) not in twins:
            twins[id(ref)] = float64_twin(ref)
        got.append([lp.logprob for lp in o.logprobs])
        ref32.append(lps)
        ref64.append(float64_logprobs(twins[id(ref)], p, toks))
        keys.append(id(ref))
    scales = pooled_scales(ref32, ref64, keys)
    for i, key in enumerate(keys):
        assert_float32_close(got[i], ref64[i], scales[key], f"prompt {i} logprobs")
    assert_no_leak(llm.engine)
    return outs
