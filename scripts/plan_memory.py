#!/usr/bin/env python3
"""Does a model fit? Per-GPU weights, KV bytes per token, KV capacity in tokens, from a model folder's config.json
alone (no weights read), by the engine's own arithmetic (loom.engine.worker.memory_plan: the model built on the meta
device, the quantized layers in their format's layout, the KV sizing the model runner uses).

    python scripts/plan_memory.py MODEL_DIR --gpu-memory-gib 80 --max-model-len 32768 --kv-tokens 65536
    python scripts/plan_memory.py MODEL_DIR --quantization fp8 --tensor-parallel-size 2 --gpu-memory-gib 80
    python scripts/plan_memory.py MODEL_DIR --kv-cache-dtype fp8 --kv-tokens 131072

--quantization: auto (the checkpoint's quantization_config, as the engine loads it), none (as if unquantized), or a
what-if for an unquantized config: fp8 (compressed-tensors FP8, per-channel), w8a16 (int8 per channel), w4a16 (int4
in groups of 128), lm_head and the embeddings left in float as llm-compressor leaves them. On CUDA the reserve beside
the weights (CUDA context, the largest prefill's activations or the sampler's working set, the decode graphs, the
LoRA pools, a margin) is an estimate; the engine measures it at start and logs both. Exit status 0 if the KV cache
holds the tokens wanted (--kv-tokens, else --max-model-len, else the model's), 1 if not.
"""
from __future__ import annotations

import argparse
import sys

GIB = 1 << 30


def _scheme(weights: dict, fmt: str, activations: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights}
    if activations:
        group["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


WHAT_IF = {
    "fp8": _scheme({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "float-quantized",
                   {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
    "w8a16": _scheme({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}, "pack-quantized"),
    "w4a16": _scheme({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
                     "pack-quantized"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="HF model folder (only its config.json is read)")
    ap.add_argument("--dtype", default="auto", help="auto (the checkpoint's 16-bit type on CUDA), bfloat16, ...")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", *WHAT_IF])
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the model's max_position_embeddings")
    ap.add_argument("--kv-tokens", type=int, default=0, help="KV tokens wanted (0: max-model-len)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lora-memory-bytes", type=int, default=256 << 20)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=0, help="a fixed KV budget (as the engine's)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8 / fp8_e4m3 (1 byte)")
    args = ap.parse_args(argv)

    from loom.engine.config import EngineConfig
    from loom.engine.worker.memory_plan import plan

    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          tensor_parallel_size=args.tensor_parallel_size,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=args.block_size, lora_memory_bytes=args.lora_memory_bytes,
                          cuda_graphs=not args.no_cuda_graphs, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          kv_cache_dtype=args.kv_cache_dtype)
    quant = {"auto": ..., "none": None}.get(args.quantization, WHAT_IF.get(args.quantization))
    p = plan(args.model, config, int(args.gpu_memory_gib * GIB), args.kv_tokens, quantization_config=quant)
    per = "per GPU" if args.device == "cuda" else "on CPU"
    print(f"model: {args.model}  dtype {str(p.dtype).removeprefix('torch.')}  quantization: {p.quantization}  "
          f"tensor_parallel_size {p.tensor_parallel_size}  kv_cache_dtype {args.kv_cache_dtype}")
    print(f"weights {per}:        {p.weight_bytes / GIB:9.2f} GiB")
    print(f"KV bytes per token {per}: {p.kv_bytes_per_token:,} B ({p.kv_bytes_per_token * p.block_size:,} B a "
          f"block of {p.block_size})")
    if p.reserve_bytes:
        print(f"reserve (estimate):       {p.reserve_bytes / GIB:9.2f} GiB  (context, activations, sampler, graphs, "
              "LoRA pools, margin)")
    print(f"KV cache {per}:       {max(p.kv_budget_bytes, 0) / GIB:9.2f} GiB = {p.kv_tokens:,} tokens")
    print(f"wanted:                   {p.wanted_tokens:,} tokens -> {'FITS' if p.fits else 'DOES NOT FIT'}")
    if not p.fits and p.kv_bytes_per_token:
        short = (p.wanted_tokens - p.kv_tokens) * p.kv_bytes_per_token
        print(f"short by {short / GIB:.2f} GiB {per}" if p.kv_budget_bytes > 0 else
              f"no room for a KV cache: the weights and reserve exceed {config.gpu_memory_utilization:.2f} of the GPU")
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
