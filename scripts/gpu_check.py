#!/usr/bin/env python
"""GPU check for loom's Triton kernels: correctness in bf16/fp16, bandwidth, and a decode-step timing.

    python scripts/gpu_check.py              # on a CUDA machine (< 8 minutes); prints a table last
    python scripts/gpu_check.py --cpu-smoke  # CI: the same code path on tiny sizes with the references

1. every case of tests/kernels/kcases.py (the CPU test grid) in bfloat16 and float16, Triton vs reference;
2. each kernel timed with triton.testing.do_bench (median) at serving-sized shapes, reported as GB/s of
   its compulsory traffic and as a fraction of a measured device-to-device copy bandwidth;
3. time_decode_step(): one decode step of the default model and of a random-weight 1B-class Llama.
Without CUDA (and without --cpu-smoke) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

T0 = time.time()
BUDGET_S = 7 * 60  # stop starting new sections past this, to finish under 8 minutes


def bench_ms(fn, device):
    """Median time of fn in ms: do_bench on CUDA, a plain timer on CPU (smoke mode)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def copy_bandwidth_gbs(device, nbytes):
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), device)
    return 2 * nbytes / ms / 1e6  # read + write


# ---------------------------------------------------------------------------------------------
# 1. correctness


def run_correctness(device, dtypes, only=None):
    import harness.kernel_cases as kcases

    results = []
    for name, (check, cases) in kcases.CASES.items():
        if only and name not in only:
            continue
        for i, case in enumerate(cases):
            for dt in dtypes:
                torch.manual_seed(1000 + i)
                try:
                    err = check(dt, device, **case)
                    results.append((f"{name}[{i}]", str(dt).split(".")[-1], "ok", err))
                except Exception as e:  # noqa: BLE001 - report every failure, keep going
                    results.append((f"{name}[{i}]", str(dt).split(".")[-1], "FAIL", str(e).splitlines()[0][:100]))
    return results


# ---------------------------------------------------------------------------------------------
# 2. kernel benchmarks


def bench_specs(device, dtype, tiny):
    """(name, shape, fn, bytes moved, flops) for each kernel at serving-sized (or tiny) shapes."""
    import harness.kernel_cases as kcases
    from loom.kernels import activation, kv_store, lora, norm, rotary
    from loom.kernels.paged_decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
    from loom.kernels.paged_prefill_attention import paged_prefill_attention_ref, paged_prefill_attention_triton

    impl = "ref" if device != "cuda" else "triton"
    pick = lambda mod, base: getattr(mod, f"{base}_{impl}")  # noqa: E731
    decode_fn = paged_decode_attention_ref if impl == "ref" else paged_decode_attention_triton
    prefill_fn = paged_prefill_attention_ref if impl == "ref" else paged_prefill_attention_triton
    es = torch.tensor([], dtype=dtype).element_size()
    r = lambda *s: torch.randn(*s, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    if tiny:
        T, N, I, H, KVH, D, BS = 8, 64, 64, 4, 2, 32, 16
        dec_cfgs = [(2, 48, "decode")]
        pre_cfg = (2, 32)
        K_IN, OUTS, RANKS, T_LORA = 64, (64, 32, 32), [4, 8], 8
    else:
        T, N, I, H, KVH, D, BS = 4096, 4096, 14336, 32, 8, 128, 16
        dec_cfgs = [(64, 2048, "decode b64 ctx2k"), (4, 16384, "decode b4 ctx16k (split)")]
        pre_cfg = (4, 2048)
        K_IN, OUTS, RANKS, T_LORA = 4096, (4096, 1024, 1024), [8, 16, 32, 64], 256
    specs = []

    # store_kv
    k, v = r(T, KVH, D), r(T, KVH, D)
    nblk = (T + BS - 1) // BS + 1
    kc, vc = r(nblk, BS, KVH, D), r(nblk, BS, KVH, D)
    slots = torch.randperm(nblk * BS, device=device)[:T]
    fn = pick(kv_store, "store_kv")
    specs.append(("store_kv", f"T={T} KVH={KVH} D={D}", lambda fn=fn: fn(k, v, kc, vc, slots), 4 * T * KVH * D * es, 0))

    # decode attention: K/V of every context token read once
    for B, ctx, label in dec_cfgs:
        nb = (ctx + BS - 1) // BS
        kcd, vcd = r(B * nb + 1, BS, KVH, D), r(B * nb + 1, BS, KVH, D)
        bt = torch.randperm(B * nb + 1, device=device)[:B * nb].view(B, nb).to(torch.int32)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=device)
        q = r(B, H, D)
        specs.append((label, f"B={B} ctx={ctx} H={H}/{KVH} D={D}",
                      (lambda q=q, kcd=kcd, vcd=vcd, bt=bt, sl=sl: decode_fn(q, kcd, vcd, bt, sl, D ** -0.5)),
                      2 * B * ctx * KVH * D * es + 2 * B * H * D * es, 4 * B * H * ctx * D))

    # prefill attention: S fresh prompts of L tokens (compute-bound; GB/s is of compulsory traffic)
    S, L = pre_cfg
    nb = (L + BS - 1) // BS
    kcp, vcp = r(S * nb, BS, KVH, D), r(S * nb, BS, KVH, D)
    btp = torch.randperm(S * nb, device=device).view(S, nb).to(torch.int32)
    slp = torch.full((S,), L, dtype=torch.int32, device=device)
    cu = torch.arange(0, S + 1, device=device, dtype=torch.int32) * L
    qp = r(S * L, H, D)
    specs.append(("prefill", f"S={S} L={L} H={H}/{KVH} D={D}",
                  lambda: prefill_fn(qp, kcp, vcp, cu, slp, btp, L, D ** -0.5),
                  2 * S * L * (H + KVH) * D * es, 2 * S * H * L * L * D))  # causal: half of 4*L*L*D

    x, res, w = r(T, N), r(T, N), r(N)
    fn = pick(norm, "fused_add_rms_norm")
    specs.append(("fused_add_rms_norm", f"T={T} N={N}", lambda fn=fn: fn(x, res, w, 1e-5), 5 * T * N * es, 0))

    q, kk = r(T, H, D), r(T, KVH, D)
    pos = torch.randint(0, 4096, (T,), device=device)
    cs = kcases.cos_sin_cache(4096, D, device)
    fn = pick(rotary, "rotary_embedding")
    specs.append(("rotary_embedding", f"T={T} H={H}/{KVH} D={D}", lambda fn=fn: fn(pos, q, kk, cs),
                  2 * T * (H + KVH) * D * es, 0))

    xa = r(T // 4 if not tiny else T, 2 * I)
    fn = pick(activation, "silu_and_mul")
    specs.append(("silu_and_mul", f"T={xa.shape[0]} I={I}", lambda fn=fn: fn(xa), 3 * xa.shape[0] * I * es, 0))

    # LoRA: T_LORA tokens over adapters of several ranks, three slices (qkv)
    meta, R, _ = kcases.make_lora_meta(T_LORA + 16, RANKS, device)
    xl = r(T_LORA + 16, K_IN)
    a = r(len(OUTS), R, K_IN)
    offs = [0] + torch.tensor(OUTS).cumsum(0).tolist()
    bmat, y = r(R, offs[-1]), r(T_LORA + 16, offs[-1])
    shrink, expand = pick(lora, "lora_shrink"), pick(lora, "lora_expand")
    buf = shrink(xl, a, meta)
    nt = meta.token_indices.shape[0]
    specs.append(("lora_shrink", f"T={nt} in={K_IN} ranks={RANKS} x{len(OUTS)}", lambda: shrink(xl, a, meta),
                  (nt * K_IN + len(OUTS) * sum(RANKS) * K_IN) * es, 2 * nt * K_IN * len(OUTS) * max(RANKS)))
    specs.append(("lora_expand", f"T={nt} out={offs[-1]} ranks={RANKS}", lambda: expand(buf, bmat, offs, meta, y),
                  (2 * nt * offs[-1] + sum(RANKS) * offs[-1]) * es, 2 * nt * offs[-1] * max(RANKS)))
    return specs


# ---------------------------------------------------------------------------------------------
# 3. decode step timing (hook: the engine is developed separately; failures are reported, not fatal)

LLAMA_1B = dict(  # Llama-3.2-1B shapes
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
)


def make_random_llama_dir(cfg: dict, path: Path) -> Path:
    """A model folder (config.json + random bf16 safetensors, HF names, no tokenizer)."""
    from safetensors.torch import save_file

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dt = getattr(torch, cfg.get("torch_dtype", "bfloat16"))
    w = lambda *s: (torch.randn(*s, device=dev) * 0.02).to(dt).cpu()  # noqa: E731
    one = lambda n: torch.ones(n, dtype=dt)  # noqa: E731
    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": one(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(nq * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
                  p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nq * hd),
                  p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter),
                  p + "input_layernorm.weight": one(h), p + "post_attention_layernorm.weight": one(h)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def time_decode_step(model_dir_or_config, batch_sizes=(1, 32), prompt_len=128, steps=20, dtype="bfloat16"):
    """HOOK: median wall time of one engine decode step per batch size -> {B: ms}.

    model_dir_or_config: a model folder ("" = the default model) or a HF config dict (random weights).
    Imports loom.engine.llm_engine lazily; raises whatever the engine raises (the caller reports it).
    """
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.sampling_params import SamplingParams

    tmp = None
    if isinstance(model_dir_or_config, dict):
        tmp = tempfile.TemporaryDirectory()
        model_dir = str(make_random_llama_dir(model_dir_or_config, Path(tmp.name) / "model"))
    else:
        model_dir = model_dir_or_config
    try:
        res = {}
        eng = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_num_seqs=max(batch_sizes),
                                     max_model_len=2048, gpu_memory_utilization=0.5), load_tokenizer=False)
        params = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.0)
        for B in batch_sizes:  # one engine (one weight load), one batch after the other
            ids = [f"b{B}r{i}" for i in range(B)]
            for i, rid in enumerate(ids):
                eng.add_request(rid, [(7 * i + j) % 1000 + 10 for j in range(prompt_len)], params)
            started = set()
            while len(started) < B:  # prefill everyone first
                started.update(o.request_id for o in eng.step() if o.new_token_ids)
            for _ in range(3):
                eng.step()
            ts = []
            for _ in range(steps):
                t = time.perf_counter()
                eng.step()  # returns sampled tokens to the host, so it is synchronous
                ts.append((time.perf_counter() - t) * 1e3)
            res[B] = statistics.median(ts)
            for rid in ids:
                eng.abort_request(rid)
            while eng.has_unfinished_requests():
                eng.step()
        del eng
        return res
    finally:
        if tmp is not None:
            tmp.cleanup()


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run the plumbing on CPU with tiny sizes and the references")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--model-dir", default="", help="model for the decode timing ('' = the default model; with "
                    "--cpu-smoke: a tiny random Llama)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("no CUDA device present: nothing to check (use --cpu-smoke to exercise the script on CPU)")
        return 0
    device = "cpu" if args.cpu_smoke else "cuda"
    tiny = args.cpu_smoke
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}", flush=True)

    # 1. correctness (CPU smoke: only where the interpreter was selected, on two cheap kernels)
    if device == "cuda":
        corr = run_correctness("cuda", [torch.bfloat16, torch.float16])
    elif os.environ.get("TRITON_INTERPRET") == "1":
        corr = run_correctness("cpu", [torch.float32], only={"silu_and_mul", "norm"})
    else:
        corr = []
    for row in corr:
        if row[2] != "ok":
            print("FAIL", *row, flush=True)
    print(f"correctness: {sum(r[2] == 'ok' for r in corr)}/{len(corr)} ok ({time.time() - T0:.0f}s)", flush=True)

    failures: list[str] = []  # any failed section makes the script exit non-zero

    # 2. bandwidth
    copy_gbs = copy_bandwidth_gbs(device, (1 << 20) if tiny else (1 << 30))
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    dtypes = [torch.float32] if tiny else [torch.bfloat16]
    for dt in dtypes:
        for name, shape, fn, nbytes, flops in bench_specs(device, dt, tiny):
            if time.time() - T0 > BUDGET_S:
                print(f"time budget reached, skipping {name}")
                continue
            try:
                ms = bench_ms(fn, device)
                gbs = nbytes / ms / 1e6
                rows.append((name, shape, ms, gbs, gbs / copy_gbs, flops / ms / 1e9 if flops else 0.0))
            except Exception as e:  # noqa: BLE001
                print(f"bench {name} failed: {e!r}")
                traceback.print_exc()
                failures.append(f"bench {name}")

    # 3. decode step
    decode_rows = []
    if tiny and args.model_dir:  # the smoke run on a model of the user's
        targets = [("model", args.model_dir)]
        kw = dict(batch_sizes=(1, 2), prompt_len=8, steps=2, dtype="float32")
    elif tiny:  # the hook's code path on a tiny random Llama
        targets = [("tiny random Llama", dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               vocab_size=1000, torch_dtype="float32", bos_token_id=1, eos_token_id=2))]
        kw = dict(batch_sizes=(1, 2), prompt_len=8, steps=2, dtype="float32")
    else:
        targets = [("default model", args.model_dir), ("random Llama 1B", LLAMA_1B)]
        kw = {}
    if args.skip_engine:
        print("engine timing skipped")
    else:
        for label, target in targets:
            if time.time() - T0 > BUDGET_S - 60:
                print(f"time budget reached, skipping decode step of {label}")
                continue
            try:
                for B, ms in time_decode_step(target, **kw).items():
                    decode_rows.append((label, B, ms))
            except Exception as e:  # noqa: BLE001
                print(f"decode step of {label} failed: {e!r}")
                traceback.print_exc()
                failures.append(f"decode step {label}")

    # table last
    print()
    print(f"{'kernel':<26}{'shape':<44}{'ms':>9}{'GB/s':>9}{'of copy':>9}{'TFLOP/s':>9}")
    for name, shape, ms, gbs, frac, tf in rows:
        print(f"{name:<26}{shape:<44}{ms:>9.4f}{gbs:>9.1f}{frac:>9.0%}{tf:>9.1f}")
    print(f"{'copy bandwidth':<26}{'':<44}{'':>9}{copy_gbs:>9.0f}{1:>9.0%}")
    for label, B, ms in decode_rows:
        print(f"decode step {label:<14} B={B:<4}{ms:>10.2f} ms  ({B / ms * 1e3:.0f} tok/s)")
    bad = [r for r in corr if r[2] != "ok"]
    print(f"correctness: {len(corr) - len(bad)}/{len(corr)} ok; total {time.time() - T0:.0f}s")
    if failures:
        print(f"FAILED sections: {', '.join(failures)}")
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
