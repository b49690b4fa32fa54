"""gpu_check section `tp`: tensor parallelism on the device, TP=1 against TP=2 on the 1B-class random Llama.

Runs where the device has 2+ GPUs; on one GPU the section reports "skipped: 1 GPU" (not a failure). Each size is
one engine (bf16, ranks on GPUs 0 and 1, NCCL): decode tokens/s at batch 1 and 32 (timed as the speed section's
rows: distinct random 512-token prompts prefilled, then wall-clock steps) and the ms per step rank 0 spends in
collectives (launches on CUDA; the transfers run on the stream). TP=2 steps run eagerly (no CUDA graphs under TP
yet), so TP=1 is measured eager too: the ratio is the parallelism's, not the graphs'. --cpu-smoke runs the same on
CPU (gloo) at tiny shapes; --plan records TP=1's launches only (a worker rank is a process of its own).
"""
from __future__ import annotations

from pathlib import Path

import torch

from harness.gpu_perf import start_engine, time_decode
from harness.random_llama import LLAMA_1B, TINY_A, ensure_random_llama

COLUMNS = ["model", "TP", "B", "step ms", "tok/s", "collectives ms/step", "x TP 1"]


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

        def start(tp=tp):
            holder["eng"], secs = start_engine(made["dir"], False, tensor_parallel_size=tp, **kw)
            return {"start_s": secs, "devices": [str(d) for d in (holder["eng"].ranks.devices
                                                                   if holder["eng"].ranks else [dev])]}

        if rec.run(f"TP={tp} engine start", start) is None:
            continue
        eng = holder.pop("eng")
        try:
            for B in batches:
                r = rec.run(f"TP={tp} eager decode B={B}", _decode, eng, B, prompt_len, steps, dev)
                if r is None:
                    continue
                base.setdefault(B, r["tok_s"])
                rec.row("tensor parallel decode", [name, tp, B, r["step_ms"], r["tok_s"], r["coll_ms"],
                                                   r["tok_s"] / base[B]])
        finally:
            eng.close()
            del eng
            if dev == "cuda":
                torch.cuda.empty_cache()
