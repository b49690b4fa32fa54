"""What an adapter costs at least: its rows' bytes and FLOPs in the engine's LoRA layout, the memory bandwidth that
bounds reading them, and the best tokens/s ratio a multi-LoRA run can reach on this machine (bench_lora.py,
bench_lora_floor.py)."""
from __future__ import annotations

import time
import types


def model_spec(config: dict, layers: int = 0):
    """The engine's LoRA layout of the model (loom.lora.model_spec): its packed projections and pool rows."""
    from loom.lora.model_spec import LoraModelSpec

    cfg = dict(config, num_hidden_layers=layers or config["num_hidden_layers"])
    return LoraModelSpec.from_hf_config(types.SimpleNamespace(**cfg))


def lora_cost(spec, tokens: int, rank: int, pool_dtype=None) -> tuple[int, int, int]:
    """(FLOPs of the layers' GEMMs, FLOPs of LoRA on every projection, bytes of one adapter's rows in pools of
    pool_dtype (float32 when None))."""
    import torch

    gemm = spec.num_layers * sum(2 * tokens * g.in_features * g.out_features for g in spec.groups)
    return gemm, 2 * tokens * rank * spec.elems_per_row, rank * spec.bytes_per_row(pool_dtype or torch.float32)


def stream_gbps(mb: int = 256, reps: int = 5) -> float:
    """Best single-pass read bandwidth over a buffer far larger than the caches, on torch's threads."""
    import torch

    x = torch.ones(mb << 18)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def distinct_ceiling(no_lora_tps: float, requests: int, max_tokens: int, adapter_bytes: int, gbps: float) -> float:
    """The distinct-adapter / no-LoRA tokens/s ratio left when reading the adapters adds its time to the no-LoRA
    run's: `requests` requests decoding together, each on its own adapter, read every adapter's rows once per decode
    step (max_tokens - 1 of them; the first token comes from the prefill) at `gbps`. LoRA FLOPs are left out. The
    C++ pass fetches the rows while the GEMMs compute, which beats this bound where the GEMMs leave bandwidth
    unused."""
    base_s = requests * max_tokens / no_lora_tps
    read_s = (max_tokens - 1) * requests * adapter_bytes / (gbps * 1e9)
    return base_s / (base_s + read_s)
