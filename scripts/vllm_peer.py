#!/usr/bin/env python3
"""vLLM (CPU build) as a benchmark peer: one timed run of a batch of token-id prompts, all submitted at t0.

Run it with the python of the separate vLLM venv (see shared/PEERS.md), never loom's:

    /work/peers/vllm-venv/bin/python scripts/vllm_peer.py --job job.json --out result.json

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

result.json: startup_s (engine construction incl. torch.compile), wall_s (t0 to the last final output),
tokens_per_s (generated tokens / wall_s), requests [{token_ids, latency_s, ttft_s}] (from t0),
threads, max_loras (as used), vllm_version, env.
"""
import argparse
import asyncio
import json
import os
import sys
import time


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


async def main(job):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    prompts = job["prompts"]
    n = len(prompts)
    mt = job["max_tokens"]
    max_tokens = [int(mt)] * n if isinstance(mt, int) else [int(m) for m in mt]
    # One int id per adapter name; vLLM caches loaded adapters by that id.
    adapters = job.get("adapters") or {}
    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    lora_reqs = [LoRARequest(name, ids[name], adapters[name]) if name else None
                 for name in (job.get("loras") or [None] * n)]

    kw = dict(model=job["model"], dtype=job.get("dtype", "float32"), seed=job.get("seed", 0),
              disable_log_stats=True)
    for key in ("block_size", "max_model_len"):
        if job.get(key):
            kw[key] = job[key]
    if job.get("enable_lora"):
        max_loras = job.get("max_loras") or max(1, len(adapters))
        if any(r is None for r in lora_reqs):
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
    try:
        if job.get("warmup", True):
            # Warm lazy paths (first prefill/decode, sampler); base model only unless asked, so the
            # timed run still pays adapter loads the way a fresh server would.
            wl = job.get("warmup_loras", False)
            await asyncio.gather(*(run_one(engine, f"warmup-{i}", prompts[i], 4,
                                           lora_reqs[i] if wl else None, time.perf_counter())
                                   for i in range(min(2, n))))
            await engine.reset_prefix_cache()  # warm-up prompts must not be cache hits below

        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(run_one(engine, f"req-{i}", prompts[i], max_tokens[i], lora_reqs[i], t0)
                                      for i in range(n)))
        wall_s = time.perf_counter() - t0
    finally:
        engine.shutdown()  # stops the engine-core process so this one can exit
        del engine  # else its __del__ runs shutdown() again at interpreter exit and logs a TypeError

    return {"startup_s": startup_s, "wall_s": wall_s,
            "tokens_per_s": sum(len(r["token_ids"]) for r in reqs) / wall_s,
            "requests": reqs, "threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
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
