"""gpu_check sections `memory`, `speed` (1B-class) and `speed_8b`: what the engine costs on the device.

Random-weight Llamas at real shapes (harness.random_llama), bf16. A decode row: B requests with distinct random
512-token prompts are prefilled, two more steps run untimed, then `steps` engine steps are timed by wall clock
(a step returns sampled token ids to the host, so it is synchronous). Bytes per step = the weights a decode step
reads + the K/V of every context token; achieved GB/s over a device-to-device copy measured in the same process
(bytes read + written) is "of copy". The weight-bandwidth bound of a step is weight bytes / copy bandwidth.
Host vs device: a few more steps under torch.profiler; device ms = the sum of GPU kernel and copy times per
step, GPU idle = step - device (launch and Python overhead that CUDA graphs remove).
Compiles: Triton JIT compiles counted from the end of engine start-up (loom.kernels.compile_counter).
"""
from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path

import torch

from harness.gpu_engine import on_batch, warmup_metrics
from harness.gpu_report import NOT_IMPLEMENTED, Skip
from harness.random_llama import (
    LLAMA_1B,
    LLAMA_8B,
    TINY_A,
    TINY_B,
    decode_weight_bytes,
    ensure_random_llama,
    kv_bytes_per_token,
)
from loom.engine.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.sampling_params import SamplingParams
from loom.kernels.compile_counter import JitCompileCounter, is_supported

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
SPEED_COLUMNS = ["model", "mode", "B", "ctx", "step ms", "tok/s", "GB/s", "of copy", "bound ms", "device ms",
                 "GPU idle ms", "compiles"]


# ---- measuring ---------------------------------------------------------------------------------------------


def bench_ms(fn, dev: str) -> float:
    """Median ms: triton's do_bench (CUDA events) on CUDA, a wall clock on CPU."""
    if dev == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def copy_bandwidth(dev: str, smoke: bool) -> dict:
    n = (4 << 20) if smoke else (2 << 30)  # bytes; several times the H200's 60 MB L2
    x = torch.randn(n // 2, device=dev, dtype=torch.float32).to(torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), dev)
    return {"gbps": 2 * n / ms / 1e6, "bytes": n, "ms": ms}


def device_ms_per_step(step, n: int, dev: str) -> float | None:
    """Sum of GPU kernel / copy durations per call of step(), from torch.profiler (None on CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    if dev != "cuda":
        return None
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / 1e3 / n


class Compiles:
    """JitCompileCounter when Triton has the hook, else a stand-in whose count is None."""

    def __init__(self):
        self.counter = JitCompileCounter() if is_supported() else None

    def __enter__(self):
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        if self.counter is not None:
            self.counter.__exit__(*exc)

    @property
    def count(self) -> int | None:
        return None if self.counter is None else self.counter.count


# ---- the engine --------------------------------------------------------------------------------------------


def graph_modes() -> list[bool | None]:
    """[True, False]: decode steps replaying CUDA graphs (EngineConfig.cuda_graphs), then every step eager."""
    return [True, False] if "cuda_graphs" in EngineConfig.field_names() else [None]


def mode_name(graphs: bool | None) -> str:
    return {None: "eager", False: "eager", True: "graphs"}[graphs]


def start_engine(model_dir: str, graphs: bool | None, **kw):
    if graphs is not None:
        kw["cuda_graphs"] = graphs
    t = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=model_dir, **kw), load_tokenizer=False)
    if torch.cuda.is_available() and eng.runner.device.type == "cuda":
        torch.cuda.synchronize()
    elif graphs:  # --cpu-smoke: the graph path's code (buckets, padding, static buffers) without capture
        eng.runner.enable_graph_emulation()
    return eng, time.perf_counter() - t


def time_decode(eng, B: int, prompt_len: int, steps: int, seed: int, dev: str, loras=None, profile: bool = False,
                compiles: Compiles | None = None) -> dict:
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    vocab = eng.runner.vocab_size
    rids = [f"s{seed}-b{B}-{i}" for i in range(B)]
    try:
        for i, rid in enumerate(rids):
            prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
            eng.add_request(rid, prompt, params, loras[i % len(loras)] if loras else None)
        started, guard = set(), 0
        while len(started) < B:  # prefill everyone (several steps at B=128)
            started.update(o.request_id for o in eng.step() if o.new_token_ids)
            guard += 1
            assert guard < 1000, "prefill did not finish"
        for _ in range(2):
            eng.step()
        # a decode step's context is the tokens computed so far + the new one
        ctx = sum(eng.requests[rid].num_tokens for rid in rids) / B + (steps - 1) / 2
        before = compiles.count if compiles is not None else None
        t = time.perf_counter()
        for _ in range(steps):
            outs = eng.step()
            assert len(outs) == B and all(o.error is None for o in outs), "a decode step did not serve every request"
        step_ms = (time.perf_counter() - t) * 1e3 / steps
        during = None if before is None else compiles.count - before
        device_ms = device_ms_per_step(eng.step, 3, dev) if profile else None
    finally:  # leave the engine empty for the next row, whatever happened
        for rid in rids:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    return {"step_ms": step_ms, "ctx": ctx, "device_ms": device_ms, "compiles_timed": during}


def decode_row(rec, eng, label, mode, B, cfg, copy_gbps, compiles, run_kw, lora_bytes=0) -> dict | None:
    r = rec.run(f"{label} {mode} decode B={B}" + (" with adapters" if run_kw.get("loras") else ""), time_decode,
                eng, B, compiles=compiles, **run_kw)
    if r is None:
        return None
    wbytes = decode_weight_bytes(eng.runner.model)
    nbytes = wbytes + B * r["ctx"] * kv_bytes_per_token(cfg, eng.runner.dtype) + lora_bytes
    gbps = nbytes / r["step_ms"] / 1e6
    bound_ms = wbytes / copy_gbps / 1e6
    idle = None if r["device_ms"] is None else r["step_ms"] - r["device_ms"]
    r.update(tok_s=B / r["step_ms"] * 1e3, gbps=gbps, of_copy=gbps / copy_gbps, bound_ms=bound_ms,
             weight_fraction=bound_ms / r["step_ms"])
    name = label + (f" +{len(run_kw['loras'])} LoRA" if lora_bytes else "")
    rec.row("decode", [name, mode, B, round(r["ctx"]), r["step_ms"], r["tok_s"], gbps, r["of_copy"], bound_ms,
                       r["device_ms"], idle, r["compiles_timed"]])
    return r


# ---- sections ----------------------------------------------------------------------------------------------


def run_memory(rec, opts) -> None:
    dev, smoke = opts.device, opts.smoke
    cfg = TINY_A if smoke else LLAMA_1B
    model = rec.run("random 1B-class Llama written", lambda: {"dir": ensure_random_llama(
        Path(opts.work_dir), "llama1b", cfg, dev)})
    if model is None:
        return
    state = {}
    # --plan: the dtype "auto" gives on CUDA (bf16), which the tiny model's float32 would not
    rec.run("default sizing and start-up", _default_start, model["dir"], dev, state,
            {"dtype": "bfloat16"} if opts.plan else {})
    if "eng" in state:
        rec.run("largest prefill step (max_num_batched_tokens)", _peak_step, state, "prefill")
        rec.run("largest decode step (max_num_seqs)", _peak_step, state, "decode")


def _mem() -> dict:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _default_start(model_dir: str, dev: str, state: dict, kw: dict) -> dict:
    """The engine with every default (dtype auto, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens)."""
    eng, secs = start_engine(model_dir, None, device=dev, **kw)
    state["eng"] = eng
    run = eng.runner
    kv = run.num_blocks * run.bytes_per_block
    res = {"start_s": secs, "dtype": str(run.dtype), "kv_blocks": run.num_blocks, "kv_gib": kv / 2**30,
           "kv_tokens": run.num_blocks * run.block_size, "weights_gib": decode_weight_bytes(run.model) / 2**30,
           **warmup_metrics(eng), **_mem()}
    budget = None
    if dev == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        budget = eng.config.gpu_memory_utilization * total
        res.update(total_gib=total / 2**30, budget_gib=budget / 2**30)
        assert torch.cuda.memory_reserved() <= budget, "start-up reserved more than gpu_memory_utilization"
        free_for_kv = budget - torch.cuda.memory_allocated() + kv
        assert kv >= 0.5 * free_for_kv, f"the KV cache got {kv / 2**30:.1f} GiB of {free_for_kv / 2**30:.1f} GiB free"
    state["budget"] = budget
    return res


def _peak_step(state: dict, kind: str) -> dict:
    eng = state["eng"]
    c = eng.config
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    vocab = eng.runner.vocab_size
    if kind == "prefill":
        n = min(c.max_num_batched_tokens, eng.max_model_len - 1)
        eng.add_request("big", torch.randint(10, vocab, (n,), generator=g).tolist(), p)
        seqs = 1
    else:
        seqs = c.max_num_seqs
        for i in range(seqs):
            eng.add_request(f"d{i}", torch.randint(10, vocab, (8,), generator=g).tolist(), p)
        while eng.stats().num_waiting or not all(s.num_output_tokens for s in eng.scheduler.running):
            eng.step()
    cuda = eng.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    batches = []
    undo = on_batch(eng, lambda b: batches.append((b.num_decode_seqs, list(b.num_scheduled_tokens))))
    try:
        t = time.perf_counter()
        outs = eng.step()
        ms = (time.perf_counter() - t) * 1e3
    finally:
        undo()
    assert len(batches) == 1, f"the timed step ran {len(batches)} batches"
    decode_rows, tokens = batches[0]
    if kind == "prefill":  # the whole prompt in this one step: nothing before it ran any of it
        assert decode_rows == 0 and tokens == [n], \
            f"the timed step was not the {n}-token prefill: {decode_rows} decode rows, tokens per row {tokens}"
    else:
        assert decode_rows == seqs and tokens == [1] * seqs, \
            f"the timed step was not a {seqs}-row decode: {decode_rows} decode rows, tokens per row {tokens}"
    assert len(outs) == seqs, f"{len(outs)} of {seqs} requests got a token in the step"
    res = {"step_ms": ms, "sequences": seqs, "step_tokens": sum(tokens), **_mem()}
    if cuda:
        res["step_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        assert torch.cuda.max_memory_reserved() <= state["budget"], \
            f"the {kind} step reserved more than gpu_memory_utilization of the GPU"
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return res


def _write_adapters(root: Path, model_dir: str, n: int, rank: int) -> dict:
    from transformers import AutoConfig

    from harness.lora import write_raw_adapter

    cfg = AutoConfig.from_pretrained(model_dir)
    for i in range(n):
        write_raw_adapter(str(root / f"ad{i:02d}"), cfg, seed=i, r=rank, alpha=2 * rank, target_modules=LORA_TARGETS,
                          dtype=torch.bfloat16)
    h, hd = cfg.hidden_size, cfg.head_dim
    per_rank = cfg.num_hidden_layers * (2 * (h + cfg.num_attention_heads * hd) + 2 * (h + cfg.num_key_value_heads * hd))
    return {"adapters": n, "rank": rank, "bytes_each": per_rank * rank * 2}


def attention_row(rec, opts, copy_gbps, B, ctx, H, KVH, D) -> None:
    import torch.nn.functional as F

    import harness.kernel_cases as kc
    from loom.kernels.kv_layout import gather_blocks
    from loom.kernels.paged_decode_attention import (
        make_split_counters,
        paged_decode_attention_ref,
        paged_decode_attention_triton,
    )

    dev, smoke = opts.device, opts.smoke

    def measure():
        dt = torch.float32 if smoke and not opts.plan else torch.bfloat16
        kcache, vcache, bt, sl = kc.make_paged_cache([ctx] * B, 16, KVH, D, dt, dev)
        q = torch.randn(B, H, D, device=dev).to(dt)
        out = torch.empty_like(q)
        fn = paged_decode_attention_triton if dev == "cuda" or opts.plan else paged_decode_attention_ref
        counters = make_split_counters(B, KVH, dev)  # once, as the engine makes it (not a zeroing launch per call)
        paged_ms = bench_ms(lambda: fn(q, kcache, vcache, bt, sl, D ** -0.5, out=out, split_counters=counters), dev)
        k = gather_blocks(kcache, bt.long())[:, :, :ctx].contiguous()  # [B, KVH, ctx, D]
        v = gather_blocks(vcache, bt.long())[:, :, :ctx].contiguous()
        q4 = q.view(B, H, 1, D)
        sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=D ** -0.5, enable_gqa=H != KVH)  # noqa: E731
        err = kc.rel_err(out.float(), sdpa().view(B, H, D).float())
        assert err <= kc.TOL[dt], f"paged attention differs from SDPA by {err:.3g}"
        sdpa_ms = bench_ms(sdpa, dev)
        nbytes = 2 * B * ctx * KVH * D * q.element_size()
        return {"paged_ms": paged_ms, "sdpa_ms": sdpa_ms, "paged_gbps": nbytes / paged_ms / 1e6,
                "sdpa_gbps": nbytes / sdpa_ms / 1e6}

    label = f"B={B} ctx={ctx} H={H}/{KVH} D={D}"
    r = rec.run(f"paged decode attention {label}", measure)
    if r is None:
        return
    frac = r["paged_gbps"] / copy_gbps
    rec.row("paged decode attention", [label, r["paged_ms"], r["paged_gbps"], frac, r["sdpa_ms"], r["sdpa_gbps"],
                                       r["paged_gbps"] / r["sdpa_gbps"]])
    if ctx >= 8192:
        rec.target(f"paged decode attention {label}: fraction of copy bandwidth", frac, ">=", 0.8)


def _speed(rec, opts, name: str, cfg: dict, batches, prompt_len: int, steps: int, kv_bytes: int,
           lora: bool, attention: list, eager: bool = True) -> None:
    """The decode sweep first (CUDA graphs, the served mode, then eager unless `eager` is false), the paged
    attention rows last: what a section cut at its limit loses is the least important part."""
    dev, smoke = opts.device, opts.smoke
    full = not smoke or opts.plan  # the CUDA run's batches, adapters and dtype (--plan: at tiny dims)
    copy = rec.run("device-to-device copy bandwidth", copy_bandwidth, dev, smoke)
    if copy is None:
        return
    gbps = copy["gbps"]
    rec.metric("copy_gbps", gbps)
    t = time.time()
    made = rec.run(f"random {name}-class Llama written", lambda: {"dir": ensure_random_llama(
        Path(opts.work_dir), f"llama{name.lower()}", cfg, dev)})  # the memory section may have written it
    if made is None:
        return
    rec.metric("model_write_s", time.time() - t)
    ad = None
    n_ad, rank = (32, 16) if full else (4, 4)
    if lora:
        ad = rec.run(f"{n_ad} distinct rank-{rank} adapters written (q/k/v/o)", _write_adapters,
                     Path(opts.work_dir) / f"adapters-{name}", made["dir"], n_ad, rank)
    rec.table("decode", SPEED_COLUMNS)
    label = f"tiny ({name} slot)" if smoke else f"{name} random"
    seqs = max(batches + ((n_ad,) if lora else ()))
    kw = dict(dtype="bfloat16" if full else "float32", max_num_seqs=seqs, kv_cache_memory_bytes=kv_bytes,
              max_model_len=min(cfg["max_position_embeddings"], 4096), device=dev)
    if ad is not None:
        kw.update(adapter_roots=[str(Path(opts.work_dir) / f"adapters-{name}")], max_lora_rank=16,
                  lora_memory_bytes=64 << 20 if smoke else 1 << 30)
    modes = graph_modes() if eager else graph_modes()[:1]
    if modes == [None]:
        rec.run("CUDA graphs vs eager", _not_implemented, "EngineConfig.cuda_graphs")
    served = {}  # the targets are judged on the first mode: CUDA graphs, how the engine serves
    for graphs in modes:
        mode = mode_name(graphs)
        started, holder = Compiles(), {}

        def start(g=graphs):
            holder["eng"], secs = start_engine(made["dir"], g, **kw)
            return {"start_s": secs, **warmup_metrics(holder["eng"])}

        with started:
            st = rec.run(f"{label} engine start ({mode})", start)
        if st is None:
            continue
        eng = holder.pop("eng")
        rec.metric(f"start_s_{mode}", st["start_s"])
        if st.get("warmup_compiles") is not None:
            rec.metric(f"warmup_compiles_{mode}", st["warmup_compiles"])
        after = Compiles()
        with after:
            rows = {}
            for B in batches:
                rows[B] = decode_row(rec, eng, label, mode, B, cfg, gbps, after,
                                     dict(prompt_len=prompt_len, steps=steps, seed=B, dev=dev, profile=B in (1, 32)))
            names = [f"ad{i:02d}" for i in range(ad["adapters"])] if ad else []
            if names and rec.run(f"{len(names)} adapters loaded", _load_adapters, eng, names) is not None:
                for B in [len(names)] + [b for b in batches if b > len(names)]:  # one adapter each, then shared
                    plain = rows.get(B) or decode_row(rec, eng, label, mode, B, cfg, gbps, after,
                                                       dict(prompt_len=prompt_len, steps=steps, seed=B, dev=dev))
                    with_lora = decode_row(rec, eng, label, mode, B, cfg, gbps, after,
                                           dict(prompt_len=prompt_len, steps=steps, seed=B + 1, dev=dev, loras=names),
                                           lora_bytes=ad["adapters"] * ad["bytes_each"])
                    if plain and with_lora:
                        ratio = with_lora["tok_s"] / plain["tok_s"]
                        rec.metric(f"lora_ratio_B{B}_{mode}", ratio)
                        if B == len(names):
                            served.setdefault("lora", (ratio, mode, len(names), ad["rank"]))
        if graphs:
            rec.run(f"{label} {mode}: decode steps replayed graphs", _replayed, eng)
        rec.run(f"{label} {mode}: compile counter saw the start-up compiles", _counter_sane, dev, started, after)
        rec.metric(f"compiles_after_start_{mode}", after.count)
        served.setdefault("compiles", (after.count, mode))
        if rows.get(1):
            served.setdefault("b1", (rows[1]["weight_fraction"], mode))
        del eng
        if dev == "cuda":
            torch.cuda.empty_cache()
    if "compiles" in served:
        rec.target(f"{name}: Triton compiles after engine start ({served['compiles'][1]})", served["compiles"][0],
                   "<=", 0, note="zero after warm-up")
    if name == "1B" and "b1" in served:
        rec.target(f"1B batch-1 decode: fraction of the weight-bandwidth bound ({served['b1'][1]})",
                   served["b1"][0], ">=", 0.75)
    if "lora" in served:
        ratio, mode, n, rank = served["lora"]
        rec.target(f"{name}: {n} distinct rank-{rank} adapters vs none at B={n}, tokens/s ({mode})", ratio, ">=", 0.85)
    rec.table("paged decode attention", ["shape", "paged ms", "GB/s", "of copy", "SDPA ms", "SDPA GB/s", "vs SDPA"])
    for shape in attention:
        attention_row(rec, opts, gbps, *shape)
    if opts.model_dir:
        _user_model(rec, opts, gbps)


def _load_adapters(eng, names) -> dict:
    for n in names:
        eng.adapters.load(n)
    return {"loaded": len(eng.adapters.list())}


def _replayed(eng) -> dict:
    g = eng.runner.graphs
    assert g is not None and g.replays > 0, "cuda_graphs is on but no decode step replayed a graph"
    return {"graph_steps": g.replays}


def _not_implemented(what: str):
    raise Skip(f"{NOT_IMPLEMENTED}: {what}")


def _counter_sane(dev, started: Compiles, after: Compiles) -> dict:
    if started.count is None:
        raise Skip(f"{NOT_IMPLEMENTED}: this Triton has no post-compile hook")
    total = started.count + after.count
    if dev == "cuda":  # a fresh process must compile (or load) every kernel it launches
        assert total > 0, "no compile seen in a fresh process: the counter is not hooked in"
    return {"at_start": started.count, "after_start": after.count}


def _user_model(rec, opts, gbps) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(opts.model_dir)
    cfg = {"num_hidden_layers": hf.num_hidden_layers, "num_key_value_heads": hf.num_key_value_heads,
           "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads}
    holder = {}

    def start():
        holder["eng"], secs = start_engine(opts.model_dir, None, device=opts.device, max_num_seqs=8,
                                           kv_cache_memory_bytes=1 << 30)
        return {"start_s": secs}

    if rec.run(f"--model-dir {opts.model_dir}: engine start", start) is None:
        return
    eng = holder.pop("eng")
    for B in (1, 8):
        decode_row(rec, eng, "--model-dir", "default", B, cfg, gbps, None,
                   dict(prompt_len=128, steps=3 if opts.smoke else 20, seed=B, dev=opts.device))


ATTENTION_1B = [(8, 16384, 32, 8, 128), (32, 8192, 32, 8, 128), (128, 2048, 32, 8, 128), (32, 8192, 32, 8, 64)]


def run_speed(rec, opts) -> None:
    """1B-class: always comes out (the 8B sweep is the optional section after it)."""
    if opts.plan:  # the CUDA run's batches, prompts and adapters at tiny dims; a few steps (they compile nothing)
        _speed(rec, opts, "1B", TINY_A, (1, 8, 32, 128), 512, 2, 256 << 20, True, [(2, 64, 4, 2, 16)])
    elif opts.smoke:
        _speed(rec, opts, "1B", TINY_A, (1, 2), 16, 3, 64 << 20, True, [(2, 64, 4, 2, 16)])
    else:
        _speed(rec, opts, "1B", LLAMA_1B, (1, 8, 32, 128), 512, 30, 8 << 30, True, ATTENTION_1B)


def run_speed_8b(rec, opts) -> None:
    """8B-class: CUDA graphs only (eager vs graphs is the 1B section's), no adapters; an optional section."""
    if opts.plan:
        _speed(rec, opts, "8B", TINY_B, (1, 8, 32, 128), 512, 2, 256 << 20, False, [], eager=False)
    elif opts.smoke:
        _speed(rec, opts, "8B", TINY_B, (1, 2), 16, 3, 64 << 20, False, [], eager=False)
    else:
        _speed(rec, opts, "8B", LLAMA_8B, (1, 8, 32, 128), 512, 20, 16 << 30, False, [], eager=False)
