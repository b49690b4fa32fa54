#!/usr/bin/env python3
"""vLLM (CPU build) as a benchmark peer: one timed run of a batch of token-id prompts, all submitted at t0.

Run it with the python of a separate venv holding vLLM's CPU build ($LOOM_VLLM_PYTHON), never loom's:

    "$LOOM_VLLM_PYTHON" scripts/vllm_peer.py --job job.json --out result.json

It imports only the stdlib and vllm (nothing from loom), so loom's scripts call it through
scripts/peer_vllm_client.py:run_vllm_peer(), which writes job.json, runs this file and reads result.json.

job.json keys (defaults in brackets):
  model         model directory
  prompts       [[token ids], ...]
  max_tokens    int or one int per prompt; decoding is greedy with ignore_eos, so each makes exactly that many
  threads       ["auto"] VLLM_CPU_OMP_THREADS_BIND: "auto" computes on 1 of 2 cores, "0,1" on both
  kv_cache_gib  [1] VLLM_CPU_KVCACHE_SPACE (unset, vLLM reserves most of RAM)
  dtype ["float32"], block_size [vLLM's], max_model_len [model's], seed [0], warmup [true]
  enable_lora [false], max_lora_rank [16], max_loras [number of adapters, +1 spare when some prompts have
                no adapter: see the comment in main()], adapters {name: path},
  loras         [null or adapter name per prompt]; warmup_loras [false] also loads them in the warm-up
  runs          [one run with `loras`] several timed batches of the same prompts in one engine:
                [{"name", "loras", "repeats" [1]}], the best of the repeats kept; warmup "all" first runs every
                run's batch with 2 tokens (adapters loaded, shapes seen)

result.json: startup_s (engine construction incl. torch.compile), wall_s (t0 to the last final output),
cpu (harness.cpu_meter over the timed part: own = this process tree, other = the rest of the machine),
tokens_per_s (generated tokens / wall_s), requests [{token_ids, latency_s, ttft_s}] (from t0) - of the first
run; runs {name: {wall_s, cpu, tokens_per_s, requests}},
threads, max_loras (as used), vllm_version, env.
"""
import argparse
import asyncio
import json
import os
import sys
import time

from harness.cpu_meter import CpuMeter  # stdlib only (this file's folder is on sys.path)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    return p.parse_args()


async def run_one(engine, rid, prompt_ids, max_tokens, lora, t0):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ttft, final = None, None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, rid,
                                     lora_request=lora):
        if ttft is None and out.outputs[0].token_ids:
            ttft = time.perf_counter() - t0
        final = out  # outputs are cumulative: the last one holds every token
    return {"token_ids": list(final.outputs[0].token_ids),
            "latency_s": time.perf_counter() - t0, "ttft_s": ttft}


def _lora_request(name, ids, adapters):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, ids[name], adapters[name]) if name else None


async def timed_batch(engine, label, prompts, max_tokens, lora_reqs):
    """All prompts at t0; the prefix cache is reset first so nothing of an earlier batch is a cache hit."""
    await engine.reset_prefix_cache()
    with CpuMeter() as meter:  # this process and vLLM's engine-core process, and the rest of the machine
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(run_one(engine, f"{label}-{i}", p, m, lr, t0)
                                      for i, (p, m, lr) in enumerate(zip(prompts, max_tokens, lora_reqs))))
        wall_s = time.perf_counter() - t0
    return {"wall_s": wall_s, "cpu": meter.result, "requests": reqs,
            "tokens_per_s": sum(len(r["token_ids"]) for r in reqs) / wall_s}


async def main(job):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    prompts = job["prompts"]
    n = len(prompts)
    mt = job["max_tokens"]
    max_tokens = [int(mt)] * n if isinstance(mt, int) else [int(m) for m in mt]
    # One int id per adapter name; vLLM caches loaded adapters by that id.
    adapters = job.get("adapters") or {}
    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    runs = job.get("runs") or [{"name": "run", "loras": job.get("loras")}]
    for run in runs:
        run["lora_reqs"] = [_lora_request(name, ids, adapters) for name in (run.get("loras") or [None] * n)]

    kw = dict(model=job["model"], dtype=job.get("dtype", "float32"), seed=job.get("seed", 0),
              disable_log_stats=True)
    for key in ("block_size", "max_model_len"):
        if job.get(key):
            kw[key] = job[key]
    if job.get("enable_lora"):
        max_loras = job.get("max_loras") or max(1, len(adapters))
        if any(r is None for run in runs for r in run["lora_reqs"]):
            # vLLM 0.32 CPU LoRA ops gather weights[-1] for no-LoRA tokens (open PRs vllm#48421/#49656), so a
            # base request batched with LoRA ones gets the LAST slot's adapter. One spare slot that is never
            # filled stays zero (only while slots outnumber adapters); the CPU ops cost the same either way.
            max_loras += 1
            if max_loras <= len(adapters):
                print("vllm_peer: WARNING max_loras < adapters: no-adapter outputs may carry an adapter's delta",
                      file=sys.stderr)
        kw.update(enable_lora=True, max_lora_rank=job.get("max_lora_rank", 16), max_loras=max_loras)

    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    startup_s = time.perf_counter() - t
    results = {}
    try:
        warmup = job.get("warmup", True)
        if warmup == "all":
            # every run's prompts with its adapters, 2 tokens each: adapters loaded, shapes seen (as loom's)
            for run in runs:
                await timed_batch(engine, f"warmup-{run['name']}", prompts, [2] * n, run["lora_reqs"])
        elif warmup:
            # Warm lazy paths (first prefill/decode, sampler); base model only unless asked, so the
            # timed run still pays adapter loads the way a fresh server would.
            wl = job.get("warmup_loras", False)
            lr = runs[0]["lora_reqs"]
            await asyncio.gather(*(run_one(engine, f"warmup-{i}", prompts[i], 4, lr[i] if wl else None,
                                           time.perf_counter()) for i in range(min(2, n))))
        for run in runs:  # the best of `repeats` timed batches
            for rep in range(int(run.get("repeats", 1))):
                r = await timed_batch(engine, f"{run['name']}-{rep}", prompts, max_tokens, run["lora_reqs"])
                if run["name"] not in results or r["tokens_per_s"] > results[run["name"]]["tokens_per_s"]:
                    results[run["name"]] = r
    finally:
        engine.shutdown()  # stops the engine-core process so this one can exit
        del engine  # else its __del__ runs shutdown() again at interpreter exit and logs a TypeError

    first = results[runs[0]["name"]]
    return {"startup_s": startup_s, **first, "runs": results,
            "threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "max_loras": kw.get("max_loras"),
            "vllm_version": vllm.__version__,
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("VLLM_", "OMP_", "MKL_", "KMP_")) or k == "LD_PRELOAD"}}


if __name__ == "__main__":  # required: vLLM starts its engine-core worker by spawn
    args = parse_args()
    with open(args.job) as f:
        job = json.load(f)
    # vLLM reads these at import / engine start, so set them first.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(job.get("threads", "auto"))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job.get("kv_cache_gib", 1))
    result = asyncio.run(main(job))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
