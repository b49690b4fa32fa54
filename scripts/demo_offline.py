"""The offline API on the default model: texts plus the engine's counters (prefix-cache hits, preemptions).

    python scripts/demo_offline.py [--kv-blocks 6]

The first question runs alone, so the system prompt's blocks enter the prefix cache; the other five then
run at once and find them there. A deliberately small KV cache (in blocks) makes the scheduler preempt and
later resume requests; their greedy texts equal each request run alone.
"""
from __future__ import annotations

import argparse
import time

from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-blocks", type=int, default=6,
                    help="KV cache size in blocks of 16 tokens (small: forces preemption)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    probe = LLM(kv_cache_memory_bytes=1 << 20)
    per_block = probe.engine.runner.bytes_per_block
    tok = probe.tokenizer
    del probe
    llm = LLM(kv_cache_memory_bytes=args.kv_blocks * per_block)
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
                 "Write a haiku about autumn.", "Why is the sky blue?", "Give me a synonym for happy."]
    system = "You are a concise, friendly assistant who answers in one or two sentences."
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    dt = time.perf_counter() - t0
    for q, o in zip(questions, outs):
        print(f"Q: {q}\nA: {o.text.strip()!r}  [{o.finish_reason}, {len(o.token_ids)} tokens, "
              f"{o.num_cached_tokens} prompt tokens from cache]\n")
    s = llm.engine.stats()
    print(f"{sum(len(o.token_ids) for o in outs)} tokens in {dt:.1f}s; "
          f"KV cache {s.kv_blocks_total} blocks of 16 tokens")
    print(f"prefix cache: {s.prefix_hit_tokens} of {s.prefix_query_tokens} prompt tokens hit "
          f"({s.prefix_hit_rate:.0%}); "
          f"preemptions: {s.num_preemptions}; KV blocks used after the run: {s.kv_blocks_used}")
    solo = [llm.generate([p], params)[0].text for p in prompts]
    same = sum(a == b.text for a, b in zip(solo, outs))
    print(f"each request run alone gives the same text: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
