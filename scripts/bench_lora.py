#!/usr/bin/env python3
"""Multi-LoRA benchmark: throughput with no LoRA / one adapter / a distinct adapter per request, and
hot-load latency with the inter-token latency of running requests while an adapter loads.

    python scripts/bench_lora.py [--model DIR] [--requests 32] [--prompt-len 64] [--max-tokens 32]
                                 [--rank 16] [--device auto] [--dtype auto] [--json out.json]

Adapters are synthetic PEFT adapters (random A/B, q/k/v/o/gate/up/down) written for the model into a temp
adapter root. Prompts are random token ids; decoding is greedy with ignore_eos, so every request makes
exactly --max-tokens tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(out_dir: str, hf_cfg, seed: int, r: int, targets=ALL) -> str:
    import torch
    from safetensors.torch import save_file

    from loom.lora import LoraModelSpec

    spec = LoraModelSpec.from_hf_config(hf_cfg)
    blocks = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_cfg.num_hidden_layers):
        for proj in targets:
            in_f, out_f = spec.proj_shape(proj)
            pre = f"base_model.model.model.layers.{layer}.{blocks[proj]}.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out_f, r, generator=g) * 0.01
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "bias": "none",
                   "task_type": "CAUSAL_LM"}, f)
    return out_dir


def run_batch(llm, prompts, params, loras):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_names=loras)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    errs = [o.error for o in outs if o.error]
    if errs:
        raise RuntimeError(f"requests failed: {errs[:3]}")
    return ntok / dt, dt, ntok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lora-memory-mb", type=int, default=512)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig

    from loom.engine.llm import LLM
    from loom.engine.sampling_params import SamplingParams

    model = args.model
    if not model:
        from harness.default_model import ensure_default_model

        model = str(ensure_default_model())
    hf_cfg = AutoConfig.from_pretrained(model)
    root = tempfile.mkdtemp(prefix="loom-bench-adapters-")
    n = args.requests
    t0 = time.perf_counter()
    for i in range(n):
        write_adapter(os.path.join(root, f"ad{i}"), hf_cfg, seed=i, r=args.rank)
    write_adapter(os.path.join(root, "hot"), hf_cfg, seed=10_000, r=16)
    print(f"wrote {n + 1} rank-{args.rank} adapters in {time.perf_counter() - t0:.1f}s to {root}", flush=True)

    llm = LLM(model, adapter_roots=[root], device=args.device, dtype=args.dtype, max_lora_rank=max(16, args.rank),
              lora_memory_bytes=args.lora_memory_mb << 20, max_num_seqs=max(n, 8), max_host_adapters=n + 8,
              enable_prefix_caching=False)
    eng, reg = llm.engine, llm.engine.adapters
    print(f"device={eng.runner.device} dtype={eng.runner.dtype} lora pool: {reg.info()}", flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = eng.runner.vocab_size
    prompts = [torch.randint(10, vocab - 10, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    scenarios = {
        "no_lora": [None] * n,
        "one_adapter": ["ad0"] * n,
        "distinct_adapters": [f"ad{i}" for i in range(n)],
    }
    # warm-up: compile/caches, and make every adapter resident (load latency is measured separately)
    run_batch(llm, prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), [None, None])
    run_batch(llm, prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), scenarios["distinct_adapters"])
    results = {}
    for name, loras in scenarios.items():
        best = None
        for _ in range(args.repeats):
            tps, dt, ntok = run_batch(llm, prompts, params, loras)
            best = tps if best is None else max(best, tps)
        results[name] = {"tokens_per_s": round(best, 1)}
        print(f"{name:>18}: {best:8.1f} tok/s  ({n} requests x {args.max_tokens} tokens)", flush=True)
    base = results["no_lora"]["tokens_per_s"]
    for name in ("one_adapter", "distinct_adapters"):
        results[name]["ratio_to_no_lora"] = round(results[name]["tokens_per_s"] / base, 3)
    print(f"ratios to no-LoRA: one adapter {results['one_adapter']['ratio_to_no_lora']}, "
          f"{n} distinct {results['distinct_adapters']['ratio_to_no_lora']}", flush=True)

    # hot load of a rank-16 adapter while requests stream
    long_params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(min(n, 8)):
        eng.add_request(f"stream{i}", prompts[i], long_params, f"ad{i}" if i % 2 else None)
    itl_before, itl_during = [], []

    def step_timed(bucket):
        t = time.perf_counter()
        outs = eng.step()
        if outs:
            bucket.append(time.perf_counter() - t)

    for _ in range(3):  # prefill
        eng.step()
    for _ in range(20):
        step_timed(itl_before)
    t_load = time.perf_counter()
    fut = reg.load("hot", "hot", wait=False)
    while not fut.done():
        step_timed(itl_during)
    host_load_s = time.perf_counter() - t_load
    fut.result()
    ref = reg.acquire("hot")
    t = time.perf_counter()
    ok = reg.activate(ref)
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize()
    activate_s = time.perf_counter() - t
    reg.release(ref)
    # first use of a fresh name through a request (resolve-on-first-use): time to its first token
    write_adapter(os.path.join(root, "hot2"), hf_cfg, seed=20_000, r=16)
    t_req = time.perf_counter()
    eng.add_request("hot2req", prompts[0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), "hot2")
    itl_first_use = []
    first_token_s = None
    while first_token_s is None:
        t = time.perf_counter()
        outs = eng.step()
        if outs:
            itl_first_use.append(time.perf_counter() - t)
        if any(o.request_id == "hot2req" and o.new_token_ids for o in outs):
            first_token_s = time.perf_counter() - t_req
    for i in range(min(n, 8)):
        eng.abort_request(f"stream{i}")
    while eng.has_unfinished_requests():
        eng.step()

    def stats(xs):
        if not xs:
            return {}
        xs = sorted(xs)
        return {"n": len(xs), "p50_ms": round(1000 * statistics.median(xs), 2), "max_ms": round(1000 * xs[-1], 2)}

    results["hot_load"] = {
        "rank": 16,
        "disk_to_host_s": round(host_load_s, 4),
        "activate_host_to_device_s": round(activate_s, 5),
        "activated": ok,
        "first_use_request_time_to_first_token_s": round(first_token_s, 4),
        "itl_before": stats(itl_before),
        "itl_during_load": stats(itl_during),
        "itl_during_first_use": stats(itl_first_use),
    }
    print(json.dumps(results["hot_load"], indent=1), flush=True)
    results["config"] = {"model": model, "device": str(eng.runner.device), "dtype": str(eng.runner.dtype),
                         "requests": n, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rank": args.rank,
                         "torch_threads": torch.get_num_threads()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    reg.close()


if __name__ == "__main__":
    main()
