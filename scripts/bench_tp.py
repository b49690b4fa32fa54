#!/usr/bin/env python3
"""Tensor parallelism, TP=1 against TP=N on one model: tokens/s, mean request latency, and the time each step
spends in collectives on rank 0 (the step broadcast, the all-reduces, the logits gather).

N requests of random prompt tokens arrive at once, greedy, exactly --max-tokens tokens each (EOS ignored); the
engine's steps run in this process (rank 0) until all finish. A request's latency = its finish - t0. Collective
time is rank 0's host time in torch.distributed calls (on CPU the whole transfer and wait; on CUDA the launches,
the transfers run on the stream). On CPU the ranks share the cores: --threads is per rank (0: the cores / ranks).

    python scripts/bench_tp.py                                  # the default model, TP 1 and 2
    python scripts/bench_tp.py --tp 1 2 4 --model DIR --num-prompts 32 --max-tokens 64
"""
from __future__ import annotations

import argparse
import random
import time


def run(model: str, tp: int, args) -> dict:
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, cpu_threads=args.threads,
                                    kv_cache_memory_bytes=args.kv_bytes, device=args.device), load_tokenizer=False)
    try:
        rng = random.Random(0)
        vocab = engine.runner.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.num_prompts)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request("warm-up", prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        group = engine.runner.tp
        c0, n0 = (group.collective_s, group.num_collectives) if group is not None else (0.0, 0)
        g0 = engine.generation_tokens
        done: dict[str, float] = {}
        steps = 0
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    done[out.request_id] = time.perf_counter() - t0
            steps += 1
        wall = time.perf_counter() - t0
        c1, n1 = (group.collective_s, group.num_collectives) if group is not None else (0.0, 0)
        return {"tp": tp, "tokens_s": (engine.generation_tokens - g0) / wall,
                "latency_s": sum(done.values()) / len(done), "steps": steps, "ms_step": wall / steps * 1e3,
                "coll_ms_step": (c1 - c0) / steps * 1e3, "coll_step": (n1 - n0) / steps}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF model folder (default: the default model)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size values (default 1 2)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: the cores / ranks)")
    ap.add_argument("--kv-bytes", type=int, default=256 << 20, help="KV budget per rank (CPU; 0 on CUDA: profiled)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    from loom.engine.worker.cpu import tune_mkl_for_amd

    tune_mkl_for_amd()
    rows = [run(args.model, tp, args) for tp in args.tp]
    print(f"{args.num_prompts} requests x {args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens each, "
          "greedy")
    print("| TP | tokens/s | mean latency (s) | steps | ms/step | collectives ms/step | collectives/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tp']} | {r['tokens_s']:.1f} | {r['latency_s']:.2f} | {r['steps']} | {r['ms_step']:.1f} | "
              f"{r['coll_ms_step']:.2f} | {r['coll_step']:.0f} |")


if __name__ == "__main__":
    main()
