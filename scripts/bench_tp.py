#!/usr/bin/env python3
"""Tensor parallelism, TP=1 against TP=N on one model: tokens/s, mean request latency, and the time each step
spends in collectives on rank 0 (the step broadcast, the all-reduces, the logits gather).

N requests of random prompt tokens arrive at once, greedy, exactly --max-tokens tokens each (EOS ignored); the
engine's steps run in this process (rank 0) until all finish. A request's latency = its finish - t0. Collective
time is rank 0's host time in torch.distributed calls (on CPU the whole transfer and wait; on CUDA the launches,
the transfers run on the stream). On CPU the ranks share the cores: --threads is per rank (0: the cores / ranks).
--adapters N: N random LoRA adapters on every projection, request i on adapter i mod N; each is loaded and made
resident before the timed run (what it then measures is LoRA's cost per step; under TP, each rank's part of it).

    python scripts/bench_tp.py                                  # the default model, TP 1 and 2
    python scripts/bench_tp.py --tp 1 2 4 --model DIR --num-prompts 32 --max-tokens 64
    python scripts/bench_tp.py --adapters 0 4 --lora-rank 16    # without and with 4 adapters, TP 1 and 2
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import types
from pathlib import Path

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model: str, root: str, n: int, rank: int) -> list[str]:
    """n random rank-`rank` adapters of the model on every projection, under root -> their names."""
    from harness.lora import write_raw_adapter
    from loom.engine.default_model import default_model_dir

    cfg = types.SimpleNamespace(**json.loads((Path(model or default_model_dir()) / "config.json").read_text()))
    names = [f"tp-bench-{a}" for a in range(n)]
    for a, name in enumerate(names):
        write_raw_adapter(str(Path(root) / name), cfg, seed=a, r=rank, alpha=2 * rank, target_modules=PROJS)
    return names


def run(model: str, tp: int, adapters: list[str], root: str, args) -> dict:
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, cpu_threads=args.threads,
                                    kv_cache_memory_bytes=args.kv_bytes, device=args.device, adapter_roots=[root],
                                    max_lora_rank=max(16, args.lora_rank)), load_tokenizer=False)
    try:
        rng = random.Random(0)
        vocab = engine.runner.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.num_prompts)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for i, name in enumerate([None] + adapters):  # warm-up; every adapter loaded and written to its rows
            engine.add_request(f"warm-up{i}", prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0,
                                                                              ignore_eos=True), name)
        while engine.has_unfinished_requests():
            engine.step()
        group = engine.runner.tp
        c0, n0 = (group.collective_s, group.num_collectives) if group is not None else (0.0, 0)
        g0 = engine.generation_tokens
        done: dict[str, float] = {}
        steps = 0
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params, adapters[i % len(adapters)] if adapters else None)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    done[out.request_id] = time.perf_counter() - t0
            steps += 1
        wall = time.perf_counter() - t0
        c1, n1 = (group.collective_s, group.num_collectives) if group is not None else (0.0, 0)
        return {"tp": tp, "adapters": len(adapters), "tokens_s": (engine.generation_tokens - g0) / wall,
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
    ap.add_argument("--adapters", type=int, nargs="+", default=[0], help="LoRA adapter counts (default 0)")
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    from loom.engine.worker.cpu import tune_mkl_for_amd

    tune_mkl_for_amd()
    with tempfile.TemporaryDirectory(prefix="loom-bench-tp-") as root:
        names = make_adapters(args.model, root, max(args.adapters), args.lora_rank) if max(args.adapters) else []
        rows = [run(args.model, tp, names[:n], root, args) for n in args.adapters for tp in args.tp]
    print(f"{args.num_prompts} requests x {args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens each, "
          f"greedy; adapters of rank {args.lora_rank} on every projection")
    print("| adapters | TP | tokens/s | mean latency (s) | steps | ms/step | collectives ms/step | collectives/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['adapters']} | {r['tp']} | {r['tokens_s']:.1f} | {r['latency_s']:.2f} | {r['steps']} | "
              f"{r['ms_step']:.1f} | {r['coll_ms_step']:.2f} | {r['coll_step']:.0f} |")


if __name__ == "__main__":
    main()
