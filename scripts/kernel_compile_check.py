"""Compile every Triton kernel for Ampere (sm_80) and Hopper (sm_90) GPUs without a GPU: catches codegen errors
(unsupported constructs, dot shapes, dtype mixes) that the interpreter lets through.

Run as a script (NOT under TRITON_INTERPRET): the launchers run on CPU tensors, but each kernel launch
is intercepted and compiled with triton.compile for the target instead of being executed.
Exits non-zero on the first failure. Usage: python compile_check.py [bf16] [fp16] [fp32]
"""
from __future__ import annotations

import importlib
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") != "1", "compile check needs real @jit functions"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loom.kernels import activation, kv_store, lora, moe, norm, rotary  # noqa: E402

# loom.kernels re-exports functions of the same names as these modules: import the modules by path
pda = importlib.import_module("loom.kernels.paged_decode_attention")
ppa = importlib.import_module("loom.kernels.paged_prefill_attention")

_TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
       torch.int64: "*i64"}
TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))
compiled = []


class _Compiler:
    """Stands in for a @jit kernel: kernel[grid](*args, **kw) compiles instead of launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, **kw):
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
            for target in TARGETS:
                triton.compile(ASTSource(self.fn, sig, consts), target=target,
                               options={"num_warps": num_warps, "num_stages": num_stages})
                compiled.append(self.fn.__name__)
        return launch


for mod in (kv_store, activation, norm, rotary, lora, moe, pda, ppa):
    for k, v in list(vars(mod).items()):
        if isinstance(v, triton.runtime.jit.JITFunction) and k.endswith("_kernel"):  # launched ones only
            setattr(mod, k, _Compiler(v))


def main(argv):
    import harness.kernel_cases as kcases

    names = argv or ["bf16", "fp16", "fp32"]
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[n] for n in names]
    t0 = time.time()
    for dt in dtypes:
        # serving-like shapes hit the default tile choices; the cases hit the forced ones
        T, KVH, D, BS = 4, 8, 128, 16
        kc = torch.zeros(8, BS, KVH, D, dtype=dt)
        kv_store.store_kv_triton(torch.zeros(T, KVH, D, dtype=dt), torch.zeros(T, KVH, D, dtype=dt), kc,
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
            kc = torch.zeros(8, BS, KVH, hd, dtype=dt)
            rotary.rotary_store_kv_triton(pos, torch.zeros(T, 4 * KVH, hd, dtype=dt), kv, kv, torch.zeros(16, rot),
                                          kc, kc.clone(), pos)
        for hd, grp, bs in ((128, 4, 16), (64, 3, 32), (256, 1, 16), (8, 2, 16)):  # head_dim 8: tl.dot K >= 16
            kc = torch.zeros(8, bs, 2, hd, dtype=dt)
            bt = torch.zeros(2, 4, dtype=torch.int32)
            sl = torch.ones(2, dtype=torch.int32)
            q = torch.zeros(2, 2 * grp, hd, dtype=dt)
            for ns in (1, 4):
                pda.paged_decode_attention_triton(q, kc, kc, bt, sl, 0.1, num_splits=ns)
            cu = torch.tensor([0, 1, 2], dtype=torch.int32)
            for mq in (1, 100):
                ppa.paged_prefill_attention_triton(q, kc, kc, cu, sl, bt, mq, 0.1)
        for T, E, K in ((3, 8, 2), (300, 8, 2)):  # fused MoE: decode- and prefill-sized tiles
            x, ids = torch.zeros(T, 128, dtype=dt), torch.zeros(T, K, dtype=torch.int64)
            moe.fused_moe_triton(x, torch.zeros(E, 192, 128, dtype=dt), torch.zeros(E, 128, 96, dtype=dt),
                                 torch.zeros(T, K), ids)
        meta, R, _ = kcases.make_lora_meta(20, [1, 8, 64], "cpu")
        x = torch.zeros(20, 128, dtype=dt)
        for sk in (1, 2):
            buf = lora.lora_shrink_triton(x, torch.zeros(3, R, 128, dtype=dt), meta, split_k=sk)
        lora.lora_expand_triton(buf, torch.zeros(R, 128, dtype=dt), [0, 64, 96, 128], meta,
                                        torch.zeros(20, 128, dtype=dt))
    print(f"compiled {len(compiled)} kernel variants for sm_80 and sm_90 in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
