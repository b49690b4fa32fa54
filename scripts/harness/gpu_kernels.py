"""gpu_check sections `kernels` and `kernel_grid`: every Triton kernel against its PyTorch reference on the device.

In float32, float16 and bfloat16 on CUDA and in --plan (float32 under the interpreter in --cpu-smoke). kernels:
serving shapes (Llama-8B/1B heads, contexts up to 16k, 2048-token prefill chunks, 4096-wide norms, rank-64 LoRA)
and sequences whose blocks sit at the top of a cache of more than 2^31 elements (int64 address arithmetic).
kernel_grid: the CPU test grid (harness.kernel_cases.CASES) in bf16. Each check compares against the reference in
float32 on the same rounded inputs (harness.kernel_cases.TOL) and fails on any unwritten (NaN-poisoned) output element.
"""
from __future__ import annotations

import torch

import harness.kernel_cases as kc

TOP_OF_GPU = (1 << 31) + (1 << 22)  # elements per K (and V) tensor: offsets past 2^31


def serving_cases(smoke: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    lens = lambda n, hi: torch.randint(1, hi + 1, (n,), generator=g).tolist()  # noqa: E731
    if smoke:
        return {
            "store_kv": (kc.check_store_kv, [dict(T=24, kvh=2, d=32, block_size=16, num_blocks=4)]),
            "decode": (kc.check_decode, [dict(seq_lens=lens(3, 40), heads=8, kvh=2, d=32, block_size=16)]),
            "prefill": (kc.check_prefill, [dict(q_and_seq_lens=[(20, 20), (8, 40)], heads=4, kvh=2, d=32,
                                                block_size=16)]),
            "norm": (kc.check_norm, [dict(T=8, n=256)]),
            "rotary": (kc.check_rotary, [dict(T=8, heads=4, kvh=2, d=32, max_pos=64)]),
            "silu_and_mul": (kc.check_silu, [dict(T=4, inter=256)]),
            "lora_shrink": (kc.check_lora_shrink, [dict(num_tokens=24, ranks=(4, 16), k_in=64, n_slices=3)]),
            "lora_expand": (kc.check_lora_expand, [dict(num_tokens=24, ranks=(4, 16), out_sizes=(64, 32, 32))]),
        }
    return {
        "store_kv": (kc.check_store_kv, [dict(T=2048, kvh=8, d=128, block_size=16, num_blocks=160)]),
        "decode": (kc.check_decode, [
            dict(seq_lens=lens(64, 4096), heads=32, kvh=8, d=128, block_size=16),  # 8B heads, one pass
            dict(seq_lens=[16384, 9000, 1, 12000], heads=32, kvh=8, d=128, block_size=16),  # few long: split
            dict(seq_lens=lens(32, 2048), heads=32, kvh=8, d=64, block_size=16),  # 1B heads
        ]),
        "prefill": (kc.check_prefill, [
            # a whole prompt, a chunk in the middle of a long prompt, a decode row, a short prompt
            dict(q_and_seq_lens=[(1024, 1024), (512, 2048), (1, 3000), (300, 300)], heads=32, kvh=8, d=128,
                 block_size=16),
            dict(q_and_seq_lens=[(2048, 2048)], heads=32, kvh=8, d=64, block_size=16),
        ]),
        "norm": (kc.check_norm, [dict(T=2048, n=4096), dict(T=2048, n=2048, residual=False)]),
        "rotary": (kc.check_rotary, [dict(T=2048, heads=32, kvh=8, d=128, max_pos=8192),
                                     dict(T=512, heads=32, kvh=8, d=64, max_pos=8192)]),
        "silu_and_mul": (kc.check_silu, [dict(T=512, inter=14336)]),
        "lora_shrink": (kc.check_lora_shrink, [dict(num_tokens=256, ranks=(8, 16, 32, 64), k_in=4096, n_slices=3)]),
        "lora_expand": (kc.check_lora_expand, [dict(num_tokens=256, ranks=(8, 16, 32, 64),
                                                    out_sizes=(4096, 1024, 1024))]),
    }


def top_cases(smoke: bool) -> dict:
    top = 1 << 16 if smoke else TOP_OF_GPU
    shape = dict(heads=8, kvh=2, d=32) if smoke else dict(heads=32, kvh=8, d=128)
    long, q = (60, (20, 60)) if smoke else (2000, (100, 300))
    return {
        "decode": (kc.check_decode, [dict(seq_lens=[long // 2, 17, 1], block_size=16, top_of=top, **shape),
                                     dict(seq_lens=[long, 70], block_size=16, num_splits=4, top_of=top, **shape)]),
        "prefill": (kc.check_prefill, [dict(q_and_seq_lens=[q, (33, 33)], block_size=16, top_of=top, **shape)]),
        "store_kv": (kc.check_store_kv_top, [dict(T=32, kvh=shape["kvh"], d=shape["d"], block_size=16, top_of=top)]),
    }


def run(rec, opts) -> None:
    """Section `kernels`: serving shapes and the top of a large cache."""
    _grids(rec, opts, [("serving", serving_cases(opts.smoke)), ("top of cache", top_cases(opts.smoke))], seed0=1000)


def run_grid(rec, opts) -> None:
    """Section `kernel_grid`: the CPU test grid in bf16, the serving dtype (its own process: compiles run side by
    side). In all three dtypes it is 3x the compiles; `LOOM_TEST_DEVICE=cuda pytest tests/kernels` runs those."""
    grid = kc.CASES
    if opts.smoke and not opts.plan:  # tests/kernels runs this grid on CPU; one kernel keeps the interpreter short
        grid = {"norm": kc.CASES["norm"]}
    _grids(rec, opts, [("test grid", grid)], seed0=0, dtypes=[torch.bfloat16])


def _grids(rec, opts, grids, seed0: int, dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> None:
    dev = opts.device
    dtypes = [torch.float32] if opts.smoke and not opts.plan else list(dtypes)
    names = [str(dt).split(".")[-1] for dt in dtypes]
    rec.table("largest relative error per kernel", ["grid", "kernel", *names])
    seed = seed0
    for label, cases in grids:
        for kernel, (check, case_list) in cases.items():
            worst = {}
            for i, case in enumerate(case_list):
                for dt, dname in zip(dtypes, names):
                    seed += 1
                    r = rec.run(f"{label} {kernel}[{i}] {dname}", _checked, check, dt, dev, case, seed)
                    if r is None:
                        worst[dname] = "FAIL"
                    elif worst.get(dname) != "FAIL":
                        worst[dname] = max(worst.get(dname, 0.0), r["rel_err"])
                    if dev == "cuda":
                        torch.cuda.empty_cache()  # the top-of-cache tensors are 8-17 GB each
            rec.row("largest relative error per kernel", [label, kernel, *(worst.get(n) for n in names)])
    if dev == "cuda":
        rec.metric("peak_allocated_gib", torch.cuda.max_memory_allocated() / 2**30)


def _checked(check, dtype, device, case, seed) -> dict:
    torch.manual_seed(seed)
    err = check(dtype, device, **case)
    if device == "cuda":
        torch.cuda.synchronize()  # an asynchronous fault surfaces in this check, not the next
    return {"rel_err": err, "seed": seed}
