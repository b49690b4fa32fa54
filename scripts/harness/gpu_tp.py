"""gpu_check section `tp`: tensor parallelism on the device, TP=1 against TP=2 on the 1B-class random Llama.

Runs where the device has 2+ GPUs; on one GPU the section reports "skipped: 1 GPU" (not a failure). Each size is
one engine (bf16, ranks on GPUs 0 and 1, NCCL): decode tokens/s at batch 1 and 32 (timed as the speed section's
rows: distinct random 512-token prompts prefilled, then wall-clock steps) and the ms per step rank 0 spends in
collectives (launches on CUDA; the transfers run on the stream). TP=1 runs eagerly (the baseline, as before); the
TP=2 engine captures its per-rank decode graphs (collectives inside) at start and is measured replaying them and
eagerly (rank 0 alone decides: with its graphs set aside every step goes out eager, and the workers follow the step
header), and its greedy tokens with graphs must equal its eager ones (a batch of exactly one bucket, so the same
kernels at the same shapes; with 2 ranks an all-reduce is one addition per element, the same in any NCCL algorithm).
--cpu-smoke runs the same on CPU (gloo, the graph path emulated) at tiny shapes; --plan records TP=1's launches only
(a worker rank is a process of its own).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from harness.gpu_perf import start_engine, time_decode
from harness.random_llama import LLAMA_1B, TINY_A, ensure_random_llama
from loom.engine.sampling_params import SamplingParams

COLUMNS = ["model", "TP", "decode", "B", "step ms", "tok/s", "collectives ms/step", "x TP 1 eager"]


def _decode(eng, B: int, prompt_len: int, steps: int, dev: str) -> dict:
    """time_decode's row, and rank 0's collective ms per engine step averaged over all of the row's steps (its
    prefill and drain included: the timed decode steps alone are not separable from outside)."""
    group = eng.runner.tp
    c0 = group.collective_s if group is not None else 0.0
    n = [0]
    step = eng.step

    def counted():
        n[0] += 1
        return step()

    eng.step = counted
    try:
        r = time_decode(eng, B, prompt_len, steps, seed=B, dev=dev)
    finally:
        eng.step = step
    spent = (group.collective_s - c0) if group is not None else 0.0
    return {**r, "tok_s": B / r["step_ms"] * 1e3, "coll_ms": spent * 1e3 / max(1, n[0])}


@contextmanager
def _eager(eng):
    """Rank 0 sets its decode graphs aside: every step is sent and run eagerly on every rank."""
    graphs, eng.runner.graphs = eng.runner.graphs, None
    try:
        yield
    finally:
        eng.runner.graphs = graphs


def _greedy(eng, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.error is None, o.error
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def graphs_match_eager(eng, batch: int, prompt_len: int, max_tokens: int) -> dict:
    """Greedy tokens of `batch` random prompts replaying the decode graphs, then eagerly, on the same engine."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, eng.runner.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    before = eng.runner.graphs.replays
    with_graphs = _greedy(eng, prompts, max_tokens, "graphs")
    replays = eng.runner.graphs.replays - before
    assert replays >= max_tokens - 1, f"{replays} decode steps replayed a graph, {max_tokens - 1} expected"
    with _eager(eng):
        eager = _greedy(eng, prompts, max_tokens, "eager")
    bad = [i for i, (a, b) in enumerate(zip(with_graphs, eager)) if a != b]
    assert not bad, f"sequence {bad[0]}: graphs {with_graphs[bad[0]]} vs eager {eager[bad[0]]}"
    return {"sequences": batch, "tokens": batch * max_tokens, "graph_steps": replays}


def run_tp(rec, opts) -> None:
    dev = opts.device
    if dev == "cuda" and not opts.plan:
        n = torch.cuda.device_count()
        if n < 2:
            rec.skip_section(f"{n} GPU")
            return
    real = dev == "cuda" and not opts.smoke and not opts.plan  # --plan: the CUDA run's dtype and batches, tiny dims
    full = real or opts.plan
    cfg, name = (LLAMA_1B, "1B random") if real else (TINY_A, "tiny (1B slot)")
    batches, prompt_len, steps = ((1, 32), 512, 20) if real else ((1, 32), 64, 2) if full else ((1, 2), 16, 3)
    made = rec.run(f"random {name} Llama written", lambda: {"dir": ensure_random_llama(
        Path(opts.work_dir), "llama1b", cfg, dev)})  # the speed section's model, when it wrote it
    if made is None:
        return
    rec.table("tensor parallel decode", COLUMNS)
    kw = dict(dtype="bfloat16" if full else "float32", max_num_seqs=max(batches), device=dev,
              kv_cache_memory_bytes=(4 << 30) if full else (64 << 20), max_model_len=min(cfg["max_position_embeddings"],
                                                                                    4096))
    base: dict[int, float] = {}
    for tp in (1,) if opts.plan else (1, 2):
        holder = {}
        graphs = tp > 1  # TP=1: the eager baseline; TP=2: its graphs, then eager on the same engine

        def start(tp=tp, graphs=graphs):
            holder["eng"], secs = start_engine(made["dir"], graphs, tensor_parallel_size=tp, **kw)
            g = holder["eng"].runner.graphs
            return {"start_s": secs, "graphs": len(g._graphs) if g is not None else 0,
                    "devices": [str(d) for d in (holder["eng"].ranks.devices if holder["eng"].ranks else [dev])]}

        if rec.run(f"TP={tp} engine start" + (" (decode graphs captured on every rank)" if graphs else ""),
                   start) is None:
            continue
        eng = holder.pop("eng")
        try:
            if graphs:
                rec.run(f"TP={tp} greedy tokens: graphs = eager", graphs_match_eager, eng, min(8, kw["max_num_seqs"]),
                        prompt_len // 4, steps + 2)
            for mode in ("graphs", "eager") if graphs else ("eager",):
                for B in batches:
                    with _eager(eng) if mode == "eager" else nullcontext():
                        r = rec.run(f"TP={tp} {mode} decode B={B}", _decode, eng, B, prompt_len, steps, dev)
                    if r is None:
                        continue
                    if tp == 1:
                        base[B] = r["tok_s"]
                    rec.row("tensor parallel decode", [name, tp, mode, B, r["step_ms"], r["tok_s"], r["coll_ms"],
                                                       r["tok_s"] / base[B] if B in base else None])
        finally:
            eng.close()
            del eng
            if dev == "cuda":
                torch.cuda.empty_cache()
