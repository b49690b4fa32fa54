#!/usr/bin/env python3
"""vLLM (CPU build) as a benchmark peer: one timed run of a batch of token-id prompts, all submitted at t0. Both sides
live in this file: the run, in vLLM's venv, and the call, from loom's.

The run: this file, with the python of a separate venv holding vLLM's CPU build ($LOOM_VLLM_PYTHON), never loom's:

    "$LOOM_VLLM_PYTHON" scripts/harness/vllm_peer.py --job job.json --out result.json

It imports only the stdlib and vllm (nothing from loom; harness/cpu_meter.py, stdlib only, from its own folder).

The call, in loom's scripts (stdlib only too):

    from harness.vllm_peer import run_vllm_peer
    res = run_vllm_peer(os.environ["LOOM_VLLM_PYTHON"], job, timeout_s=900)

writes job.json, runs this file and reads result.json. The benchmark scripts take the venv with --vllm-python (or
LOOM_VLLM_PYTHON, `add_vllm_arguments`) and run one job per thread setting (`run_vllm_settings`).

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
  runs          [one run with `loras`] several timed batches in one engine: [{"name", "loras", "repeats" [1],
                "prompts" [the job's], "max_tokens" [the job's], "sequential" [false: all at t0; true: one
                request after another], "arrivals" [null, else seconds from t0 per request: Poisson traffic,
                latencies from each arrival], "warm" [null, else {"prompts", "loras", "max_tokens" [1]}: a batch
                run untimed before the run, its adapters loaded as the traffic before it would have]}], the best
                of the repeats kept; warmup "all" first runs every run's batch with 2 tokens (adapters loaded,
                shapes seen)
  max_cpu_loras [vLLM's default] adapters its CPU cache holds (with enable_lora)
  speculative_config [null] vLLM's speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}

result.json: startup_s (engine construction incl. torch.compile), wall_s (t0 to the last final output),
cpu (harness.cpu_meter over the timed part: own = this process tree, other = the rest of the machine),
tokens_per_s (generated tokens / wall_s), requests [{token_ids, latency_s, ttft_s}] (from t0) - of the first
run; runs {name: {wall_s, cpu, tokens_per_s, requests}},
threads, max_loras (as used), vllm_version, env.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

if __package__:  # imported as harness.vllm_peer (loom's side)
    from harness.cpu_meter import CpuMeter
else:  # run as a file by vLLM's python (and re-imported by its spawned engine core): this folder is on sys.path
    from cpu_meter import CpuMeter

PEER = Path(__file__).resolve()


# ---- the run, in vLLM's venv ---------------------------------------------------------------------------------

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


async def arrive(engine, rid, prompt_ids, max_tokens, lora, t0, at):
    """run_one for a request that arrives `at` seconds after t0: its latencies from its arrival."""
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    return await run_one(engine, rid, prompt_ids, max_tokens, lora, t0 + at) | {"arrival_s": at}


async def timed_batch(engine, label, prompts, max_tokens, lora_reqs, sequential=False, arrivals=None):
    """All prompts at t0 (or one after another: latencies from each request's own start; or each at its time in
    `arrivals`, seconds from t0: latencies from its arrival); the prefix cache is reset first so nothing of an
    earlier batch is a cache hit."""
    await engine.reset_prefix_cache()
    items = list(enumerate(zip(prompts, max_tokens, lora_reqs)))
    with CpuMeter() as meter:  # this process and vLLM's engine-core process, and the rest of the machine
        t0 = time.perf_counter()
        if sequential:
            reqs = [await run_one(engine, f"{label}-{i}", p, m, lr, time.perf_counter()) for i, (p, m, lr) in items]
        elif arrivals is not None:
            reqs = await asyncio.gather(*(arrive(engine, f"{label}-{i}", p, m, lr, t0, arrivals[i])
                                          for i, (p, m, lr) in items))
        else:
            reqs = await asyncio.gather(*(run_one(engine, f"{label}-{i}", p, m, lr, t0) for i, (p, m, lr) in items))
        wall_s = time.perf_counter() - t0
    return {"wall_s": wall_s, "cpu": meter.result, "requests": reqs,
            "tokens_per_s": sum(len(r["token_ids"]) for r in reqs) / wall_s}


def _cpu_isa(kw: dict, model: str) -> str:
    """What vLLM's CPU build dispatches to here: its paged attention's ISA (amx / vec / vec16 ...; its own choice,
    v1/attention/backends/cpu_attn.py) and the 16-bit units torch sees (oneDNN's matmuls use them)."""
    try:
        import torch
        from transformers import AutoConfig
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cfg = AutoConfig.from_pretrained(model)
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = getattr(torch, kw.get("dtype", "float32"))
        isa = _get_attn_isa(dtype, int(kw.get("block_size") or 128), head)
        units = [n for n, f in (("amx", "_is_amx_tile_supported"), ("avx512", "_is_avx512_supported"),
                                ("avx512_bf16", "_is_avx512_bf16_supported")) if getattr(torch.cpu, f, lambda: 0)()]
        return f"attention ISA {isa}; torch sees {', '.join(units) or 'none of amx/avx512'}"
    except Exception as e:  # noqa: BLE001 - a private function of vLLM's: report, never fail the run
        return f"unknown ({type(e).__name__})"


async def main(job):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    prompts = job["prompts"]
    n = len(prompts)
    mt = job["max_tokens"]
    # One int id per adapter name; vLLM caches loaded adapters by that id.
    adapters = job.get("adapters") or {}
    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    runs = job.get("runs") or [{"name": "run", "loras": job.get("loras")}]
    for run in runs:
        run_n = len(run.get("prompts") or prompts)
        run["lora_reqs"] = [_lora_request(name, ids, adapters) for name in (run.get("loras") or [None] * run_n)]
        rmt = run.get("max_tokens", mt)
        run["max_tokens_list"] = [int(rmt)] * run_n if isinstance(rmt, int) else [int(m) for m in rmt]
        if run.get("warm"):
            run["warm"]["lora_reqs"] = [_lora_request(name, ids, adapters) for name in run["warm"]["loras"]]

    kw = dict(model=job["model"], dtype=job.get("dtype", "float32"), seed=job.get("seed", 0),
              disable_log_stats=True)
    for key in ("block_size", "max_model_len", "speculative_config"):
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
        if job.get("max_cpu_loras"):
            kw["max_cpu_loras"] = max(max_loras, int(job["max_cpu_loras"]))

    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    startup_s = time.perf_counter() - t
    results = {}
    try:
        warmup = job.get("warmup", True)
        if warmup == "all":
            # every run's prompts with its adapters, 2 tokens each: adapters loaded, shapes seen (as loom's)
            for run in runs:
                rp = run.get("prompts") or prompts
                await timed_batch(engine, f"warmup-{run['name']}", rp, [2] * len(rp), run["lora_reqs"])
        elif warmup:
            # Warm lazy paths (first prefill/decode, sampler); base model only unless asked, so the
            # timed run still pays adapter loads the way a fresh server would.
            wl = job.get("warmup_loras", False)
            lr = runs[0]["lora_reqs"]
            await asyncio.gather(*(run_one(engine, f"warmup-{i}", prompts[i], 4, lr[i] if wl else None,
                                           time.perf_counter()) for i in range(min(2, n))))
        for run in runs:  # the best of `repeats` timed batches
            warm = run.get("warm")
            if warm:  # untimed: the traffic a server served before the run
                await timed_batch(engine, f"warm-{run['name']}", warm["prompts"],
                                  [int(warm.get("max_tokens", 1))] * len(warm["prompts"]), warm["lora_reqs"])
            for rep in range(int(run.get("repeats", 1))):
                r = await timed_batch(engine, f"{run['name']}-{rep}", run.get("prompts") or prompts,
                                      run["max_tokens_list"], run["lora_reqs"], bool(run.get("sequential")),
                                      run.get("arrivals"))
                if run["name"] not in results or r["tokens_per_s"] > results[run["name"]]["tokens_per_s"]:
                    results[run["name"]] = r
    finally:
        engine.shutdown()  # stops the engine-core process so this one can exit
        del engine  # else its __del__ runs shutdown() again at interpreter exit and logs a TypeError

    first = results[runs[0]["name"]]
    return {"startup_s": startup_s, **first, "runs": results, "cpu_isa": _cpu_isa(kw, job["model"]),
            "threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "max_loras": kw.get("max_loras"),
            "vllm_version": vllm.__version__,
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("VLLM_", "OMP_", "MKL_", "KMP_")) or k == "LD_PRELOAD"}}



# ---- the call, from loom's venv -----------------------------------------------------------------------------

def run_vllm_peer(vllm_python: str, job: dict, timeout_s: float, env: dict | None = None) -> dict:
    """Run one vLLM peer job in a subprocess and return its parsed result.json.

    env: extra environment variables (e.g. LD_PRELOAD for tcmalloc). Raises RuntimeError with the tail of
    the peer's output when it fails or runs past timeout_s.
    """
    with tempfile.TemporaryDirectory(prefix="vllm_peer_") as tmp:
        job_path, out_path, log_path = (os.path.join(tmp, n) for n in ("job.json", "result.json", "log.txt"))
        with open(job_path, "w") as f:
            json.dump(job, f)
        with open(log_path, "w") as log:
            # Own session, so a timeout can kill the engine-core process vLLM spawns too. Working folder: the
            # temporary one - vLLM inspects models in `python -m` subprocesses, which put their working folder on
            # sys.path, and from this repository's root transformers then imports our kernels/ as its optional
            # `kernels` package (vLLM 0.32 with transformers 5.19: "No module named 'loom'", every model refused).
            proc = subprocess.Popen([vllm_python, str(PEER), "--job", job_path, "--out", out_path],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp,
                                    env={**os.environ, **(env or {})})
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"timeout after {timeout_s:.0f}s"
        if rc != 0 or not os.path.exists(out_path):
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"vLLM peer failed ({rc}); last output:\n{tail}")
        with open(out_path) as f:
            return json.load(f)


# ---- what the benchmark scripts share ---------------------------------------------------------------

def add_vllm_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--vllm-python", default=os.environ.get("LOOM_VLLM_PYTHON", ""),
                    help="python of a venv with vLLM's CPU build (env LOOM_VLLM_PYTHON); empty = no vLLM peer")
    ap.add_argument("--vllm-threads", nargs="+", default=["auto", "0,1"],
                    help="VLLM_CPU_OMP_THREADS_BIND settings to try, the faster is reported as vLLM (auto: compute "
                         "on one core, its engine-core busy-polls the other; 0,1: compute on both)")
    ap.add_argument("--vllm-preload", default=os.environ.get("LOOM_VLLM_PRELOAD", ""),
                    help="LD_PRELOAD for vLLM (tcmalloc and the venv's libiomp5.so, as vLLM recommends; env "
                         "LOOM_VLLM_PRELOAD)")
    ap.add_argument("--vllm-timeout", type=float, default=2400.0, help="seconds one vLLM run may take (start incl.)")


def run_vllm_settings(args, job: dict, progress: Callable[[str], None], label: str = "vllm") -> dict[str, dict]:
    """One peer run per --vllm-threads setting: {"<label> <threads>": result or {"error": ...}}."""
    env = {"LD_PRELOAD": args.vllm_preload} if args.vllm_preload else {}
    out = {}
    for threads in args.vllm_threads:
        name = f"{label} {threads}"
        progress(f"{name}: starting (compiles its model at every start: minutes)")
        t = time.perf_counter()
        try:
            res = run_vllm_peer(args.vllm_python, {**job, "threads": threads}, args.vllm_timeout, env)
        except RuntimeError as e:
            progress(f"{name} FAILED: {e}")
            out[name] = {"error": str(e)}
            continue
        res["process_s"] = time.perf_counter() - t
        progress(f"{name}: start-up {res['startup_s']:.1f}s, {res['tokens_per_s']:.1f} tok/s")
        out[name] = res
    return out


def best(results: dict[str, dict]) -> str | None:
    """The name of the fastest successful run (tokens/s)."""
    ok = {k: v for k, v in results.items() if "error" not in v}
    return max(ok, key=lambda k: ok[k]["tokens_per_s"]) if ok else None


def compute_threads(setting: str) -> int:
    """The compute threads of a VLLM_CPU_OMP_THREADS_BIND setting: "auto" leaves one of the cores this process
    may use to vLLM's engine core (as measured here: compute on one of two cores), a list such as "0,1" or "0-3"
    computes on each CPU it names. For comparisons at equal compute."""
    if setting == "auto":
        return max(1, len(os.sched_getaffinity(0)) - 1)
    n = 0
    for part in setting.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


def setting_name(results: dict[str, dict], threads: int) -> str | None:
    """The name of the successful run ("<label> <setting>") whose setting computes on `threads` threads."""
    ok = [k for k, v in results.items() if "error" not in v]
    return next((k for k in ok if compute_threads(k.rsplit(" ", 1)[-1]) == threads), None)


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
