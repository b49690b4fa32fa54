#!/usr/bin/env python3
"""What multi-LoRA costs on CPU against what its bytes and FLOPs allow, for one decode step of the default model.

Every LoRA-capable linear layer of the model (per layer: q|k|v, o, gate|up, down as the engine packs them), each
with its own packed weight and its own adapter pools, `--adapters` adapters of rank `--rank` on all seven
projections, `--tokens` decode tokens (one per sequence):

    gemms        the layers' GEMMs alone (what a step without adapters computes in its linear layers)
    one          every token on one adapter (each layer reads its rows once for all the tokens)
    distinct     every token on its own adapter (each token reads its adapter's A and B rows of every layer)

Scenarios alternate round by round (`--rounds`, best of each). The floor of a scenario's added time is
max(adapter bytes it must read / the streaming bandwidth measured here, its FLOPs / the rate the GEMMs reached);
`added / floor` near 1 means the adapter path costs what its bytes or FLOPs are. In the distinct scenario the GEMM's
tiles fetch the adapter rows while they compute (kernels/csrc/gemm.cpp, gemm_with_pass), so the added time can be
below the bytes' floor where the GEMMs leave bandwidth unused.

    python scripts/bench_lora_floor.py                       # default model, 32 tokens, rank 16, one thread
    python scripts/bench_lora_floor.py --tokens 64 --rank 8
    python scripts/bench_lora_floor.py --pool-dtype bfloat16  # 16-bit pools: half the bytes to read
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from harness import bench as hb
from harness.adapter_cost import lora_cost, model_spec, stream_gbps


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model folder (config.json only is read); default: the default model")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens in the step")
    ap.add_argument("--adapters", type=int, default=0, help="adapters of the distinct scenario (0: one per token)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the adapter pools' element type (lora_dtype)")
    ap.add_argument("--json", default="", help="write the results here too")
    return ap.parse_args(argv)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    from loom.engine.worker.cpu import keep_freed_memory, set_compute_threads, tune_mkl_for_amd
    from loom.kernels.cpu_linear import PackedWeight
    from loom.layers.forward_context import LoraBatchMeta

    tune_mkl_for_amd()
    keep_freed_memory()  # as the engine: the pass's per-call scratch is reused, not mapped and zeroed each call
    threads = set_compute_threads(args.threads)
    model = Path(args.model or hb.default_model_dir())
    config = json.loads((model / "config.json").read_text())
    T, r = args.tokens, args.rank
    G = args.adapters or T
    if T < 1 or r < 1 or G < 1 or T % G:
        raise SystemExit("--tokens, --rank and --adapters must be >= 1, and --tokens a multiple of --adapters")
    spec = model_spec(config, args.layers)
    n_layers = spec.num_layers
    hb.progress(f"{model.name}: {n_layers} layers x {[g.name for g in spec.groups]}, {T} tokens, rank {r}, "
                f"{G} adapters ({args.pool_dtype} pools), {threads} thread(s)")
    g, pool_dtype = torch.Generator().manual_seed(0), getattr(torch, args.pool_dtype)
    layers = []
    pool_rows = r * G  # every adapter's rank rows, adapter i at rows [i * rank, (i + 1) * rank)
    for _ in range(n_layers):
        for grp in spec.groups:
            k_in, n_out = grp.in_features, grp.out_features
            layers.append((PackedWeight(torch.randn(n_out, k_in, generator=g) * 0.02),
                           (torch.randn(grp.num_slices, pool_rows, k_in, generator=g) * 0.02).to(pool_dtype),
                           (torch.randn(pool_rows, n_out, generator=g) * 0.02).to(pool_dtype),
                           tuple(grp.slice_offsets), k_in))
    xs = {k: torch.randn(T, k, generator=g) for k in {grp.in_features for grp in spec.groups}}

    def meta(groups: int) -> LoraBatchMeta:
        per = T // groups
        return LoraBatchMeta(token_indices=torch.arange(T),
                             seg_starts=torch.arange(0, T + 1, per, dtype=torch.int32),
                             row_start=torch.arange(groups, dtype=torch.int32) * r,
                             ranks=torch.full((groups,), r, dtype=torch.int32), scalings=torch.ones(groups),
                             max_rank=r, max_seg_len=per, ranks_cpu=[r] * groups)

    metas = {"one": meta(1), "distinct": meta(G)}

    def run(name: str) -> None:
        if name == "gemms":
            for pw, _, _, _, k_in in layers:
                pw(xs[k_in])
        else:
            m = metas[name]
            for pw, a, b, offs, k_in in layers:
                pw.with_lora(xs[k_in], a, b, offs, m)

    names = ("gemms", "one", "distinct")
    for name in names:  # warm-up (kernel build, first touches)
        run(name)
    best = {n: float("inf") for n in names}
    for i in range(args.rounds):
        for name in names:
            best[name] = min(best[name], _timed(lambda: run(name)))
        hb.progress(f"round {i + 1}: " + ", ".join(f"{n} {best[n] * 1e3:.2f} ms" for n in names))
    gbps = stream_gbps()

    gemm_flops, lora_flops, adapter_bytes = lora_cost(spec, T, r, pool_dtype)
    rate = gemm_flops / best["gemms"]
    rows = []
    out = {"machine": hb.machine_info(), "args": vars(args), "stream_gb_s": gbps, "gemm_gflop_s": rate / 1e9,
           "gemms_ms": best["gemms"] * 1e3, "scenarios": {}}
    for name, n_adapters in (("one", 1), ("distinct", G)):
        added = best[name] - best["gemms"]
        nbytes = adapter_bytes * n_adapters
        floor = max(nbytes / (gbps * 1e9), lora_flops / rate)
        rows.append([name, best[name] * 1e3, added * 1e3, best["gemms"] / best[name], nbytes / 1e6,
                     lora_flops / 1e6, floor * 1e3, added / floor])
        out["scenarios"][name] = dict(zip(("ms", "added_ms", "gemms_over_this", "adapter_mb", "lora_mflop",
                                           "floor_ms", "added_over_floor"), rows[-1][1:]))
    print(f"\nGEMMs of all {n_layers} layers, {T} tokens: {best['gemms'] * 1e3:.2f} ms "
          f"({rate / 1e9:.1f} GFLOP/s); streaming read bandwidth here: {gbps:.1f} GB/s")
    print(hb.table(["scenario", "ms", "LoRA added ms", "gemms / this", "adapter MB read", "LoRA MFLOP",
                    "floor ms", "added / floor"], rows))
    if args.json:
        hb.save_json(out, Path(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
