#!/usr/bin/env python3
"""Weight-only quantized checkpoints against float: decode tokens/s of the default model as float32 and bfloat16
loom and as W8A16 (int8, per output channel, symmetric) and W4A16 (int4, groups of 128, symmetric) compressed-tensors
checkpoints of it (made once, round-to-nearest, by harness/quant_checkpoints.quantize_model_dir, next to the model),
whose linear layers keep their weights quantized (the C++ weight-only GEMM on CPU), in one process.

Batch B: B requests of --prompt-tokens random tokens arrive at once, greedy, --max-tokens new tokens each (EOS
ignored); the decode rate is the tokens of every step after the first (the prefill) over their time. The engines are
built once and measured in alternating rounds (--rounds), the median round reported, and each configuration's rate
divided by bfloat16's and float32's at the same batch (those in --configs) and by its own activations' dense
configuration's (`/ same-dtype dense`: W4A16-bf16 by bfloat16, W8A16-f32 by float32). The quantized checkpoints
run float32 activations (`-f32`) and bfloat16 ones (`-bf16`: the other ops and lm_head, which stays unquantized, in
bfloat16).

A configuration with `/py` appended (W8A16-bf16/py) runs its decoder layers on the Python path (the one-call C++
layer, models/layer_pass.py, off): the same kernels one by one, to measure what the layer pass takes off a step.

    python scripts/bench_quant.py                       # batch 1 and 32, 1 thread
    python scripts/bench_quant.py --threads 2 --batch 1 32 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_engine(model: str, dtype: str, args):
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype=dtype, cpu_threads=args.threads, device=args.device,
                                  kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=max(args.batch)),
                     load_tokenizer=False)


def decode_rate(engine, batch: int, args, seed: int) -> float:
    from loom.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", [rng.randrange(vocab) for _ in range(args.prompt_tokens)], params)
    engine.step()  # the prefill of every request
    g0, t0 = engine.generation_tokens, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
    return (engine.generation_tokens - g0) / (time.perf_counter() - t0)


def same_dtype_dense(config: str) -> str:
    """The dense configuration whose activations a configuration shares: W4A16-bf16 -> bfloat16, W8A16-f32 -> float32
    (a dense one: itself)."""
    config = config.removesuffix("/py")
    if config in ("float32", "bfloat16"):
        return config
    return {"f32": "float32", "bf16": "bfloat16"}[config.split("-")[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF model folder (default: the default model)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU compute threads (0: the cores available)")
    ap.add_argument("--kv-bytes", type=int, default=128 << 20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", nargs="+", default=["float32", "bfloat16", "W8A16-f32", "W8A16-bf16", "W4A16-f32",
                                                     "W4A16-bf16"])
    args = ap.parse_args()
    from loom.engine.worker.cpu import tune_mkl_for_amd

    tune_mkl_for_amd()
    from harness.quant_checkpoints import quantize_model_dir
    from loom.engine.default_model import resolve_default_model

    model = args.model or resolve_default_model()
    paths = {}
    for scheme in ("W8A16", "W4A16"):
        if any(c.startswith(scheme) for c in args.configs):
            t = time.perf_counter()
            paths[scheme] = quantize_model_dir(model, f"{model.rstrip('/')}-{scheme}", scheme)
            print(f"{scheme}: {paths[scheme]} ({time.perf_counter() - t:.1f}s)", flush=True)
    engines = {}
    for c in args.configs:
        name = c.removesuffix("/py")
        if name in ("float32", "bfloat16"):
            engines[c] = make_engine(model, name, args)
        else:
            scheme, act = name.split("-")
            engines[c] = make_engine(paths[scheme], {"f32": "float32", "bf16": "bfloat16"}[act], args)
        if c.endswith("/py"):
            engines[c].runner.model.model.layer_pass = None
    try:
        for e in engines.values():  # warm-up: the first steps of an engine build caches and page its memory in
            decode_rate(e, max(args.batch), args, seed=-1)
        rates = {(c, b): [] for c in engines for b in args.batch}
        for r in range(args.rounds):
            for b in args.batch:
                for c, e in engines.items():
                    rates[c, b].append(decode_rate(e, b, args, seed=r))
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"decode tokens/s, median of {args.rounds} rounds; {args.threads or 'all'} thread(s); "
              f"{args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens a request")
        dense = [c for c in ("bfloat16", "float32") if c in engines]
        print("| config | batch | tokens/s | " + " | ".join(f"/ {d}" for d in dense) + " | / same-dtype dense |")
        print("| --- " * (4 + len(dense)) + "|")
        for b in args.batch:
            for c in engines:
                same = same_dtype_dense(c)
                cols = [med[c, b] / med[d, b] for d in dense] + [med[c, b] / med[same, b] if same in engines else None]
                print(f"| {c} | {b} | {med[c, b]:.1f} | " + " | ".join("" if r is None else f"{r:.2f}x" for r in cols)
                      + " |")
    finally:
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
