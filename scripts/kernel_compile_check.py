"""Compile every Triton kernel for Ampere (sm_80) and Hopper (sm_90) GPUs without a GPU: catches codegen errors
(unsupported constructs, dot shapes, dtype mixes) that the interpreter lets through.

Run as a script (NOT under TRITON_INTERPRET): the launchers run on CPU tensors, but each kernel launch
is intercepted and compiled with triton.compile for the target instead of being executed.
Exits non-zero on the first failure. Then checks flash-decoding's in-kernel merge in the split decode variants'
PTX: partial stores, barrier, ticket atomic (acq_rel, gpu scope), barrier, the merge's loads (ticket_order).
Usage: python kernel_compile_check.py [bf16] [fp16] [fp32]
scripts/kernel_resources.py compiles the same variants and reports their registers, spills and occupancy.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass

assert os.environ.get("TRITON_INTERPRET") != "1", "compile check needs real @jit functions"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loom.kernels import activation, fp8_gemm, kv_store, lora, moe, norm, quant_gemm, rotary  # noqa: E402
from loom.kernels.kv_fp8 import KV_FP8_STORAGE  # noqa: E402
from loom.kernels.kv_layout import kv_cache_shape  # noqa: E402

# loom.kernels re-exports functions of the same names as these modules: import the modules by path
pda = importlib.import_module("loom.kernels.paged_decode_attention")
ppa = importlib.import_module("loom.kernels.paged_prefill_attention")

_TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
       torch.int64: "*i64", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}
TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Variant:
    """One compiled kernel: what launched it (group, dtype name), its constexprs and launch options, the target, and
    triton's CompiledKernel (metadata.shared, asm["cubin"], ...)."""
    kernel: str
    group: str
    dtype: str
    target: GPUTarget
    consts: dict
    num_warps: int
    num_stages: int
    compiled: object
    maxnreg: int | None = None  # the launch's register cap, if it set one


compiled: list[Variant] = []
targets = list(TARGETS)  # the targets launches compile for (kernel_resources.py may narrow it)
_launching = {"group": "", "dtype": ""}


class _Compiler:
    """Stands in for a @jit kernel: kernel[grid](*args, **kw) compiles instead of launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, maxnreg=None, **kw):
            names = self.fn.arg_names
            bound = dict(zip(names, args)) | kw
            sig, consts = {}, {}
            for p, name in zip(self.fn.params, names):
                v = bound[name]
                if p.is_constexpr:
                    sig[name], consts[name] = "constexpr", v
                elif isinstance(v, torch.Tensor):
                    sig[name] = _TY[v.dtype]
                elif isinstance(v, bool):
                    sig[name] = "i1"
                elif isinstance(v, int):
                    sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                elif isinstance(v, float):
                    sig[name] = "fp32"
                else:
                    raise TypeError(f"{name}: {type(v)}")
            options = {"num_warps": num_warps, "num_stages": num_stages}
            if maxnreg is not None:
                options["maxnreg"] = maxnreg
            for target in targets:
                k = triton.compile(ASTSource(self.fn, sig, consts), target=target, options=options)
                compiled.append(Variant(self.fn.__name__, _launching["group"], _launching["dtype"], target, consts,
                                        num_warps, num_stages, k, maxnreg))
        return launch


for mod in (kv_store, activation, norm, rotary, lora, moe, pda, ppa, quant_gemm, fp8_gemm):
    for k, v in list(vars(mod).items()):
        if isinstance(v, triton.runtime.jit.JITFunction) and k.endswith("_kernel"):  # launched ones only
            setattr(mod, k, _Compiler(v))

# Launch groups: each calls the launchers the way serving does (the default tile choices) or as the cases force them.
# Serving head dims, with their GQA group: 64 (SmolLM2, 3), 128 (Llama-3 8B, 4), 256 (Gemma 2, 2).
SERVING_HEADS = ((128, 4, 16), (64, 3, 32), (256, 2, 16))
T, KVH = 4, 8


def _small(dt):
    kc = torch.zeros(8, 16, KVH, 128, dtype=dt)
    kv_store.store_kv_triton(torch.zeros(T, KVH, 128, dtype=dt), torch.zeros(T, KVH, 128, dtype=dt), kc,
                             kc.clone(), torch.zeros(T, dtype=torch.int64))
    activation.silu_and_mul_triton(torch.zeros(T, 256, dtype=dt))
    norm.fused_add_rms_norm_triton(torch.zeros(T, 96, dtype=dt), torch.zeros(T, 96, dtype=dt),
                                   torch.zeros(96, dtype=dt), 1e-5)
    norm.fused_add_rms_norm_triton(torch.zeros(T, 96, dtype=dt), None, torch.zeros(96, dtype=dt), 1e-5)
    pos = torch.zeros(T, dtype=torch.int64)
    rotary.rotary_embedding_triton(pos, torch.zeros(T, 9, 64, dtype=dt), torch.zeros(T, 3, 64, dtype=dt),
                                   torch.zeros(16, 64))
    for hd, rot in ((128, 128), (96, 48)):  # full and partial rotary (Phi-3), head dim not a power of two
        kv = torch.zeros(T, KVH, hd, dtype=dt)
        kc = torch.zeros(kv_cache_shape(8, 16, KVH, hd), dtype=dt)
        rotary.rotary_store_kv_triton(pos, torch.zeros(T, 4 * KVH, hd, dtype=dt), kv, kv, torch.zeros(16, rot),
                                      kc, kc.clone(), pos)


def _attention(dt, heads, decode=True, prefill=True, cache_dt=None, **scales):
    """cache_dt: the caches' dtype (the activations' by default; KV_FP8_STORAGE: kv_cache_dtype fp8, with scales)."""
    for hd, grp, bs in heads:
        kc = torch.zeros(kv_cache_shape(8, bs, 2, hd), dtype=cache_dt or dt)
        bt = torch.zeros(2, 16, dtype=torch.int32)  # wide enough for num_splits=4 at every block size
        sl = torch.ones(2, dtype=torch.int32)
        q = torch.zeros(2, 2 * grp, hd, dtype=dt)
        if decode:
            kv, pos = torch.zeros(2, 2, hd, dtype=dt), torch.zeros(2, dtype=torch.int64)
            for ns in (1, 4):  # single pass; flash-decoding (its merge in the same kernel)
                pda.paged_decode_attention_triton(q, kc, kc, bt, sl, 0.1, num_splits=ns, **scales)
                # what the engine's decode rows run: rope and the K/V store inside
                pda.paged_decode_attention_triton(q, kc, kc.clone(), bt, sl, 0.1, num_splits=ns,
                                                  rope_store=(pos, kv, kv, torch.zeros(16, hd), pos), **scales)
        if prefill:
            cu = torch.tensor([0, 1, 2], dtype=torch.int32)
            for mq in (1, 32, 100):  # decode-like rows (block_m 16), short chunks, prompts (the largest block_m)
                ppa.paged_prefill_attention_triton(q, kc, kc, cu, sl, bt, mq, 0.1, **scales)


def _fp8_kv(dt):
    """kv_cache_dtype fp8: e4m3 codes in uint8 caches, encoded / decoded with integer operations (kernels/kv_fp8.py),
    so every target compiles them: the stores (plain, rope-fused) and decode / prefill attention at serving heads."""
    s = dict(k_scale=0.5, v_scale=0.25)
    kc = torch.zeros(kv_cache_shape(8, 16, KVH, 128), dtype=KV_FP8_STORAGE)
    kv, pos = torch.zeros(T, KVH, 128, dtype=dt), torch.zeros(T, dtype=torch.int64)
    kv_store.store_kv_triton(kv, kv, kc, kc.clone(), pos, **s)
    rotary.rotary_store_kv_triton(pos, torch.zeros(T, 4 * KVH, 128, dtype=dt), kv, kv, torch.zeros(16, 128), kc,
                                  kc.clone(), pos, **s)
    _attention(dt, SERVING_HEADS, cache_dt=KV_FP8_STORAGE, **s)


def _moe(dt):
    for T_, E, K in ((3, 8, 2), (200, 8, 2), (300, 8, 2)):  # fused MoE: 16-, 32- and 64-row tiles
        x, ids = torch.zeros(T_, 128, dtype=dt), torch.zeros(T_, K, dtype=torch.int64)
        moe.fused_moe_triton(x, torch.zeros(E, 192, 128, dtype=dt), torch.zeros(E, 128, 96, dtype=dt),
                             torch.zeros(T_, K), ids)


def _lora(dt):
    import harness.kernel_cases as kcases

    meta, R, _ = kcases.make_lora_meta(20, [1, 8, 64], "cpu")
    x = torch.zeros(20, 128, dtype=dt)
    for sk in (1, 2):
        buf = lora.lora_shrink_triton(x, torch.zeros(3, R, 128, dtype=dt), meta, split_k=sk)
    lora.lora_expand_triton(buf, torch.zeros(R, 128, dtype=dt), [0, 64, 96, 128], meta,
                            torch.zeros(20, 128, dtype=dt))
    meta, R, _ = kcases.make_lora_meta(4, [1, 8, 64], "cpu")  # decode: the fused shrink + expand
    lora.lora_apply_triton(torch.zeros(4, 128, dtype=dt), torch.zeros(4, 128, dtype=dt),
                           torch.zeros(3, R, 128, dtype=dt), torch.zeros(R, 128, dtype=dt), [0, 64, 96, 128], meta)


def _quant_a16(dt):
    from harness.quant_checkpoints import launch_quant_kernels

    launch_quant_kernels(dt, a16=True, w8a8=False)  # int4 / int8 / fp8 weight-only: every target


def _quant_w8a8(dt):
    """FP8 W8A8 needs FP8 tensor cores: compiled for the sm_89+ targets only (fp8_gemm.check_w8a8 refuses below)."""
    from harness.quant_checkpoints import launch_quant_kernels

    saved = targets[:]
    targets[:] = [t for t in saved if t.arch >= 89]
    try:
        launch_quant_kernels(dt, a16=False, w8a8=True)
    finally:
        targets[:] = saved


GROUPS = {
    "small": _small,  # store_kv, activations, norm, rotary
    "decode": lambda dt: _attention(dt, SERVING_HEADS, prefill=False),
    "prefill": lambda dt: _attention(dt, SERVING_HEADS, decode=False),
    "attention_edge": lambda dt: _attention(dt, ((8, 2, 16),)),  # head_dim 8: tl.dot K >= 16 by padding
    "moe": _moe,
    "lora": _lora,
    "quant_a16": _quant_a16,  # quantized GEMMs, weight-only (W4A16 / W8A16 / FP8 A16)
    "quant_w8a8": _quant_w8a8,  # FP8 W8A8: dynamic activation quantisation + fp8 dot (sm_90 only here)
    "fp8_kv": _fp8_kv,  # kv_cache_dtype fp8: KV stores and paged attention over e4m3 codes
}
SERVING = ("decode", "prefill", "moe")  # the kernels whose registers and spills matter for throughput


def launch(dtype_names=("bf16", "fp16", "fp32"), groups=tuple(GROUPS)):
    """Compile the groups' variants for `targets` in each dtype; returns the new entries of `compiled`."""
    first = len(compiled)
    for name in dtype_names:
        for g in groups:
            _launching.update(group=g, dtype=name)
            GROUPS[g](DTYPES[name])
    return compiled[first:]


_TICKET = re.compile(r"\batom\.global\.(?:gpu\.acq_rel|acq_rel\.gpu)\.add\.u32\b")


def ticket_order(ptx: str) -> str | None:
    """Flash-decoding's merge (kernels/paged_decode_attention.py) in a split decode variant's PTX, in emitted order:
    the partial stores, a CTA barrier, then the one ticket atomic with acq_rel semantics at gpu scope (it releases
    what every thread of the CTA stored), then a barrier before the merge's loads (acquired by the ticket).
    -> None when so, else what is wrong."""
    lines = [line.split("//")[0].strip() for line in ptx.splitlines()]
    tickets = [i for i, line in enumerate(lines) if _TICKET.search(line)]
    atoms = [i for i, line in enumerate(lines) if re.search(r"\batom\.", line)]
    if len(tickets) != 1 or atoms != tickets:
        return f"want one atom.global.gpu.acq_rel.add.u32 (the ticket), found {[lines[i] for i in atoms]}"
    t = tickets[0]

    def last(pattern, lo, hi):
        return max((i for i in range(lo, hi) if re.search(pattern, lines[i])), default=None)

    def first(pattern, lo, hi):
        return min((i for i in range(lo, hi) if re.search(pattern, lines[i])), default=None)

    store = last(r"\bst\.global\b", 0, t)
    if store is None or last(r"\bbar\.sync\b", store, t) is None:
        return "no bar.sync between the partial stores and the ticket"
    load = first(r"\bld\.global\b", t, len(lines))
    if load is None or first(r"\bbar\.sync\b", t, load) is None:
        return "no bar.sync between the ticket and the merge's loads"
    return None


def check_ticket_order(variants) -> int:
    """ticket_order for every split decode variant compiled; raises on the first that fails -> how many."""
    n = 0
    for v in variants:
        if v.kernel == "_decode_kernel" and v.consts.get("SPLIT"):
            bad = ticket_order(v.compiled.asm["ptx"])
            if bad:
                raise AssertionError(f"_decode_kernel sm_{v.target.arch} {v.dtype} {v.consts}: {bad}")
            n += 1
    return n


def _compile_for(arch: int, dtype_names) -> tuple[int, int]:
    """One target's share (a forked process): -> (variants compiled, split decode variants whose ticket order was
    checked)."""
    targets[:] = [t for t in TARGETS if t.arch == arch]
    launch(dtype_names)
    return len(compiled), check_ticket_order(compiled)


def main(argv):
    t0 = time.time()
    dtype_names = argv or tuple(DTYPES)
    # one process per target where there are cores for it (a compile is one thread): the two targets' variants
    # compile side by side; forked after the imports, so each starts warm
    if len(os.sched_getaffinity(0)) > 1:
        with multiprocessing.get_context("fork").Pool(len(TARGETS)) as pool:
            counts = pool.starmap(_compile_for, [(t.arch, dtype_names) for t in TARGETS])
        total, n = (sum(c) for c in zip(*counts))
    else:
        launch(dtype_names)
        total, n = len(compiled), check_ticket_order(compiled)
    print(f"compiled {total} kernel variants for sm_80 and sm_90 in {time.time() - t0:.0f}s")
    assert n, "no split decode variant compiled"
    print(f"flash-decoding ticket order in the PTX of {n} split decode variants: partial stores, bar.sync, "
          "atom.global.gpu.acq_rel.add, bar.sync, merge loads")


if __name__ == "__main__":
    main(sys.argv[1:])
