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
on this machine."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from peer_vllm_client import add_vllm_arguments, compute_threads, run_vllm_settings

import harness.bench as bc  # noqa: F401  (CPU tuning before torch)
from harness.adapter_cost import distinct_ceiling, lora_cost, model_spec, stream_gbps
from harness.cpu_meter import CpuMeter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCENARIOS = ("no_lora", "one_adapter", "distinct_adapters")


def write_adapter(out_dir: str, hf_cfg, seed: int, r: int, targets=ALL, dtype: str = "float32") -> str:
    import torch
    from safetensors.torch import save_file

    from loom.lora import LoraModelSpec

    spec = LoraModelSpec.from_hf_config(hf_cfg)
    blocks = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    g, dt = torch.Generator().manual_seed(seed), getattr(torch, dtype)
    tensors = {}
    for layer in range(hf_cfg.num_hidden_layers):
        for proj in targets:
            in_f, out_f = spec.proj_shape(proj)
            pre = f"base_model.model.model.layers.{layer}.{blocks[proj]}.{proj}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(r, in_f, generator=g) / in_f ** 0.5).to(dt)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(out_f, r, generator=g) * 0.01).to(dt)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "bias": "none",
                   "task_type": "CAUSAL_LM"}, f)
    return out_dir


def run_batch(llm, prompts, params, loras) -> dict:
    with CpuMeter() as meter:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_names=loras)
        dt = time.perf_counter() - t0
    errs = [o.error for o in outs if o.error]
    if errs:
        raise RuntimeError(f"requests failed: {errs[:3]}")
    tokens = [list(o.token_ids) for o in outs]
    return {"tokens_per_s": sum(map(len, tokens)) / dt, "wall_s": dt, "tokens": tokens, "cpu": meter.result}


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
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adapter-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the adapter files' dtype; loom keeps them in pools of that type (lora_dtype), vLLM widens "
                         "them to the model's float32")
    ap.add_argument("--lora-memory-mb", type=int, default=1024,
                    help="loom's adapter pool; must hold every adapter of the run at once, as vLLM's max_loras does")
    ap.add_argument("--no-hot-load", action="store_true", help="skip the hot-load measurement")
    ap.add_argument("--json", default="")
    add_vllm_arguments(ap)
    return ap.parse_args(argv)


def run_vllm(args, model: str, root: str, prompts, scenarios: dict) -> dict:
    """{scenario: best result over the thread settings, with "setting"}, and every run under "_all"."""
    base_job = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens, "dtype": "float32",
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


def same(a, b) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def adapter_ratios(res: dict) -> tuple[float, float]:
    """One adapter's and the distinct adapters' tokens/s over the same system's no-LoRA tokens/s."""
    base = res["no_lora"]["tokens_per_s"]
    one, dis = (bc.ratio(res[s]["tokens_per_s"], base) for s in ("one_adapter", "distinct_adapters"))
    return one, dis


def report(results: dict, args) -> str:
    looms, vl = results["loom"], results.get("vllm") or {}  # looms: {compute threads (str): its results}
    n = args.requests
    lines = [f"{n} requests x {args.max_tokens} tokens, {args.prompt_len}-token random prompts, rank-{args.rank} "
             f"{args.adapter_dtype} adapters on all 7 projections, greedy, all at t0; loom {args.compile} with "
             f"{' and '.join(looms)} compute thread(s); best of {args.repeats}; other CPU s = other processes "
             "during the timed batches"]
    rows = []

    def row(name, res, ref=None):
        base = res.get("no_lora", {}).get("tokens_per_s")
        cells = [name]
        for sc in SCENARIOS:
            r = res.get(sc)
            cells.append(r["tokens_per_s"] if r else None)
            if sc != "no_lora":
                cells.append(bc.ratio(r["tokens_per_s"], base) if r and base else None)
        cells.append(" / ".join(same(res[sc]["tokens"], ref[sc]["tokens"]) if ref and sc in ref and sc in res
                                else "-" for sc in SCENARIOS))
        cells.append(max((res[sc]["cpu"]["other_cpu_s"] for sc in SCENARIOS if sc in res), default=None))
        cells.append(res.get("startup_s") or (res.get("no_lora") or {}).get("startup_s"))
        rows.append(cells)

    if vl:
        row("vllm (best)", vl)
        for s, res in vl.get("_per_setting", {}).items():
            row(f"vllm {s} ({compute_threads(s)}t)", res)
    for t, res in looms.items():
        row(f"loom ({t}t)", res, vl or None)
    lines.append(bc.table(["system", "no LoRA tok/s", "one adapter", "ratio", f"{n} distinct", "ratio",
                           "same tokens as vLLM (none/one/distinct)", "other CPU s (max)", "start-up s"], rows))
    if vl:
        settings = {sc: vl[sc]["setting"] for sc in SCENARIOS if sc in vl}
        version = next((v["vllm_version"] for v in vl.values() if isinstance(v, dict) and v.get("vllm_version")), "?")
        lines.append(f"vLLM {version}: best thread setting per row "
                     f"{settings}; its LoRA engine: max_loras {vl.get('one_adapter', {}).get('max_loras')} "
                     f"(adapters + 1 spare slot, the vllm#48421 workaround), no-LoRA in that engine "
                     f"{vl.get('no_lora_lora_engine', {}).get('tokens_per_s', float('nan')):.1f} tok/s")
        startups = {k: v["startup_s"] for k, v in vl["_all"].items() if "error" not in v}
        lines.append("start-up (load + compile): " + ", ".join(f"{k} {v:.1f}s" for k, v in startups.items())
                     + "".join(f", loom {t}t {res['startup_s']:.1f}s" for t, res in looms.items()))
    checks = []
    for t, res in looms.items():
        one, dis = adapter_ratios(res)
        ceiling = ""
        if res.get("stream_gb_s") and results.get("adapter_bytes"):
            gbps, nbytes = res["stream_gb_s"], n * results["adapter_bytes"]
            cap = distinct_ceiling(res["no_lora"]["tokens_per_s"], n, args.max_tokens, results["adapter_bytes"], gbps)
            lines.append(f"loom ({t}t): {n} distinct adapters read {nbytes / 1e6:.0f} MB a decode step; at the "
                         f"{gbps:.1f} GB/s this machine reads on {t} thread(s), reading them after the rest of the "
                         f"step would cap the distinct ratio at {cap:.2f} (LoRA FLOPs not counted; loom reads them "
                         f"while its GEMMs compute)")
            ceiling = f" (bound if read after the GEMMs {cap:.2f})"
        rounds = res.get("rounds") or []
        if len(rounds) > 1:  # ratios within each round (its three scenarios ran back to back)
            per = [adapter_ratios({s: {"tokens_per_s": r[s]} for s in SCENARIOS}) for r in rounds]
            lines.append(f"loom ({t}t), ratios within each round (one adapter / distinct): "
                         + "; ".join(f"{a:.3f} / {b:.3f}" for a, b in per)
                         + f"; median {statistics.median(a for a, _ in per):.3f} / "
                         f"{statistics.median(b for _, b in per):.3f}")
        # four decimals: 0.9499 is not met, and fewer would print it as 0.95
        checks += [(f"loom ({t}t): {n} distinct >= 0.85x loom's no-LoRA", dis >= 0.85, f"{dis:.4f}x{ceiling}"),
                   (f"loom ({t}t): one adapter >= 0.95x", one >= 0.95, f"{one:.4f}x")]
    if vl and all(s in vl for s in SCENARIOS):
        v_one, v_dis = adapter_ratios(vl)
        vb = vl["no_lora"]["tokens_per_s"]
        best = max(looms, key=lambda t: looms[t]["no_lora"]["tokens_per_s"])
        base = looms[best]["no_lora"]["tokens_per_s"]
        checks.append((f"loom no-LoRA above vLLM's (loom {best}t, vLLM {vl['no_lora']['setting']})", base > vb,
                       f"{base:.1f} vs {vb:.1f} tok/s"))
        for t, res in looms.items():
            one, dis = adapter_ratios(res)
            checks.append((f"loom ({t}t): both adapter ratios above vLLM's", one > v_one and dis > v_dis,
                           f"one {one:.2f} vs {v_one:.2f}, distinct {dis:.2f} vs {v_dis:.2f}"))
        ident = all(same(res[s]["tokens"], vl[s]["tokens"]) == f"{n}/{n}" for res in looms.values() for s in SCENARIOS)
        checks.append((f"tokens identical {n}/{n} in every row", ident, ""))
        for t, res in looms.items():  # against vLLM computing on as many threads as loom
            eq = next((s for s in vl.get("_per_setting", {}) if compute_threads(s) == int(t)), None)
            if eq is None:
                continue
            v = vl["_per_setting"][eq]
            vb = v["no_lora"]["tokens_per_s"]
            base = res["no_lora"]["tokens_per_s"]
            one, dis = adapter_ratios(res)
            v_one, v_dis = adapter_ratios(v)
            checks += [(f"at equal compute (loom {t}t, vLLM {eq}): loom no-LoRA above vLLM's", base > vb,
                        f"{base:.1f} vs {vb:.1f} tok/s"),
                       (f"at equal compute (loom {t}t, vLLM {eq}): both adapter ratios above vLLM's",
                        one > v_one and dis > v_dis,
                        f"one {one:.2f} vs {v_one:.2f}, distinct {dis:.2f} vs {v_dis:.2f}")]
    for what, ok, detail in checks:
        lines.append(f"TARGET {what}: {detail} {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


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
        bench(args, root)
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
    loom: dict = {"startup_s": startup, "torch_threads": torch.get_num_threads(), "rounds": []}
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
        results["vllm"] = run_vllm(args, model, root, prompts, scenario_loras(n))
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


if __name__ == "__main__":
    main()
