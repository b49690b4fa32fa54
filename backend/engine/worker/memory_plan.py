"""The memory arithmetic of an engine, in one place: the KV cache's bytes per token and blocks, the model's bytes as
loaded, and the GPU budget formula. The model runner sizes its KV cache with it and logs its weights with it; the
planner (`plan`, scripts/plan_memory.py) applies it to a model built on the meta device from config.json alone, so
that what it prints is what the engine allocates.

The plan's reserve (what the engine keeps off the KV cache on CUDA: the CUDA context, the largest prefill's
activations, the sampler's working set, the decode graphs' pool, the LoRA pools, a margin) is an estimate where the
engine measures (engine/worker/memory_profile.py, which logs its measurement beside this estimate); the weights and
the KV bytes are exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# allocator fragmentation (segments rounded up, blocks split), cuBLAS workspaces of a serving thread other than the
# one that profiled, CUDA context growth (kernel modules, graph executables), small buffers made later
MARGIN = 256 << 20
# the CUDA context, cuBLAS / Triton workspaces and kernel modules on the device before any tensor (the plan's
# estimate: measured 0.5-0.6 GiB on H100 with torch 2.x; the engine measures the device's memory in use instead)
CUDA_CONTEXT = 640 << 20
CPU_KV_BYTES = 1 << 30  # the KV cache budget on CPU when kv_cache_memory_bytes is 0


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer (num_kv_heads: this rank's): every layer holds the whole context, sliding
    windows included."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size(dtype)


def kv_blocks(budget: int, bytes_per_block: int) -> int:
    """Whole blocks a byte budget holds."""
    return max(0, budget) // bytes_per_block


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model as loaded: its parameters and buffers (the rope tables), each tensor once (tied embeddings),
    and the quantized weights of its QuantLinear layers (packed values, scales, zero points, act-order indices)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    for m in model.modules():
        for qw in getattr(m, "quantized_weights", lambda: ())():
            for t in (qw.weight, qw.scale, qw.zero, qw.g_idx):
                add(t)
    return total


def kv_budget(total: int, utilization: float, used: int, transient: int, graph_forward: int, lora: int) -> int:
    """CUDA: the KV cache's bytes. used: the device's memory in use with the weights loaded (context, weights, step
    buffers); transient: the larger of the largest prefill's and the sampler's peaks; graph_forward: the decode
    graphs' forward peak (kept twice: the graphs' pool and the capture stream's cache); lora: the adapter pools."""
    return int(total * utilization) - used - transient - 2 * graph_forward - lora - MARGIN


@dataclass(frozen=True)
class RankShape:
    """What a model's layers read of a tensor-parallel group at construction: built on the meta device for one rank."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class MemoryPlan:
    dtype: torch.dtype
    tensor_parallel_size: int
    quantization: str  # the checkpoint's format, how its weights are held ("kept quantized" / "dequantised")
    weight_bytes: int  # per GPU: the largest rank's
    kv_bytes_per_token: int  # per GPU: the largest rank's
    block_size: int
    reserve_bytes: int  # per GPU, the estimate (0 on CPU)
    kv_budget_bytes: int  # per GPU
    kv_tokens: int  # the KV cache's capacity in tokens (every rank holds the same blocks)
    wanted_tokens: int

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.wanted_tokens > 0


def plan(model_dir: str, config, gpu_memory_bytes: int = 0, kv_tokens: int = 0, quantization_config=...) -> MemoryPlan:
    """What an engine of `config` (loom.engine.config.EngineConfig) would allocate for the model in `model_dir`,
    from its config.json alone. On CUDA (config.device cuda) the KV budget is gpu_memory_utilization x
    gpu_memory_bytes less the weights and the reserve estimate, unless kv_cache_memory_bytes is given; on CPU it is
    kv_cache_memory_bytes (or 1 GiB). kv_tokens: the KV tokens wanted (0: max_model_len). quantization_config: in
    place of the checkpoint's (None: unquantized; a dict as config.json holds one: a what-if)."""
    from loom.models.loader import build_meta_model, checkpoint_dtype, load_hf_config
    from loom.models.quant import METHODS
    from loom.models.quant_layers import keeps_quantized

    cfg = load_hf_config(model_dir)
    if quantization_config is not ...:
        cfg.quantization_config = quantization_config  # the model below reads it (ModelSpec, with every refusal)
    device = config.torch_device
    dtype = config.resolve_dtype(checkpoint_dtype(cfg))
    max_len = config.max_model_len or int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
    n = config.tensor_parallel_size
    weights, per_token, quant = 0, 0, "none"
    for rank in range(n):
        model = build_meta_model(cfg, max_len, RankShape(rank, n) if n > 1 else None, dtype)
        spec = model.spec
        if spec.quant is not None:
            keep = keeps_quantized(spec.quant, device, dtype)
            name = next(k for k, v in METHODS.items() if isinstance(spec.quant, v))
            quant = f"{name}, " + ("kept quantized" if keep else f"dequantised into {str(dtype)[6:]} at load")
            if keep:
                quantize_meta(model, spec.quant, checkpoint_dtype(cfg) or torch.float32)
        _rebuild_rope(model)
        attn = model.attention_layers()
        weights = max(weights, model_bytes(model))
        per_token = max(per_token, kv_bytes_per_token(len(attn), attn[0].num_kv_heads, attn[0].head_dim,
                                                      config.resolve_kv_cache_dtype(dtype)))
    reserve = 0
    if config.kv_cache_memory_bytes:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        if gpu_memory_bytes <= 0:
            raise ValueError("gpu_memory_bytes: the GPU's memory is needed to plan a CUDA engine's KV cache")
        transient, graphs = reserve_estimate(cfg, config, dtype, n)
        lora = config.lora_memory_bytes + config.lora_expert_memory_bytes
        reserve = CUDA_CONTEXT + transient + 2 * graphs + lora + MARGIN
        budget = kv_budget(gpu_memory_bytes, config.gpu_memory_utilization, CUDA_CONTEXT + weights, transient,
                           graphs, lora)
    else:
        budget = CPU_KV_BYTES
    blocks = kv_blocks(budget, per_token * config.block_size)
    return MemoryPlan(dtype, n, quant, weights, per_token, config.block_size, reserve, budget,
                      blocks * config.block_size, kv_tokens or max_len)


def quantize_meta(model, quant, checkpoint_dtype: torch.dtype) -> None:
    """Each linear layer (and MoE experts module) the checkpoint stores quantized made a QuantLinear (QuantExperts)
    over meta weights of the format's layout, by the loader's own install_quant_linear / install_quant_experts: a
    layer only some of whose weights are quantized is dequantised at load, as the loader does."""
    from loom.layers.moe import Experts
    from loom.models.quant_layers import (
        HOLDS,
        expert_checkpoint_names,
        install_quant_experts,
        install_quant_linear,
        layout_parts,
        rank_shard,
    )

    arch = model.spec.arch
    for name, module in list(model.named_modules()):
        if type(module) in HOLDS:  # a tensor-parallel rank's layer: its shard of each full layout, as the loader cuts
            parts = layout_parts(arch, name, module, quant, checkpoint_dtype)
            if parts is not None:
                install_quant_linear(model, name, parts, "meta")
        elif type(module) is Experts:
            hidden, inter = module.down_proj.shape[1], module.full_intermediate
            shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
            pieces = {"gate": module.checkpoint_pieces("gate_up_proj", 0, 0),
                      "up": module.checkpoint_pieces("gate_up_proj", 0, 1),
                      "down": module.checkpoint_pieces("down_proj", 0)}
            names = {e: expert_checkpoint_names(arch, name, e) for e in range(module.num_experts)}
            if all(quant.quantizes(n) for by_part in names.values() for n in by_part.values()):
                slots = {(e, part): rank_shard(quant.layout(n, shapes[part], checkpoint_dtype), pieces[part][0][1], n)
                         for e, by_part in names.items() for part, n in by_part.items()}
                install_quant_experts(model, name, slots, "meta")


def _rebuild_rope(model) -> None:
    from loom.layers.rotary import RotaryEmbedding

    for m in model.modules():
        if isinstance(m, RotaryEmbedding):  # float32, as the loader rebuilds it
            m.cos_sin_cache = torch.empty(m.cos_sin_cache.shape, dtype=torch.float32, device="meta")


def reserve_estimate(cfg, config, dtype: torch.dtype, world_size: int) -> tuple[int, int]:
    """(transient peak, graph forward peak) per GPU, estimated where the engine measures them (memory_profile): the
    largest of a prefill step of max_num_batched_tokens tokens (one layer's live activations per token - residual,
    normed input, q|k|v, attention output, the MLP's gate|up and product, or for MoE the routed copies - and the
    logits of max_num_seqs rows in float32) and the sampler at max_num_seqs rows (logits, softmax, a sort with int64
    indices); the graph forward: that layer's activations at the largest graph batch."""
    from loom.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config(cfg)
    e = element_size(dtype)
    q = spec.num_heads * spec.head_dim // world_size
    kv = max(1, spec.num_kv_heads // world_size) * spec.head_dim
    inter = spec.intermediate_size // world_size
    if spec.moe is not None:
        inter = max(inter, spec.moe.top_k * spec.moe.intermediate_size // world_size)
    per_token = e * (3 * spec.hidden_size + q + 2 * kv + q + 3 * inter) + 4 * spec.hidden_size
    rows = config.max_num_seqs
    logits = rows * spec.vocab_size * (e + 4)
    prefill = config.max_num_batched_tokens * per_token + logits
    sampler = rows * spec.vocab_size * (4 + 4 + 4 + 8)
    graph_batch = max(1, min(config.cuda_graph_max_batch or 256, config.max_num_seqs, config.max_num_batched_tokens))
    graphs = graph_batch * per_token if config.cuda_graphs else 0
    return max(prefill, sampler), graphs
