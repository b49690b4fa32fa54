"""The base model's LoRA-capable modules, as the pools and the PEFT loader see them.

A module group is one module per decoder layer that adapters write into: the fused linears qkv_proj (slices q, k,
v), o_proj, gate_up_proj (slices gate, up), down_proj, and for MoE layers the experts (experts_gate_up, slices gate
and up, and experts_down; one LoRA per expert). HF/PEFT projection names map onto groups: Llama-style models name
the slices (q_proj, ..., up_proj); Phi-3 names the fused modules (qkv_proj, gate_up_proj), whose one LoRA A serves
every slice; MoE experts are parameters (experts.gate_up_proj, experts.down_proj), targeted with PEFT's
target_parameters. The groups fall into two row spaces (`LoraModelSpec.space`): the dense groups and the expert
groups, each with its own pools, so only adapters that target experts pay for expert rows.
Under tensor parallelism a group's shapes are the full model's (what adapters' checkpoints hold) and its `shard`
says which part this rank's pools hold (loom.layers.linear.LoraShard): pools are sized and written by `held_*`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from loom.layers.linear import LoraShard

SUPPORTED_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PROJS = ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoint modules
EXPERT_PROJS = ("experts.gate_up_proj", "experts.down_proj")  # MoE expert weights (target_parameters)
ALL_PROJS = SUPPORTED_PROJS + FUSED_PROJS + EXPERT_PROJS

GROUP_LAYOUT = (
    # name, path in the decoder layer, block in HF naming, HF projection names of the slices
    ("qkv_proj", "self_attn.qkv_proj", "self_attn", ("q_proj", "k_proj", "v_proj")),
    ("o_proj", "self_attn.o_proj", "self_attn", ("o_proj",)),
    ("gate_up_proj", "mlp.gate_up_proj", "mlp", ("gate_proj", "up_proj")),
    ("down_proj", "mlp.down_proj", "mlp", ("down_proj",)),
    ("experts_gate_up", "mlp.experts.lora_gate_up", "mlp", ("experts.gate_up_proj",)),
    ("experts_down", "mlp.experts.lora_down", "mlp", ("experts.down_proj",)),
)
# projection name -> (group index, slice index or None = every slice, HF block)
PROJ_TO_GROUP = {p: (gi, si, blk) for gi, (_, _, blk, projs) in enumerate(GROUP_LAYOUT[:4])
                 for si, p in enumerate(projs)}
PROJ_TO_GROUP.update({"qkv_proj": (0, None, "self_attn"), "gate_up_proj": (2, None, "mlp"),
                      "experts.gate_up_proj": (4, None, "mlp"), "experts.down_proj": (5, None, "mlp")})
# PEFT's transformers-5 conversion moves these target_modules of MoE models onto the fused experts or the router
MOE_V4_NAMES = {"mixtral": ("gate", "w1", "w2", "w3"), "qwen2_moe": ("gate", "gate_proj", "up_proj", "down_proj")}
_MOE_FAMILY = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen2_moe"}


def hf_module_name(layer: int, proj: str) -> str:
    """The module (or, for experts, parameter) name PEFT matches targets against (transformers' naming)."""
    return f"model.layers.{layer}.{PROJ_TO_GROUP[proj][2]}.{proj}"


@dataclass(frozen=True)
class LoraGroupSpec:
    """One module per decoder layer (e.g. qkv_proj with slices q, k, v), in the layers listed."""

    name: str  # a GROUP_LAYOUT name
    path: str  # module path inside a decoder layer, e.g. "self_attn.qkv_proj"
    projs: tuple[str, ...]  # the HF/PEFT projection names this model has for the group
    in_features: int
    output_sizes: tuple[int, ...]
    num_experts: int = 0  # MoE experts: one LoRA per expert
    layers: tuple[int, ...] = ()  # empty = every layer
    shard: Optional[LoraShard] = None  # tensor parallelism: this rank's part; None = all of it

    @property
    def held_in_features(self) -> int:
        """A's columns this rank's pools hold."""
        cols = self.shard.in_cols if self.shard is not None else None
        return self.in_features if cols is None else cols[1] - cols[0]

    @property
    def held_out_features(self) -> int:
        """B's columns this rank's pools hold."""
        cols = self.shard.out_cols if self.shard is not None else None
        return self.out_features if cols is None else sum(hi - lo for lo, hi in cols)

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    @property
    def out_features(self) -> int:
        return sum(self.output_sizes)

    @property
    def slice_offsets(self) -> list[int]:
        offs = [0]
        for s in self.output_sizes:
            offs.append(offs[-1] + s)
        return offs

    @property
    def elems_per_row(self) -> int:
        """Pool elements one rank row takes in one layer: A for each slice plus the B row (per expert)."""
        return self.stored_per_row(lambda n: n)

    def stored_per_row(self, row: Callable[[int], int]) -> int:
        """elems_per_row where a pool row of n elements is stored in row(n) (a CPU pool's padding); this rank's part."""
        return max(1, self.num_experts) * (self.num_slices * row(self.held_in_features) + row(self.held_out_features))

    @property
    def is_expert(self) -> bool:
        return self.num_experts > 0

    def proj_shape(self, proj: str) -> tuple[int, int]:
        si = PROJ_TO_GROUP[proj][1]
        return self.in_features, self.out_features if si is None else self.output_sizes[si]


@dataclass(frozen=True)
class LoraModelSpec:
    num_layers: int
    groups: tuple[LoraGroupSpec, ...]
    arch: str = "LlamaForCausalLM"

    @property
    def elems_per_row(self) -> int:
        """Pool elements of one rank row: every group in each layer that has it."""
        return self.stored_per_row(lambda n: n)

    def stored_per_row(self, row: Callable[[int], int]) -> int:
        """elems_per_row where a pool row of n elements is stored in row(n) (LoraGroupSpec.stored_per_row)."""
        return sum(len(self.layers_of(g)) * g.stored_per_row(row) for g in self.groups)

    def bytes_per_row(self, dtype: torch.dtype, row: Optional[Callable[[int], int]] = None) -> int:
        """Pool bytes of one rank row; row: as in stored_per_row (None: unpadded)."""
        stored = self.stored_per_row(row) if row else self.elems_per_row
        return stored * torch.empty((), dtype=dtype).element_size()

    def space(self, expert: bool) -> "LoraModelSpec":
        """The groups of one row space: the dense groups (attention, dense MLP) or the MoE expert groups. Each space
        has its own pools and rows, so an adapter that does not target experts takes no expert rows."""
        return LoraModelSpec(self.num_layers, tuple(g for g in self.groups if g.is_expert == expert), self.arch)

    @property
    def moe_family(self) -> str | None:
        """PEFT's conversion family for MoE models ("mixtral", "qwen2_moe"), None for dense ones."""
        return _MOE_FAMILY.get(self.arch)

    def group(self, name: str) -> LoraGroupSpec | None:
        return next((g for g in self.groups if g.name == name), None)

    def group_of(self, proj: str) -> LoraGroupSpec | None:
        return self.group(GROUP_LAYOUT[PROJ_TO_GROUP[proj][0]][0])

    def layers_of(self, g: LoraGroupSpec) -> tuple[int, ...]:
        """The layers that have the group (pools and adapter tensors stack these, in this order)."""
        return g.layers or tuple(range(self.num_layers))

    def proj_shape(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one HF projection (of one expert, for experts)."""
        return self.group_of(proj).proj_shape(proj)

    def module_projs(self) -> list[tuple[int, str]]:
        """(layer, HF projection) of every module target_modules may name in this model (experts excluded)."""
        return [(layer, p) for g in self.groups if not g.num_experts for p in g.projs for layer in self.layers_of(g)]

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "LoraModelSpec":
        """The full model's groups (a tensor-parallel rank's with the part it holds: `shard`)."""
        found = model.lora_modules()  # (layer, group name) -> module: the model says which are LoRA-capable
        if not found:
            raise ValueError("the model has no LoRA-capable layers (layers.N.self_attn.qkv_proj, ...)")
        arch = getattr(getattr(model, "spec", None), "arch", "LlamaForCausalLM")
        num_layers = 1 + max(layer for layer, _ in found)
        groups = []
        for name, path, _, projs in GROUP_LAYOUT:
            layers = sorted(layer for layer, g in found if g == name)
            if not layers:
                continue
            shapes = {_full_shape(found[(i, name)]) for i in layers}
            if len(shapes) > 1:
                raise ValueError(f"layers.*.{path} differ in shape {sorted(shapes, key=str)} (non-uniform layers "
                                 "are not supported)")
            in_f, outs, experts, shard = shapes.pop()
            if arch == "Phi3ForCausalLM" and name in FUSED_PROJS:
                projs = (name,)  # Phi-3 keeps q|k|v and gate|up fused in its HF modules
            every = len(layers) == num_layers
            groups.append(LoraGroupSpec(name, path, projs, in_f, outs, experts, () if every else tuple(layers), shard))
        return cls(num_layers, tuple(groups), arch)

    @classmethod
    def from_hf_config(cls, cfg) -> "LoraModelSpec":
        """From a transformers LlamaConfig-like object (tests; models without the fused modules)."""
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        inter = cfg.intermediate_size
        q, kv = heads * head_dim, kv_heads * head_dim
        dims = {
            "qkv_proj": (hidden, (q, kv, kv)),
            "o_proj": (q, (hidden,)),
            "gate_up_proj": (hidden, (inter, inter)),
            "down_proj": (inter, (hidden,)),
        }
        groups = tuple(LoraGroupSpec(n, p, projs, *dims[n]) for n, p, _, projs in GROUP_LAYOUT[:4])
        return cls(cfg.num_hidden_layers, groups, (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0])


def _full_shape(mod) -> tuple[int, tuple[int, ...], int, Optional[LoraShard]]:
    """(full in_features, full output sizes, experts, shard) of a LoRA-capable module."""
    shard = getattr(mod, "lora_shard", None)
    experts = int(getattr(mod, "num_experts", 0))
    if shard is None:
        return int(mod.in_features), tuple(int(s) for s in mod.output_sizes), experts, None
    return shard.full_in, tuple(shard.full_sizes), experts, shard
