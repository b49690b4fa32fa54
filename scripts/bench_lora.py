#!/usr/bin/env python3
"""Multi-LoRA benchmark: tokens/s with no LoRA / one adapter / a distinct adapter per request, loom against
vLLM's CPU build on the same adapters, prompts and tokens; then hot-load latency and the inter-token latency
of running requests while an adapter loads (loom only).

    python scripts/bench_lora.py --threads 1 2 --vllm-python /path/to/vllm-venv/bin/python \\
        --vllm-preload "$TCMALLOC:$VENV/lib/libiomp5.so"
    python scripts/bench_lora.py [--model DIR] [--requests 32] [--prompt-len 64] [--max-tokens 32] [--rank 16]
                                 [--threads 1 [2]] [--compile eager|compiled] [--json out.json] [--no-hot-load]
                                 [--adapter-dtype float32|bfloat16|float16]

Adapters are synthetic PEFT adapters (random A/B on q/k/v/o/gate/up/down, saved as --adapter-dtype: float32 is the
published protocol; bfloat16 is what many fine-tuning runs save, and loom then keeps them in bfloat16 pools,
lora_dtype) written for the model into a temp adapter root; vLLM loads the same folders. Prompts are random token
ids; decoding is greedy with ignore_eos, so every request makes exactly --max-tokens tokens. Each scenario is the
best of --repeats timed batches after a warm-up that ran every scenario once with 2 tokens (adapters loaded, shapes
seen), for both systems; loom runs its scenarios round by round (none, one, distinct, then again) and also prints
the ratios within each round, which a slow minute of a shared machine moves less than it moves best-of figures taken
minutes apart. With several --threads, loom runs once per thread count (a new engine each) and each is also set
against the vLLM setting that computes on as many threads (equal compute). vLLM's no-LoRA figure is its plain engine
(compiled, as a user without adapters runs it); its adapter rows are an engine with enable_lora (eager, as vLLM runs
LoRA on CPU) with max_loras = the adapters + 1 spare slot (vLLM 0.32's CPU LoRA gives base requests batched with
adapters the last slot's adapter, vllm#48421: the spare, never filled, keeps them clean; only the no-LoRA run of
that engine has base requests). After its rounds each loom engine measures the streaming read rate on its threads,
and the report prints the best distinct / no-LoRA ratio that rate allows when every request reads its own adapter's
rows once per decode step (harness/adapter_cost.py): how far the distinct run is from what memory bandwidth permits
on this machine.

Many adapters under traffic (--adapters N; with --vllm-python, vLLM too):

    python scripts/bench_lora.py --adapters 1000 --popularity zipf:1.0 uniform [--device-adapters 64]
                                 [--host-adapters 256] [--arrivals 192] [--load 0.9] [--weight-files 16]
                                 [--shift-at 0.5 [--window-s 2]]

N rank-16 adapters (names ad0 .. ad{N-1}, ad0 the most popular) whose weights are --weight-files distinct random files
hard-linked into the N folders (1000 distinct files of the default model would be ~20 GB; the engine reads each name
as its own adapter, but a read from disk is then mostly a read from the page cache). The device pools hold
--device-adapters of them (lora_memory_bytes set so), the host tier --host-adapters. One engine: a closed batch on
one adapter measures its tokens/s; Poisson arrivals at --load times that rate then run once on one adapter and once
per --popularity over the N (adapters unloaded between runs, so each starts cold; with --warm N, after N one-token
requests from its popularity, as a server that has served that traffic), the same arrivals, prompts and tokens.
Printed: tokens/s against the one-adapter run, queue time (steps, ms) by popularity decile, the largest excess over
the scheduler's stated bound (harness.lora.admission_bound), time to first token by the tier the
adapter was in when its request arrived, load latencies per tier, the rank rows each run's steps read (and the time
reading them takes at the streaming rate measured here) and its loader process's CPU time, and step time (the running
streams' inter-token latency) with and without a read from disk in flight, set against steps of about the same
batch. --shift-at F moves the popularity to other adapters from request F x --arrivals on (adapter k's share goes
to k + N/2: a hot set nobody used before) and prints, per run, the median
token rate in --window-s windows before the shift, the lowest window after it, and the seconds until every later
window is back at >= 0.9x that median (harness.lora.recovery_s). With --vllm-python, vLLM's CPU build then runs the same
requests at the same arrival times, run by run, each run's adapters in one engine per --vllm-threads setting with
max_loras = --device-adapters and max_cpu_loras = --host-adapters (warmed on the base model only, so its runs start
cold too): its tokens/s, its ratio to its own one-adapter run and its time to first token (from arrival, as loom's
queue ms) by popularity decile.

Loading beside running streams (--load-during ROUNDS; loom only):

    python scripts/bench_lora.py --load-during 10 [--requests 32] [--steady-steps 6] [--loaders 4611686018427387904 0]

The running streams' inter-token latency (p50 / p99) before, during adapter loads and during first use of an adapter
read from disk, against the 5% target, per loader (harness/lora_load_during.py)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import harness.bench as bc  # noqa: F401  (CPU tuning before torch)
from harness.adapter_cost import lora_cost, model_spec, stream_gbps
from harness.cpu_meter import CpuMeter
from harness.lora_report import report, traffic_report
from harness.vllm_peer import add_vllm_arguments, run_vllm_settings

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(out_dir: str, hf_cfg, seed: int, r: int, targets=ALL, dtype: str = "float32") -> str:
    """A random rank-r adapter on `targets`, alpha 2r, A ~ N(0, 1 / in_features), B ~ N(0, 0.01^2)."""
    import torch

    from harness.lora import write_raw_adapter

    return write_raw_adapter(out_dir, hf_cfg, seed, r, alpha=2 * r, target_modules=targets, dtype=getattr(torch, dtype),
                             b_scale=0.01 * r ** 0.5)


def run_batch(llm, prompts, params, loras) -> dict:
    eng, steps, started = llm.engine, [], set()
    step = eng.step

    def timed_step():  # (seconds, whether a request had no token yet when the step began: a prefill step)
        t = time.perf_counter()
        outs = step()
        steps.append((time.perf_counter() - t, len(started) < len(prompts)))
        started.update(o.request_id for o in outs if o.new_token_ids)
        return outs

    eng.step = timed_step
    try:
        with CpuMeter() as meter:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_names=loras)
            dt = time.perf_counter() - t0
    finally:
        del eng.step
    errs = [o.error for o in outs if o.error]
    if errs:
        raise RuntimeError(f"requests failed: {errs[:3]}")
    tokens = [list(o.token_ids) for o in outs]
    return {"tokens_per_s": sum(map(len, tokens)) / dt, "wall_s": dt, "tokens": tokens, "cpu": meter.result,
            "steps": phase_times(steps)}


def phase_times(steps: list[tuple[float, bool]]) -> dict:
    """A batch's step times by phase: the prefill steps' total (steps that began with a request still without a
    token) and the decode steps' median, in ms."""
    pre = [s for s, p in steps if p]
    dec = [s for s, p in steps if not p]
    return {"prefill_ms": 1000 * sum(pre), "prefill_steps": len(pre),
            "decode_ms": 1000 * statistics.median(dec) if dec else None, "decode_steps": len(dec)}


def cpu_share(args) -> float:
    """EngineConfig.lora_load_cpu_share for this run (--load-cpu-share, else the default)."""
    from loom.engine.config import EngineConfig

    return EngineConfig.lora_load_cpu_share if args.load_cpu_share is None else args.load_cpu_share


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="loom's compute threads; several: one loom run per count")
    ap.add_argument("--compile", default="eager", choices=("eager", "compiled"), help="loom's CPU forward")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto",
                    help="the model's dtype: loom's EngineConfig.dtype; vLLM computes in what loom resolved it to")
    ap.add_argument("--adapter-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the adapter files' dtype; loom keeps them in pools of that type (lora_dtype), vLLM converts "
                         "them to the model's dtype")
    ap.add_argument("--lora-memory-mb", type=int, default=1024,
                    help="loom's adapter pool; must hold every adapter of the run at once, as vLLM's max_loras does")
    ap.add_argument("--no-hot-load", action="store_true", help="skip the hot-load measurement")
    ap.add_argument("--adapters", type=int, default=0,
                    help="N > 0: the many-adapter traffic benchmark over N adapters instead of the scenarios above")
    ap.add_argument("--popularity", nargs="+", default=["zipf:1.0"], help="uniform or zipf:A; one run each")
    ap.add_argument("--device-adapters", type=int, default=64, help="adapters the device pools hold")
    ap.add_argument("--host-adapters", type=int, default=256, help="max_host_adapters")
    ap.add_argument("--arrivals", type=int, default=192, help="requests of each traffic run")
    ap.add_argument("--load", type=float, default=0.9, help="arrival rate / the one-adapter closed batch's rate")
    ap.add_argument("--weight-files", type=int, default=16, help="distinct weight files behind the N adapters")
    ap.add_argument("--shift-at", type=float, default=0.0, metavar="F",
                    help="--adapters: from request F x --arrivals on, the popularity moves to other adapters (a new "
                         "hot set; 0 = no shift); the report prints how long throughput takes to recover")
    ap.add_argument("--window-s", type=float, default=2.0, help="--shift-at: the throughput window, seconds")
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="--adapters: before each popularity run, N one-token requests drawn from its popularity (as "
                         "before any shift; untimed): the run then starts with the host tier and device rows a "
                         "server that has served that traffic holds, instead of cold (with --vllm-python, vLLM "
                         "runs the same requests before its run)")
    ap.add_argument("--max-lora-wait-steps", type=int, default=None, help="EngineConfig's (default: its default)")
    ap.add_argument("--load-cpu-share", type=float, default=None,
                    help="--adapters / --load-during: EngineConfig.lora_load_cpu_share (default: its default)")
    ap.add_argument("--load-during", type=int, default=0, metavar="ROUNDS",
                    help="ROUNDS > 0: the inter-token latency of --requests running streams while adapters load "
                         "(harness/lora_load_during.py) instead of the scenarios above")
    ap.add_argument("--steady-steps", type=int, default=6, help="--load-during: plain decode steps per round")
    ap.add_argument("--loaders", nargs="+", default=[str(1 << 62), "0"],
                    help="--load-during: lora_load_process_min_bytes of each engine (the default runs the loader "
                         "thread, then the loader process)")
    ap.add_argument("--json", default="")
    add_vllm_arguments(ap)
    return ap.parse_args(argv)


def run_vllm(args, model: str, root: str, dtype: str, prompts, scenarios: dict) -> dict:
    """{scenario: best result over the thread settings, with "setting"}, and every run under "_all"; vLLM computes in
    `dtype`, loom's."""
    base_job = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens, "dtype": dtype,
                "kv_cache_gib": 1, "warmup": "all"}
    adapters = {f"ad{i}": os.path.join(root, f"ad{i}") for i in range(args.requests)}
    plain = run_vllm_settings(args, {**base_job, "runs": [{"name": "no_lora", "repeats": args.repeats}]},
                              bc.progress, "vllm plain")
    lora_job = {**base_job, "enable_lora": True, "adapters": adapters, "max_lora_rank": max(16, args.rank),
                "max_loras": args.requests,
                "runs": [{"name": name, "loras": scenarios[name], "repeats": args.repeats}
                         for name in ("one_adapter", "distinct_adapters", "no_lora")]}
    lora = run_vllm_settings(args, lora_job, bc.progress, "vllm lora")
    out: dict = {"_all": {**plain, **lora}}

    def pick(results: dict, run: str, key: str) -> None:
        ok = {k: v for k, v in results.items() if "error" not in v}
        if ok:
            name = max(ok, key=lambda k: ok[k]["runs"][run]["tokens_per_s"])
            r = ok[name]["runs"][run]
            out[key] = {"tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"], "cpu": r["cpu"], "setting": name,
                        "tokens": [q["token_ids"] for q in r["requests"]], "startup_s": ok[name]["startup_s"],
                        "max_loras": ok[name].get("max_loras"), "vllm_version": ok[name].get("vllm_version")}

    pick(plain, "no_lora", "no_lora")
    pick(lora, "one_adapter", "one_adapter")
    pick(lora, "distinct_adapters", "distinct_adapters")
    pick(lora, "no_lora", "no_lora_lora_engine")
    # each thread setting on its own (its plain engine for no LoRA, its LoRA engine for the adapter rows)
    out["_per_setting"] = {}
    for s in args.vllm_threads:
        p, q = plain.get(f"vllm plain {s}", {}), lora.get(f"vllm lora {s}", {})
        if "error" in p or "error" in q or not p or not q:
            continue
        out["_per_setting"][s] = {
            sc: {"tokens_per_s": src["runs"][sc]["tokens_per_s"], "cpu": src["runs"][sc]["cpu"],
                 "tokens": [r["token_ids"] for r in src["runs"][sc]["requests"]]}
            for sc, src in (("no_lora", p), ("one_adapter", q), ("distinct_adapters", q))}
    return out


def hot_load(args, llm, root, hf_cfg, prompts) -> dict:
    import torch

    from loom.engine.sampling_params import SamplingParams

    eng, reg, n = llm.engine, llm.engine.adapters, args.requests
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
    write_adapter(os.path.join(root, "hot2"), hf_cfg, seed=20_000, r=16, dtype=args.adapter_dtype)
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

    return {"rank": 16, "disk_to_host_s": round(host_load_s, 4), "activate_host_to_device_s": round(activate_s, 5),
            "activated": ok, "first_use_request_time_to_first_token_s": round(first_token_s, 4),
            "itl_before": stats(itl_before), "itl_during_load": stats(itl_during),
            "itl_during_first_use": stats(itl_first_use)}


def main(argv=None) -> None:
    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="loom-bench-adapters-")
    try:
        (traffic if args.adapters else load_during if args.load_during else bench)(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 33 rank-16 adapters of the default model are ~600 MB


def run_loom(args, model: str, root: str, hf_cfg, prompts, threads: int, hot: bool) -> tuple[dict, dict | None]:
    """loom with `threads` compute threads: warm-up, then the scenarios round by round; -> (results, hot load)."""
    import torch

    from loom.engine.llm import LLM
    from loom.engine.sampling_params import SamplingParams

    n = args.requests
    t0 = time.perf_counter()
    llm = LLM(model, adapter_roots=[root], device=args.device, dtype=args.dtype, max_lora_rank=max(16, args.rank),
              lora_memory_bytes=args.lora_memory_mb << 20, max_num_seqs=max(n, 8), max_host_adapters=n + 8,
              lora_dtype="auto" if args.adapter_dtype == "float32" else args.adapter_dtype,
              enable_prefix_caching=False, cpu_threads=threads, cpu_compile=args.compile == "compiled")
    startup = time.perf_counter() - t0
    eng, reg = llm.engine, llm.engine.adapters
    if reg.info()["capacity_rows"] < (n + 1) * args.rank:  # else the distinct run waits for adapter rows, not compute
        raise SystemExit(f"--lora-memory-mb {args.lora_memory_mb} holds {reg.info()['capacity_rows']} rank rows, "
                         f"fewer than the {n + 1} rank-{args.rank} adapters of the run: raise it")
    bc.progress(f"loom: device={eng.runner.device} dtype={eng.runner.dtype} {torch.get_num_threads()} threads, "
                f"start-up {startup:.1f}s, lora pool: {reg.info()}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    scenarios = scenario_loras(n)
    # warm-up: every scenario once with 2 tokens (every adapter resident: load latency is measured separately)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for loras in scenarios.values():
        run_batch(llm, prompts, warm, loras)
    loom: dict = {"startup_s": startup, "torch_threads": torch.get_num_threads(), "rounds": [],
                  "dtype": str(eng.runner.dtype).removeprefix("torch.")}
    for k in range(args.repeats):  # the scenarios round by round: a slow minute of the machine hits all of a round
        tps = {}
        for name, loras in scenarios.items():
            r = run_batch(llm, prompts, params, loras)
            tps[name] = r["tokens_per_s"]
            if name not in loom or r["tokens_per_s"] > loom[name]["tokens_per_s"]:
                loom[name] = r
        loom["rounds"].append(tps)
        bc.progress(f"loom {threads}t round {k + 1}: " + ", ".join(f"{n} {v:.1f}" for n, v in tps.items()) + " tok/s")
    loom["stream_gb_s"] = stream_gbps()  # what reading the adapters' rows can reach on the engine's threads
    load = None
    if hot:
        load = hot_load(args, llm, root, hf_cfg, prompts)
        bc.progress(f"hot load: {json.dumps(load)}")
    reg.close()
    return loom, load


def scenario_loras(n: int) -> dict[str, list]:
    return {"no_lora": [None] * n, "one_adapter": ["ad0"] * n, "distinct_adapters": [f"ad{i}" for i in range(n)]}


def bench(args, root: str) -> None:
    """Writes the adapters into root, runs loom (and vLLM when asked), prints the report."""
    import torch
    from transformers import AutoConfig

    model = args.model or bc.default_model_dir()
    hf_cfg = AutoConfig.from_pretrained(model)
    n = args.requests
    t0 = time.perf_counter()
    for i in range(n):
        write_adapter(os.path.join(root, f"ad{i}"), hf_cfg, seed=i, r=args.rank, dtype=args.adapter_dtype)
    write_adapter(os.path.join(root, "hot"), hf_cfg, seed=10_000, r=16, dtype=args.adapter_dtype)
    bc.progress(f"wrote {n + 1} rank-{args.rank} adapters in {time.perf_counter() - t0:.1f}s to {root}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, hf_cfg.vocab_size - 10, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    # one adapter's rows, every layer: what each request of the distinct run reads once per decode step
    results: dict = {"loom": {}, "adapter_bytes": lora_cost(model_spec(hf_cfg.to_dict()), 1, args.rank,
                                                            getattr(torch, args.adapter_dtype))[2]}
    for i, threads in enumerate(dict.fromkeys(args.threads)):  # the hot load once, with the first engine
        results["loom"][str(threads)], load = run_loom(args, model, root, hf_cfg, prompts, threads,
                                                       hot=i == 0 and not args.no_hot_load)
        if load is not None:
            results["hot_load"] = load
    if args.vllm_python:
        dtype = next(iter(results["loom"].values()))["dtype"]  # every loom engine resolves the same --dtype
        results["vllm"] = run_vllm(args, model, root, dtype, prompts, scenario_loras(n))
    text = report(results, args)
    print(text, flush=True)
    if "hot_load" in results:
        print("hot load (loom):", json.dumps(results["hot_load"], indent=1), flush=True)
    results["report"] = text
    results["config"] = vars(args) | {"model": model}
    results["machine"] = bc.machine_info()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def load_during(args, root: str) -> None:
    """--load-during (harness/lora_load_during.py): step times while adapters load, per loader, and the targets."""
    from transformers import AutoConfig

    from harness import lora_load_during as ld

    model = args.model or bc.default_model_dir()
    res = ld.load_during(args, root, AutoConfig.from_pretrained(model), model, write_adapter, cpu_share(args))
    text = ld.report(res, args)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res | {"report": text, "config": vars(args) | {"model": model}, "machine": bc.machine_info()}, f)


def write_many_adapters(args, root: str, hf_cfg) -> list[str]:
    """ad0 .. ad{N-1}: each its own folder and config, its weights a hard link to one of --weight-files files."""
    files = [write_adapter(os.path.join(root, "_weights", f"w{j}"), hf_cfg, seed=j, r=args.rank,
                           dtype=args.adapter_dtype) for j in range(min(args.weight_files, args.adapters))]
    names = [f"ad{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        src, dst = files[i % len(files)], os.path.join(root, name)
        os.makedirs(dst)
        shutil.copy(os.path.join(src, "adapter_config.json"), dst)
        os.link(os.path.join(src, "adapter_model.safetensors"), os.path.join(dst, "adapter_model.safetensors"))
    return names


def run_vllm_traffic(args, model: str, root: str, dtype: str, names: list[str], prompts, arrivals,
                     loom_runs: dict) -> dict:
    """vLLM's CPU build on loom's requests: the same prompts, adapters and arrival times run by run, its max_loras and
    max_cpu_loras at loom's device rows and host tier (vLLM has no cap by bytes). -> {setting: result or error}."""
    runs = [{"name": pop, "loras": [names[k] for k in run["ranks"]], "arrivals": arrivals}
            | ({"warm": {"prompts": run["warm"]["prompts"], "loras": [names[k] for k in run["warm"]["ranks"]],
                         "max_tokens": 1}} if run.get("warm") else {})
            for pop, run in loom_runs.items()]
    used = sorted({name for run in runs for name in run["loras"] + (run.get("warm") or {}).get("loras", [])})
    job = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens, "dtype": dtype, "kv_cache_gib": 1,
           "enable_lora": True, "adapters": {name: os.path.join(root, name) for name in used},
           "max_lora_rank": max(16, args.rank), "max_loras": args.device_adapters,
           "max_cpu_loras": args.host_adapters, "runs": runs, "warmup": True}  # warm-up on the base: runs start cold
    return run_vllm_settings(args, job, bc.progress, "vllm")


def traffic(args, root: str) -> None:
    """The many-adapter benchmark (module docstring): one engine, a closed batch for the rate, then Poisson runs."""
    import random

    import torch
    from transformers import AutoConfig

    from harness.adapter_cost import stream_gbps
    from harness.cpu_meter import tree_cpu_s
    from harness.lora import last_load_seq, popularity_weights, run_arrivals, shift_ranks
    from harness.serving_load import arrival_times
    from loom.engine.config import EngineConfig
    from loom.engine.llm import LLM
    from loom.engine.sampling_params import SamplingParams
    from loom.lora import LoraModelSpec, LoraPool

    model = args.model or bc.default_model_dir()
    hf_cfg = AutoConfig.from_pretrained(model)
    t0 = time.perf_counter()
    names = write_many_adapters(args, root, hf_cfg)
    bc.progress(f"wrote {args.adapters} rank-{args.rank} adapters ({args.weight_files} weight files) in "
                f"{time.perf_counter() - t0:.1f}s")
    lora_dtype = "auto" if args.adapter_dtype == "float32" else args.adapter_dtype
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    row = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(hf_cfg), getattr(torch, args.adapter_dtype), device)
    wait = EngineConfig.max_lora_wait_steps if args.max_lora_wait_steps is None else args.max_lora_wait_steps
    llm = LLM(model, adapter_roots=[root], device=args.device, dtype=args.dtype, max_lora_rank=max(16, args.rank),
              lora_memory_bytes=args.device_adapters * args.rank * row, max_host_adapters=args.host_adapters,
              lora_dtype=lora_dtype, enable_prefix_caching=False, cpu_threads=args.threads[0],
              cpu_compile=args.compile == "compiled", max_lora_wait_steps=wait,
              lora_load_cpu_share=cpu_share(args))
    eng, reg = llm.engine, llm.engine.adapters
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, hf_cfg.vocab_size - 10, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.arrivals)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    run_batch(llm, prompts[:8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), ["ad0"] * 8)  # warm
    closed = run_batch(llm, prompts, params, ["ad0"] * args.arrivals)
    rate = args.load * closed["tokens_per_s"] / args.max_tokens
    arrivals = arrival_times(args.arrivals, rate, seed=0)
    bc.progress(f"closed batch on one adapter: {closed['tokens_per_s']:.1f} tok/s -> Poisson at {rate:.2f} req/s")
    results = {"closed_tokens_per_s": closed["tokens_per_s"], "rate": rate, "max_lora_wait_steps": wait, "runs": {}}
    if args.shift_at > 0:
        cut = int(args.shift_at * args.arrivals)
        results["shift"] = {"request": cut, "t": arrivals[cut], "end_t": arrivals[-1], "window_s": args.window_s}
    for pop in ["one adapter"] + list(args.popularity):
        warm = None  # --warm: the requests run before this run (vLLM runs them too)
        if pop == "one adapter":  # ad0, loaded by the closed batch
            ranks = [0] * args.arrivals
        else:
            for d in reg.list():  # every popularity run starts cold
                reg.unload(d["name"])
            weights = popularity_weights(pop, args.adapters)
            ranks = shift_ranks(random.Random(1).choices(range(args.adapters), weights, k=args.arrivals),
                                args.adapters, args.shift_at)
            if args.warm > 0:  # the traffic before the run (its own draws; the prompts' first tokens)
                warm = {"ranks": random.Random(2).choices(range(args.adapters), weights, k=args.warm),
                        "prompts": [prompts[i % len(prompts)][:8] for i in range(args.warm)]}
                run_batch(llm, warm["prompts"], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                          [names[k] for k in warm["ranks"]])
        seq0, evictions0 = last_load_seq(reg.stats().loads), reg.num_evictions
        pid = reg.loader_pid
        cpu0 = tree_cpu_s(pid) if pid else 0.0
        run = run_arrivals(eng, prompts, [names[k] for k in ranks], arrivals, params)
        after = reg.loader_pid  # (started in the run: its boot counts)
        if warm:
            run["warm"] = warm
        run.update(ranks=ranks, loads=[(x.tier, x.seconds) for x in reg.stats().loads if x.seq > seq0],
                   evictions=reg.num_evictions - evictions0,
                   loader_cpu_s=tree_cpu_s(after) - (cpu0 if after == pid else 0.0) if after else 0.0)
        results["runs"][pop] = run
        bc.progress(f"{pop}: {run['tokens'] / run['wall_s']:.1f} tok/s, {run['evictions']} evictions")
    results["adapter_bytes"] = args.rank * reg.pool.row_bytes  # a rank-r adapter's rows in the pools' own type
    reg.close()
    if device.type == "cpu":  # what reading rank rows can reach on the engine's threads
        results["stream_gb_s"] = stream_gbps()
    if args.vllm_python:
        dtype = str(eng.runner.dtype).removeprefix("torch.")
        results["vllm"] = run_vllm_traffic(args, model, root, dtype, names, prompts, arrivals, results["runs"])
    text = traffic_report(results, args)
    print(text, flush=True)
    if args.json:
        results |= {"report": text, "config": vars(args) | {"model": model}, "machine": bc.machine_info()}
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
