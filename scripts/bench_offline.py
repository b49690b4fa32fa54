#!/usr/bin/env python3
"""The published offline protocol: this engine against vLLM's CPU build and HF transformers, in one run.

N requests (default 64) of ordinary English sentences, all arriving at once, greedy, exactly --max-tokens
tokens each (EOS ignored), the default model, float32. The same prompt token ids go to:

* loom       this engine through the offline API (`LLM.stream`), once per --threads value and per forward
             (--compile: eager = pre-packed oneDNN GEMMs + C++ attention, compiled = torch.compile); a
             request's latency = its finish - t0;
* vllm       vLLM (CPU build, its own venv: --vllm-python) through AsyncLLM with concurrent streams and
             ignore_eos, once per --vllm-threads setting (the faster is "vLLM"); latency = its last output - t0;
* hf-static  transformers `generate` on static batches of --hf-batch-size (left padding), one batch after
             another; a request's latency = the end of its batch - t0;
* hf-cb      transformers' own continuous batching (`model.generate_batch`, paged attention); a
             request's latency = the end of its lifespan - the first request's creation (the manager's
             set-up, sized to the same KV capacity as loom's, is reported separately, not counted).

Prints tokens/s and mean/p50/p99 request latency as ratios to vLLM (to loom without vLLM), how many requests
have greedy tokens identical to vLLM's (and to HF static's: left padding can legitimately change a few tokens),
start-up times (model load + compile), the CPU seconds other processes used during each timed part (should be
~0 on a quiet machine), the targets (loom >= 1.2x vLLM's tokens/s with lower mean latency, at each
thread count), and the share of allocated KV memory holding real tokens. Saves JSON and a PNG under results/.

    python scripts/bench_offline.py --num-prompts 32 --threads 1 2 --vllm-python /path/to/vllm-venv/bin/python \
        --vllm-preload "$TCMALLOC:$VENV/lib/libiomp5.so" --skip hf-static --skip hf-cb
    python scripts/bench_offline.py                       # loom vs HF only: 64 prompts x 300 tokens
    python scripts/bench_offline.py --num-prompts 4 --max-tokens 8 --hf-batch-size 2 --compile eager   # smoke
"""
from __future__ import annotations

import argparse
import gc
import itertools
import sys
import threading
import time
from pathlib import Path

import torch  # noqa: E402

import harness.bench as bc  # noqa: E402  (CPU tuning before torch)
from harness.cpu_meter import CpuMeter  # noqa: E402
from harness.vllm_peer import add_vllm_arguments, best, run_vllm_settings, setting_name  # noqa: E402

HF_SYSTEMS = ("hf-static", "hf-cb")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=300, help="tokens generated per request (EOS ignored)")
    ap.add_argument("--hf-batch-size", type=int, default=8, help="static batch size for HF generate")
    ap.add_argument("--model", default="", help="HF model folder (default: the default model)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="the peers' dtype (vLLM, HF), and loom's unless --loom-dtype")
    ap.add_argument("--loom-dtype", nargs="+", default=None, choices=("float32", "float16", "bfloat16"),
                    help="loom's dtype(s), one run each (e.g. float32 bfloat16: loom f32 vs bf16 against bf16 peers)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (all systems use the same)")
    ap.add_argument("--skip", action="append", default=[], choices=("hf-static", "hf-cb"),
                    help="leave a peer out (repeatable)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="loom's compute threads (one run each; per rank with --tensor-parallel-size)")
    ap.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                    help="loom's tensor_parallel_size (one run each, e.g. 1 2): the table adds ms per step and the "
                         "ms per step rank 0 spends in collectives")
    ap.add_argument("--compile", default="eager", choices=("eager", "compiled", "both"),
                    help="loom's CPU forward: eager (pre-packed GEMMs, C++ kernels), compiled (torch.compile at "
                         "start: minutes), or both")
    ap.add_argument("--hf-threads", type=int, default=0,
                    help="torch threads for the HF peers (0 = the first --threads)")
    add_vllm_arguments(ap)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=0, help="loom's KV budget (0 = engine default)")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="loom's max running sequences (0 = engine default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="loom's token budget per step (0 = default)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the small untimed warm-up run of each system")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default: results/)")
    ap.add_argument("--tag", default="", help="suffix for the output file names")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


# ---- loom --------------------------------------------------------------------------------------

def loom_dtypes(args) -> list[str]:
    return args.loom_dtype or [args.dtype]


def engine_kwargs(args, dtype: str | None = None) -> dict:
    kw = {"dtype": dtype or args.dtype, "device": args.device}
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def run_loom(llm, prompt_ids: list[list[int]], max_tokens: int, progress_every: float) -> dict:
    from loom.engine.sampling_params import SamplingParams

    engine = llm.engine
    bs = engine.config.block_size
    samples: list[tuple[float, int, int, int]] = []  # (t, tokens held, blocks used, running)
    orig_step = engine.step
    t0 = 0.0

    def sampled_step():
        outs = orig_step()
        running = engine.scheduler.running
        held = sum(s.num_computed_tokens for s in running)
        samples.append((time.perf_counter() - t0, held, engine.block_manager.num_used_blocks, len(running)))
        return outs

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    n = len(prompt_ids)
    first = [None] * n
    finish = [None] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    stats0 = engine.stats()
    group = engine.runner.tp  # tensor parallelism: rank 0's collectives (broadcast, all-reduces, logits gather)
    coll0 = group.collective_s if group is not None else 0.0
    engine.step = sampled_step
    meter = CpuMeter()
    try:
        meter.__enter__()
        t0 = time.perf_counter()
        last_report, produced = t0, 0
        # LLM.stream names requests offline-<k> from one counter, in prompt order: peek at the next k
        k0 = next(llm._ids)
        llm._ids = itertools.count(k0)
        for out in llm.stream(prompt_ids, params):
            now = time.perf_counter()
            i = int(out.request_id.rsplit("-", 1)[1]) - k0
            if first[i] is None and out.delta_token_ids:
                first[i] = now - t0
            produced += len(out.delta_token_ids)
            if out.finished:
                finish[i] = now - t0
                tokens[i] = list(out.token_ids)
                if out.error:
                    raise RuntimeError(f"loom request {out.request_id} failed: {out.error}")
            if now - last_report >= progress_every:
                done = sum(f is not None for f in finish)
                bc.progress(f"  loom: {produced} tokens, {done}/{n} done, {produced / (now - t0):.1f} tok/s")
                last_report = now
    finally:
        meter.__exit__(None, None, None)
        engine.step = orig_step
    stats1 = engine.stats()
    return {
        "latencies_s": finish, "first_token_s": first, "tokens": tokens, "wall_s": max(finish),
        "kv_samples": samples, "block_size": bs, "kv_blocks_total": engine.block_manager.num_blocks,
        "num_preemptions": stats1.num_preemptions - stats0.num_preemptions,
        "prefix_hit_tokens": stats1.prefix_hit_tokens - stats0.prefix_hit_tokens,
        "kv_tokens_capacity": engine.block_manager.num_blocks * bs, "cpu": meter.result,
        "steps": len(samples), "collective_s": (group.collective_s - coll0) if group is not None else 0.0,
    }


def loom_kv_share(res: dict) -> dict:
    samples = [s for s in res["kv_samples"] if s[2] > 0]
    if not samples:
        return {}
    bs = res["block_size"]
    peak = max(samples, key=lambda s: (s[2], s[1]))
    shares = [s[1] / (s[2] * bs) for s in samples]
    return {
        "share_at_peak": peak[1] / (peak[2] * bs), "tokens_at_peak": peak[1], "blocks_at_peak": peak[2],
        "blocks_used_over_total_at_peak": peak[2] / res["kv_blocks_total"],
        "share_min": min(shares), "share_mean": sum(shares) / len(shares), "steps": len(samples),
    }


# ---- HF static batches -------------------------------------------------------------------------

def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # EOS ignored like `ignore_eos`: generate() fills unset values from the model's generation config,
    # so remove the EOS there (it is not used for anything else in this process).
    model.generation_config.eos_token_id = None
    return model


def run_hf_static(model, prompt_ids, max_tokens: int, batch_size: int, pad_id: int, device,
                  quiet: bool = False) -> dict:
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None,
                               pad_token_id=pad_id)
    n = len(prompt_ids)
    latencies = [None] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    kv_real = kv_alloc = 0
    batches = []
    t0 = time.perf_counter()
    for start in range(0, n, batch_size):
        chunk = prompt_ids[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg)
        if device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter() - t0
        gen = out[:, width:].tolist()
        for j, g in enumerate(gen):
            latencies[start + j] = end
            tokens[start + j] = g
        # The cache holds every row at the padded width: real tokens vs allocated slots at the end of a batch.
        real = sum(len(p) for p in chunk) + len(chunk) * (max_tokens - 1)
        alloc = len(chunk) * (width + max_tokens - 1)
        kv_real += real
        kv_alloc += alloc
        batches.append({"start": start, "size": len(chunk), "width": width, "end_s": end})
        done = start + len(chunk)
        if not quiet:
            bc.progress(f"  hf-static: batch {start // batch_size + 1}/{-(-n // batch_size)} done at {end:.1f}s "
                        f"({done * max_tokens / end:.1f} tok/s so far)")
    return {"latencies_s": latencies, "tokens": tokens, "wall_s": max(latencies), "batches": batches,
            "kv": {"share_at_peak": kv_real / kv_alloc, "note": "real tokens / padded cache slots at each batch's end"}}


# ---- HF continuous batching ----------------------------------------------------------------------

def run_hf_cb(model, prompt_ids, max_tokens: int, pad_id: int, kv_tokens: int, device, progress_every: float) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen_cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
    page = ContinuousBatchingConfig().page_size
    # By default it sizes the cache from free memory (90%: on CPU, most of the machine's RAM, slow to allocate).
    # Give it loom's token capacity, or more if its coarser pages need more for every request to be resident.
    pages_all_resident = sum(-(-(len(p) + max_tokens) // page) for p in prompt_ids)
    cb_cfg = ContinuousBatchingConfig(num_blocks=max(1, -(-kv_tokens // page), pages_all_resident))
    stop = threading.Event()
    t_call = time.perf_counter()

    def heartbeat():
        while not stop.wait(progress_every):
            bc.progress(f"  hf-cb: running ({time.perf_counter() - t_call:.0f}s)")

    hb = threading.Thread(target=heartbeat, daemon=True)
    hb.start()
    try:
        out = model.generate_batch(prompt_ids, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                   max_new_tokens=max_tokens, warmup=device.type == "cuda")
    finally:
        stop.set()
    call_s = time.perf_counter() - t_call
    results = list(out.values())
    if len(results) != len(prompt_ids):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompt_ids)} requests")
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"generate_batch: {len(errors)} requests failed, e.g. {errors[0]}")
    # keys are req_<k> in input order
    results.sort(key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    t0 = min(r.created_time for r in results)
    latencies = [r.lifespan[1] - t0 for r in results]
    # A paged cache of `page`-token blocks with every request resident (as at the end of this workload).
    real = sum(len(p) + max_tokens for p in prompt_ids)
    alloc = sum(-(-(len(p) + max_tokens) // page) * page for p in prompt_ids)
    return {"latencies_s": latencies, "tokens": [list(r.generated_tokens) for r in results], "wall_s": max(latencies),
            "setup_s": t0 - t_call, "call_s": call_s, "page_size": page, "num_blocks": cb_cfg.num_blocks,
            "kv": {"share_at_peak": real / alloc, "note": f"estimate: all requests resident in {page}-token pages"}}


# ---- report ------------------------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefixes = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
    return {"identical": same, "total": len(a), "mean_common_prefix": sum(prefixes) / max(1, len(prefixes)),
            "min_common_prefix": min(prefixes) if prefixes else 0}


_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _loom_names(sysres: dict) -> list[str]:
    return [k for k in sysres if k.startswith("loom") and "error" not in sysres[k]]


def _vllm_names(sysres: dict) -> list[str]:
    return [k for k in sysres if k.startswith("vllm") and "error" not in sysres[k]]


def reference_name(sysres: dict) -> str:
    """Ratios are to vLLM's faster thread setting when vLLM ran, else to loom's first run."""
    vl = best({k: sysres[k] for k in _vllm_names(sysres)})
    return vl or _loom_names(sysres)[0]


def report(res: dict, args) -> str:
    sysres = res["systems"]
    ref = reference_name(sysres)
    base = sysres[ref]
    vref = ref if ref.startswith("vllm") else None
    lines = [f"{args.num_prompts} prompts x {args.max_tokens} tokens, all at t0, greedy, EOS ignored, {args.dtype}; "
             f"ratios are system / {ref}; other CPU s = CPU time other processes used during the timed part"]
    rows = []
    for name, r in sysres.items():
        if "error" in r:
            rows.append([name] + [None] * 11 + ["FAILED"])
            continue
        s = r["latency"]
        same = r.get("agreement_vs_ref")
        rows.append([name, r.get("threads"), r["tokens_per_s"], bc.ratio(r["tokens_per_s"], base["tokens_per_s"]),
                     s["mean"], bc.ratio(s["mean"], base["latency"]["mean"]), s["p50"], s["p99"],
                     r.get("startup_s"), r.get("cpu", {}).get("other_cpu_s"),
                     f"{same['identical']}/{same['total']}" if same else "(ref)" if name == ref else "-",
                     (lambda a: f"{a['identical']}/{a['total']}" if a else "-")(r.get("agreement_vs_hf_static")), ""])
    lines.append(bc.table(["system", "threads", "tok/s", f"x {ref}", "mean lat s", f"x {ref}", "p50 s", "p99 s",
                           "start-up s", "other CPU s", f"same tokens as {ref}", "as hf-static", ""], rows))
    lines.append("")
    for name, r in sysres.items():
        if "error" in r:
            lines.append(f"{name}: FAILED: {r['error'][-600:]}")
    if vref:
        settings = ", ".join(f"{k}: {sysres[k]['tokens_per_s']:.1f} tok/s" for k in _vllm_names(sysres))
        lines.append(f"vLLM = its faster setting ({settings}); vLLM {sysres[vref].get('vllm_version', '?')}")
        for t in sorted({sysres[k]["threads"] for k in _loom_names(sysres)}):
            names = [k for k in _loom_names(sysres) if sysres[k]["threads"] == t]
            top = max(names, key=lambda k: sysres[k]["tokens_per_s"])
            r = sysres[top]
            tp = bc.ratio(r["tokens_per_s"], base["tokens_per_s"])
            lat = bc.ratio(r["latency"]["mean"], base["latency"]["mean"])
            ag = r.get("agreement_vs_ref") or {"identical": 0, "total": 0}
            # token identity is asked of float32 only: two 16-bit implementations round at different places
            exact = r.get("dtype") == "float32" and args.dtype == "float32"  # args.dtype: the peers' dtype
            ok = tp >= 1.2 and lat < 1.0 and (ag["identical"] == ag["total"] or not exact)
            same_tokens = (f"greedy tokens identical {ag['identical']}/{ag['total']}" if exact else
                           f"greedy tokens identical {ag['identical']}/{ag['total']} (not asked in 16-bit)")
            lines.append(f"TARGET loom with {t} compute thread(s) ({top}): {tp:.2f}x vLLM's tokens/s (>= 1.2), "
                         f"mean latency {lat:.2f}x (< 1), {same_tokens}: {'met' if ok else 'NOT met'}")
            same = setting_name({k: sysres[k] for k in _vllm_names(sysres)}, t)
            if same is not None:  # the same comparison against vLLM computing on as many threads as loom
                v = sysres[same]
                tp_e = bc.ratio(r["tokens_per_s"], v["tokens_per_s"])
                lat_e = bc.ratio(r["latency"]["mean"], v["latency"]["mean"])
                lines.append(f"  at equal compute ({same}, {t} compute thread(s)): {tp_e:.2f}x its tokens/s, mean "
                             f"latency {lat_e:.2f}x: {'met' if tp_e >= 1.2 and lat_e < 1.0 else 'NOT met'}")
        lines.append("start-up (model load + compile): " + ", ".join(
            f"{k} {sysres[k]['startup_s']:.1f}s" for k in sysres if "error" not in sysres[k] and
            sysres[k].get("startup_s") is not None))
    for name in _loom_names(sysres):
        ag = sysres[name].get("agreement_vs_hf_static")
        if ag:
            lines.append(f"{name}: greedy tokens identical to hf-static {ag['identical']}/{ag['total']} (mean common "
                         f"prefix {ag['mean_common_prefix']:.0f} of {args.max_tokens}; left padding can change a few)")
    lines.append(f"CPU 16-bit units: {', '.join(res['machine'].get('cpu_16bit_units') or []) or 'none'}")
    for name in _loom_names(sysres):
        lines.append(f"{name} ({sysres[name].get('dtype')}): {sysres[name].get('kernels')}")
    for name in _vllm_names(sysres):
        lines.append(f"{name}: {args.dtype}, its own CPU build's kernels (oneDNN matmuls on the units above); "
                     f"{sysres[name].get('cpu_isa') or 'attention ISA not reported'}")
    for t in sorted({sysres[k]["threads"] for k in _loom_names(sysres)}):
        by = {sysres[k].get("dtype"): k for k in _loom_names(sysres) if sysres[k]["threads"] == t}
        if "bfloat16" in by and "float32" in by:
            b, f = sysres[by["bfloat16"]], sysres[by["float32"]]
            tp = bc.ratio(b["tokens_per_s"], f["tokens_per_s"])
            lat = bc.ratio(b["latency"]["mean"], f["latency"]["mean"])
            lines.append(f"loom bf16 / loom f32 at {t} thread(s): {tp:.2f}x tokens/s, mean latency {lat:.2f}x")
    first = sysres[_loom_names(sysres)[0]]
    kv = first.get("kv", {})
    if kv:
        lines.append(f"KV memory holding real tokens at peak: loom {kv['share_at_peak']:.1%} "
                     f"({kv['tokens_at_peak']} tokens in {kv['blocks_at_peak']} blocks of {first['block_size']}; "
                     f"{kv['blocks_used_over_total_at_peak']:.1%} of the {first['kv_blocks_total']} blocks in use), "
                     f"lowest over steps {kv['share_min']:.1%}; preemptions {first['num_preemptions']}, "
                     f"prefix-cache hit tokens {first['prefix_hit_tokens']}")
    for name in HF_SYSTEMS:
        r = sysres.get(name)
        if r and "kv" in r:
            lines.append(f"  {name}: {r['kv']['share_at_peak']:.1%} ({r['kv']['note']})")
    if args.tensor_parallel_size != [1]:
        lines.append(tp_table(sysres))
    cb = sysres.get("hf-cb")
    if cb and "setup_s" in cb:
        lines.append(f"hf-cb manager set-up (not counted): {cb['setup_s']:.1f}s")
    return "\n".join(lines)


def tp_table(sysres: dict) -> str:
    """Tensor parallelism: each loom run's tokens/s and mean latency, its steps and the share of a step rank 0
    spends in collectives (on CPU the whole transfer and wait; on CUDA the launches)."""
    rows = []
    for name in _loom_names(sysres):
        r = sysres[name]
        steps = max(1, r["steps"])
        rows.append([name, r["tp"], r["tokens_per_s"], r["latency"]["mean"], r["steps"], r["wall_s"] / steps * 1e3,
                     r["collective_s"] / steps * 1e3])
    return bc.table(["system", "TP", "tok/s", "mean lat s", "steps", "ms/step", "collectives ms/step"], rows)


def plot(res: dict, path: Path) -> None:
    if not bc.have_matplotlib():
        return
    plt, fig, axes = bc.new_figure(1, 3, size=(15, 4.5))
    sysres = {k: v for k, v in res["systems"].items() if "error" not in v}
    ax = axes[0][0]
    for name, r in sysres.items():
        lat = sorted(r["latencies_s"])
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], drawstyle="steps-post", label=name)
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("share of requests finished")
    ax.set_title("request latency (all arrive at t=0)")
    ax.legend()
    ax = axes[0][1]
    names = list(sysres)
    ax.bar(names, [sysres[n]["tokens_per_s"] for n in names], color=[f"C{i}" for i in range(len(names))])
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput")
    ax.tick_params(axis="x", labelrotation=30)
    ax = axes[0][2]
    loom = next((sysres[k] for k in sysres if k.startswith("loom")), None)
    if loom and loom["kv_samples"]:
        bs = loom["block_size"]
        t = [s[0] for s in loom["kv_samples"]]
        ax.plot(t, [s[2] * bs for s in loom["kv_samples"]], label="allocated (blocks x block size)")
        ax.plot(t, [s[1] for s in loom["kv_samples"]], label="real tokens held")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV token slots")
        ax.set_title("loom KV cache")
        ax.legend()
    fig.suptitle(f"{res['config']['num_prompts']} prompts x {res['config']['max_tokens']} tokens, "
                 f"{res['config']['dtype']}, {res['machine']['cpu']}")
    bc.save_figure(plt, fig, path)


def finish_system(r: dict, max_tokens: int) -> dict:
    n_tokens = sum(len(t) for t in r["tokens"])
    r["num_tokens"] = n_tokens
    r["tokens_per_s"] = n_tokens / r["wall_s"] if r["wall_s"] else float("nan")
    r["latency"] = bc.summarize(r["latencies_s"])
    short = [i for i, t in enumerate(r["tokens"]) if len(t) != max_tokens]
    if short:
        r["wrong_length_requests"] = short
        bc.progress(f"  WARNING: {len(short)} requests did not produce exactly {max_tokens} tokens")
    return r


def run_loom_variants(args, model_dir: str, prompt_ids, warm_ids) -> dict[str, dict]:
    from loom.engine.llm import LLM

    modes = ["eager", "compiled"] if args.compile == "both" else [args.compile]
    dtypes = loom_dtypes(args)
    out = {}
    tps = args.tensor_parallel_size
    for threads, dtype, mode, tp in itertools.product(args.threads, dtypes, modes, tps):
        name = f"loom {mode} {threads}t" + (f" {_SHORT[dtype]}" if dtypes != [args.dtype] else "") + \
            (f" tp{tp}" if tps != [1] else "")
        bc.progress(f"{name}: loading{' and compiling (minutes)' if mode == 'compiled' else ''}")
        t = time.perf_counter()
        llm = LLM(model_dir, **engine_kwargs(args, dtype), cpu_threads=threads, cpu_compile=mode == "compiled",
                  tensor_parallel_size=tp)
        startup = time.perf_counter() - t
        runner = llm.engine.runner
        kernels = runner.kernels.describe(runner.dtype)  # loom's dispatch: which kernels and CPU units ran
        bc.progress(f"{name}: {kernels}")
        if not args.no_warmup:
            # the same lengths and batch shapes, other tokens (rotated): nothing of the timed prompts is in
            # the prefix cache afterwards
            bc.progress(f"{name}: warm-up (all prompts rotated, 2 tokens)")
            run_loom(llm, warm_ids, 2, 1e9)
        bc.progress(f"{name}: running ({torch.get_num_threads()} torch threads)")
        r = finish_system(run_loom(llm, prompt_ids, args.max_tokens, args.progress_every), args.max_tokens)
        r.update(kv=loom_kv_share(r), threads=threads, mode=mode, startup_s=startup, tp=tp,
                 compile_s=llm.engine.runner.forward.compile_s, dtype=str(runner.dtype).removeprefix("torch."),
                 kernels=kernels)
        out[name] = r
        bc.progress(f"{name}: done in {r['wall_s']:.1f}s, {r['tokens_per_s']:.1f} tok/s, mean latency "
                    f"{r['latency']['mean']:.2f}s, other CPU {r['cpu']['other_cpu_s']:.1f}s")
        llm.close()
        del llm
        gc.collect()
    return out


def run_vllm(args, model_dir: str, prompt_ids) -> dict[str, dict]:
    job = {"model": model_dir, "prompts": prompt_ids, "max_tokens": args.max_tokens, "dtype": args.dtype,
           "kv_cache_gib": max(1, round((args.kv_cache_memory_bytes or 1 << 30) / (1 << 30))),
           "warmup": not args.no_warmup}
    out = {}
    for name, r in run_vllm_settings(args, job, bc.progress).items():
        if "error" not in r:
            reqs = r.pop("requests")
            r.update(tokens=[q["token_ids"] for q in reqs], latencies_s=[q["latency_s"] for q in reqs],
                     first_token_s=[q["ttft_s"] for q in reqs], threads=r["threads"])
            r = finish_system(r, args.max_tokens)
        out[name] = r
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from loom.engine.config import EngineConfig

    model_dir = args.model or bc.default_model_dir()
    device = EngineConfig(model=model_dir, device=args.device).torch_device
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = bc.prompts(args.num_prompts)
    prompt_ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    lens = [len(p) for p in prompt_ids]
    bc.progress(f"{args.num_prompts} prompts ({min(lens)}-{max(lens)} tokens, mean {sum(lens) / len(lens):.1f}) x "
                f"{args.max_tokens} tokens, {args.dtype} on {device}")
    res = {"config": vars(args) | {"model_dir": model_dir, "prompt_lens": lens}, "machine": bc.machine_info(),
           "prompts": texts, "systems": {}}
    warm_ids = [p[1:] + p[:1] for p in prompt_ids]

    # loom first; each engine is freed before the next system so every one gets the memory
    res["systems"].update(run_loom_variants(args, model_dir, prompt_ids, warm_ids))
    first = next(iter(res["systems"].values()))
    kv_tokens = first["kv_tokens_capacity"]
    if args.vllm_python:
        res["systems"].update(run_vllm(args, model_dir, prompt_ids))

    hf_threads = args.hf_threads or args.threads[0]
    torch.set_num_threads(hf_threads)
    model = None
    if "hf-static" not in args.skip or "hf-cb" not in args.skip:
        bc.progress(f"hf: loading ({hf_threads} torch threads)")
        model = load_hf_model(model_dir, dtype, device)
    if "hf-static" not in args.skip:
        try:
            if not args.no_warmup:
                bc.progress("hf-static: warm-up (one batch, 2 tokens)")
                run_hf_static(model, warm_ids[:args.hf_batch_size], 2, args.hf_batch_size, pad_id, device, quiet=True)
            bc.progress("hf-static: running")
            with CpuMeter() as meter:
                r = run_hf_static(model, prompt_ids, args.max_tokens, args.hf_batch_size, pad_id, device)
            r = finish_system(r, args.max_tokens)
            r.update(cpu=meter.result, threads=hf_threads)
            res["systems"]["hf-static"] = r
            bc.progress(f"hf-static: done in {r['wall_s']:.1f}s, {r['tokens_per_s']:.1f} tok/s")
        except Exception as e:  # report and go on
            bc.progress(f"hf-static FAILED: {type(e).__name__}: {e}")
            res["systems"]["hf-static"] = {"error": f"{type(e).__name__}: {e}"}
    if "hf-cb" not in args.skip:
        try:
            if not args.no_warmup:
                bc.progress("hf-cb: warm-up (all prompts rotated, 2 tokens)")
                run_hf_cb(model, warm_ids, 2, pad_id, kv_tokens, device, 1e9)
            bc.progress("hf-cb: running generate_batch")
            with CpuMeter() as meter:
                r = run_hf_cb(model, prompt_ids, args.max_tokens, pad_id, kv_tokens, device, args.progress_every)
            r = finish_system(r, args.max_tokens)
            r.update(cpu=meter.result, threads=hf_threads)
            res["systems"]["hf-cb"] = r
            bc.progress(f"hf-cb: done in {r['wall_s']:.1f}s (+{r['setup_s']:.1f}s set-up), "
                        f"{r['tokens_per_s']:.1f} tok/s")
        except Exception as e:  # e.g. not available in this transformers version
            bc.progress(f"hf-cb FAILED: {type(e).__name__}: {e}")
            res["systems"]["hf-cb"] = {"error": f"{type(e).__name__}: {e}"}

    sysres = res["systems"]
    ref = reference_name(sysres)
    static = sysres.get("hf-static")
    for name, r in sysres.items():
        if "error" in r:
            continue
        if name != ref:
            r["agreement_vs_ref"] = agreement(r["tokens"], sysres[ref]["tokens"])
        if static and "error" not in static and name != "hf-static":
            r["agreement_vs_hf_static"] = agreement(r["tokens"], static["tokens"])

    text = report(res, args)
    print(text, flush=True)
    res["report"] = text
    bc.save_results(res, "bench_offline", args, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
