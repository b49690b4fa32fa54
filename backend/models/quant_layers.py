"""Which layers of a quantized checkpoint stay quantized, and QuantLinear / QuantExperts put in their place: used by
the loader (loom.models.loader) as it reads the checkpoint and by the memory plan (loom.engine.worker.memory_plan)
over meta weights of each format's layout, so that both hold the same layers in the same layout.

Also the checkpoint's names of what we fuse or stack: q/k/v and gate/up slices of our fused projections (Phi-3
stores them fused, as we do), and one tensor per expert and projection (Mixtral's block_sparse_moe ... w1 / w3 / w2,
Qwen3-MoE's mlp.experts ... gate_proj / up_proj / down_proj) of our stacked experts.
"""
from __future__ import annotations

import dataclasses
import logging
import re

import torch

from loom.errors import ConfigError
from loom.kernels.policy import REFERENCE, decide
from loom.layers.linear import ALL, LoRALinear
from loom.layers.moe import Experts
from loom.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from loom.layers.quant_experts import QuantExperts
from loom.layers.quant_linear import QuantLinear, concat_out
from loom.models.quant import QuantizedWeight, dequantize
from loom.models.quant.shard import Unsplittable, take

log = logging.getLogger("loom")

MIXTRAL_BLOCK = re.compile(r"\.block_sparse_moe\.")
EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the linear layers a QuantLinear replaces: single-device, and a tensor-parallel rank's column / row shard (not the
# vocab-parallel lm_head, which quantizers leave in float)
HOLDS = (LoRALinear, ColumnParallelLinear, RowParallelLinear)


def keeps_quantized(quant, device, dtype: torch.dtype) -> bool:
    """Whether a quantized checkpoint's linear weights stay quantized (QuantLinear) or are dequantised into `dtype` at
    load: kept where a kernel takes them (kernels/policy.py: Triton on CUDA, the C++ weight-only GEMM on CPU); under
    tensor parallelism each rank keeps its shard quantized (models/quant/shard.py; a layout a rank cannot split is
    refused, `rank_shard`)."""
    return quant is not None and decide(device, dtype).quant != REFERENCE


def expert_checkpoint_names(arch: str, experts_name: str, expert: int) -> dict[str, str]:
    """gate / up / down -> the checkpoint module of one expert's projection (Mixtral: block_sparse_moe ... w1 / w3 /
    w2; Qwen3-MoE: mlp.experts ... gate_proj / up_proj / down_proj)."""
    if arch == "MixtralForCausalLM":
        pre = experts_name.replace(".mlp.experts", ".block_sparse_moe.experts")
        return {"gate": f"{pre}.{expert}.w1", "up": f"{pre}.{expert}.w3", "down": f"{pre}.{expert}.w2"}
    return {p: f"{experts_name}.{expert}.{p}_proj" for p in ("gate", "up", "down")}


def expert_slot(name: str) -> tuple[str, int, str] | None:
    """(our experts module, expert, gate / up / down) of a checkpoint tensor of one expert's projection."""
    m = EXPERT.match(MIXTRAL_BLOCK.sub(".mlp.", name))
    if m is None:
        return None
    proj = m.group("proj")
    part = "down" if proj in ("w2", "down_proj") else "gate" if proj in ("w1", "gate_proj") else "up"
    return m.group("pre"), int(m.group("e")), part


def kept_quantized(model, stored: dict) -> tuple[list[str], list[str]]:
    """(linear modules, experts modules) whose every checkpoint weight is stored quantized: held quantized, their
    float weights never allocated. A module only some of whose weights are quantized is dequantised at load."""
    if not stored:
        return [], []
    arch = model.spec.arch
    linears, experts = [], []
    for name, module in model.named_modules():
        if type(module) in HOLDS and all(n in stored for n, _, _ in checkpoint_slices(arch, name, module)):
            linears.append(name)
        elif type(module) is Experts:
            names = [n for e in range(module.num_experts) for n in expert_checkpoint_names(arch, name, e).values()]
            held = sum(n in stored for n in names)
            if held == len(names):
                experts.append(name)
            elif held:
                log.warning("%s: only %d of its %d expert weights are quantized in the checkpoint: dequantised at "
                            "load", name, held, len(names))
    return linears, experts


def install_quant_experts(model, experts_name: str, slots: dict, device) -> None:
    """The Experts `experts_name` replaced by a QuantExperts over slots ((expert, gate / up / down) -> weight): each
    expert's gate and up concatenated into one weight where they can be; used by the loader and the memory plan."""
    base = model.get_submodule(experts_name)
    inter = base.intermediate_size
    gate_up, down = [], []
    for e in range(base.num_experts):
        gate, up = slots[(e, "gate")], slots[(e, "up")]
        fused = concat_out([gate, up])
        parts = [(0, fused)] if fused is not None else [(0, gate), (inter, up)]
        gate_up.append([(start, on_device(w, device)) for start, w in parts])
        down.append(on_device(slots[(e, "down")], device))
    parent_name, _, child = experts_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, QuantExperts(base, gate_up, down))


def checkpoint_slices(arch: str, module_name: str, module) -> list[tuple[str, int, int]]:
    """(checkpoint module name, first row, rows) of each checkpoint linear a LoRALinear of ours holds: q/k/v of
    qkv_proj and gate/up of gate_up_proj, one each (Phi-3 stores them fused, as we do), else the module itself."""
    pre, _, proj = module_name.rpartition(".")
    offsets = module.slice_offsets
    if proj in FUSED and arch != "Phi3ForCausalLM":
        return [(f"{pre}.{n}", offsets[i], offsets[i + 1] - offsets[i]) for i, n in enumerate(FUSED[proj])]
    return [(module_name, 0, offsets[-1])]


def layout_parts(arch: str, module_name: str, module, quant, dtype: torch.dtype) -> list | None:
    """The memory plan's (first output row, meta QuantizedWeight) parts of a linear layer, as the loader builds them:
    each checkpoint tensor's layout at its full shape (`quant.layout`), cut to the pieces this layer (a rank's shard)
    holds; None if the checkpoint stores some of its slices unquantized (the layer is dequantised at load)."""
    if not all(quant.quantizes(n) for n, _, _ in checkpoint_slices(arch, module_name, module)):
        return None
    column = isinstance(module, ColumnParallelLinear)
    inp = module.shard.full if isinstance(module, RowParallelLinear) else module.in_features
    pre, _, proj = module_name.rpartition(".")
    if proj in FUSED and arch != "Phi3ForCausalLM":  # one checkpoint tensor per slice
        tensors = [(f"{pre}.{n}", module.shards[i].full if column else module.output_sizes[i], i)
                   for i, n in enumerate(FUSED[proj])]
    else:
        tensors = [(module_name, module.full_offsets[-1] if column else module.slice_offsets[-1], None)]
    return [part for name, out, i in tensors for part in
            rank_parts(quant.layout(name, (out, inp), dtype), module.checkpoint_pieces("weight", i), module_name)]


def quantized_parts(model, target: str, pieces: list, qw: QuantizedWeight
                    ) -> list[tuple[int, QuantizedWeight]] | None:
    """(first output row in the layer's weight, this rank's part of `qw`) for each piece of a quantized checkpoint
    tensor a linear layer holds (a slice of a fused one, the whole, or a tensor-parallel rank's rows or columns), if
    the layer can hold it quantized; a part a rank cannot split: ConfigError (`rank_shard`)."""
    if not target.endswith(".weight") or any(src is None for _, src in pieces):
        return None
    module_name = target[: -len(".weight")]
    if type(model.get_submodule(module_name)) not in HOLDS:
        return None
    return rank_parts(qw, pieces, module_name)


def rank_parts(qw: QuantizedWeight, pieces: list, where: str) -> list[tuple[int, QuantizedWeight]]:
    """(first output row in the layer's weight, this rank's part of qw) for each (layer index, checkpoint index)
    piece of one checkpoint tensor (`rank_shard`)."""
    return [(0 if index == ALL else index[0].start, rank_shard(qw, src, where)) for index, src in pieces]


def rank_shard(qw: QuantizedWeight, src: tuple, where: str) -> QuantizedWeight:
    """The part of a quantized weight a checkpoint index selects (models/quant/shard.py); where a rank's range cuts a
    packed word, a group or a block, a ConfigError naming tensor_parallel_size (vLLM refuses these too)."""
    if src == ALL:
        return qw
    try:
        return take(qw, src)
    except Unsplittable as e:
        kind = "fp8" if qw.kind == "fp8" else f"int{qw.bits}"
        unit = f"group size {qw.group_size}" if qw.group_size else f"block {qw.block}" if qw.block else \
            f"{32 // qw.bits} columns a packed word"
        raise ConfigError("tensor_parallel_size", f"{where}: {e}: its quantized weight ({kind}, {unit}) cannot be "
                          "split across the ranks; use a tensor_parallel_size whose shards hold whole groups / "
                          "blocks (or a checkpoint quantized in smaller ones)") from None


def place_quant_linear(model, params: dict, module_name: str, parts: list, device) -> None:
    """Put a QuantLinear in place of the LoRALinear whose slices `parts` are: one weight where they concatenate,
    else one GEMM per part; a module some of whose slices the checkpoint stores unquantized gets its quantized ones
    dequantised into its weight (logged)."""
    base = model.get_submodule(module_name)
    parts = sorted(parts, key=lambda p: p[0])
    starts = [0]
    for _, qw in parts:
        starts.append(starts[-1] + qw.shape[0])
    if [s for s, _ in parts] != starts[:-1] or starts[-1] != base.slice_offsets[-1]:
        log.warning("%s: only some of its slices are quantized in the checkpoint: dequantised at load", module_name)
        weight = params[f"{module_name}.weight"]
        for start, qw in parts:
            weight.data[start:start + qw.shape[0]].copy_(dequantize(qw, weight.dtype))
        return
    install_quant_linear(model, module_name, parts, device)


def install_quant_linear(model, module_name: str, parts: list, device) -> None:
    """The LoRALinear `module_name` replaced by a QuantLinear over `parts` ((first output row, QuantizedWeight) pairs
    covering its rows in order), concatenated into one weight where they can be; used by the loader and by the
    memory plan (meta weights: the same layout, hence the same bytes)."""
    base = model.get_submodule(module_name)
    parts = sorted(parts, key=lambda p: p[0])
    fused = concat_out([qw for _, qw in parts])
    if fused is not None:
        parts = [(0, fused)]
    elif torch.device(device).type != "meta":
        log.info("%s: its slices' quantization differs (format, groups or act-order): one GEMM per slice",
                 module_name)
    parent_name, _, child = module_name.rpartition(".")
    layer = QuantLinear(base, [(start, on_device(qw, device)) for start, qw in parts])
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def on_device(qw: QuantizedWeight, device) -> QuantizedWeight:
    def move(t):
        return None if t is None else t.to(device)

    return dataclasses.replace(qw, weight=move(qw.weight), scale=move(qw.scale), zero=move(qw.zero),
                               g_idx=move(qw.g_idx))
