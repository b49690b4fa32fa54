"""Load an HF model directory as is: config.json + single or sharded safetensors (never pickle)."""
from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open
from transformers import AutoConfig

from loom.errors import ConfigError
from loom.layers.linear import ALL
from loom.layers.rotary import RotaryEmbedding
from loom.models.gemma import GemmaForCausalLM
from loom.models.kv_scales import is_kv_scale
from loom.models.llama import LlamaForCausalLM
from loom.models.quant import QuantizedWeight, checkpoint_tensors, dequantize, quantized_modules
from loom.models.quant_layers import (
    EXPERT,
    FUSED,
    MIXTRAL_BLOCK,
    expert_slot,
    install_quant_experts,
    keeps_quantized,
    kept_quantized,
    place_quant_linear,
    quantized_parts,
    rank_shard,
)
from loom.models.spec import ModelSpec

log = logging.getLogger("loom")

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}
# Served with tensor_parallel_size > 1 (every family above: dense, fused Phi-3 tensors, Gemma's soft-capping on the
# gathered logits, MoE experts split by their intermediate features).
TENSOR_PARALLEL_ARCHITECTURES = frozenset(SUPPORTED_ARCHITECTURES)


class ModelLoadError(ValueError):
    pass


def load_hf_config(model_dir: str):
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelLoadError(f"{model_dir!r} has no config.json: it is not an HF model directory")
    cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    archs = getattr(cfg, "architectures", None) or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"architecture {archs or '(none)'} in {model_dir}/config.json is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    ModelSpec.from_hf_config(cfg)  # refuses, naming the field, anything loom does not compute
    return cfg


def checkpoint_dtype(cfg) -> torch.dtype | None:
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    if any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(model_dir)):
        raise ModelLoadError(f"{model_dir} holds only pickle weights (.bin/.pt); loom loads safetensors only: "
                             "convert with transformers' save_pretrained(safe_serialization=True)")
    raise ModelLoadError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_position: int, tp=None):
    """tp: the tensor-parallel rank group (loom.distributed.parallel_state.ParallelGroup): this rank's shard of the
    model, read from the checkpoint slice by slice (only its own rows and columns), or None: the whole model."""
    cfg = load_hf_config(model_dir)
    arch = cfg.architectures[0]
    if tp is not None and arch not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ConfigError("tensor_parallel_size", f"{arch} is not served with tensor_parallel_size > 1 yet "
                          f"(served: {sorted(TENSOR_PARALLEL_ARCHITECTURES)})")
    files = safetensors_files(model_dir)
    model = build_meta_model(cfg, max_position, tp, dtype)
    quant = model.spec.quant
    # quantized weights stay quantized where a kernel takes them (kernels/policy.py: Triton on CUDA, the C++
    # weight-only GEMM on CPU), else they are dequantised here. Kept: the float weights of the layers (and MoE
    # experts) the checkpoint stores wholly quantized are never allocated (they stay on the meta device until their
    # module is replaced by a QuantLinear / QuantExperts): the load's peak is the quantized model, not the float one.
    keep_quantized = keeps_quantized(quant, device, dtype)
    stored = quantized_modules(files, quant) if keep_quantized else {}
    kept_linears, kept_experts = kept_quantized(model, stored)
    if quant is not None:
        why = "no quantized kernel for this device and dtype, kernels/policy.py"
        shard = f" (this rank's shard of each, of {tp.world_size} ranks)" if tp is not None else ""
        log.info("%s checkpoint: %s", type(quant).__name__,
                 f"{len(kept_linears)} linear layers and {len(kept_experts)} MoE experts modules kept quantized{shard}"
                 if keep_quantized else f"its weights dequantised into {str(dtype)[6:]} at load ({why})")
    # Allocate once, on the target device in the target dtype (never a float32 copy first: that would be twice the
    # weights at the peak); the rope caches are rebuilt in float32.
    model = materialize(model, device, [f"{n}.weight" for n in kept_linears] +
                        [f"{n}.{w}" for n in kept_experts for w in ("gate_up_proj", "down_proj")])
    # A tied config whose checkpoint still carries its own lm_head.weight: transformers ties the two only if
    # they are equal, else it keeps both (and warns). Load both, then decide the same way.
    tied_with_head = model.tie_word_embeddings and any(_has_tensor(f, "lm_head.weight") for f in files)
    model.set_tied(model.tie_word_embeddings and not tied_with_head)

    params = dict(model.named_parameters(remove_duplicate=False))
    # which leading-dim rows (or [expert, row] pairs) of each parameter the checkpoint has filled
    covered = {n: torch.zeros(p.shape[:max(1, p.dim() - 1)], dtype=torch.bool) for n, p in params.items()}
    # a quantized module's weight comes as one QuantizedWeight (its tensors not fitting the format: ModelLoadError),
    # read whole and cut to this rank's shard (models/quant/shard.py); under tensor parallelism any other tensor comes
    # as a lazy slice: only the rows a rank holds are read
    tensors = _lazy_tensors(files) if tp is not None and quant is None else \
        checkpoint_tensors(files, quant, ModelLoadError, lazy=tp is not None)
    quantized: dict[str, list[tuple[int, QuantizedWeight]]] = {}  # linear module -> its slices' (first row, weight)
    experts: dict[str, dict[tuple[int, str], QuantizedWeight]] = {}  # experts module -> (expert, gate/up/down) -> w
    for path, name, tensor in tensors:
        if "rotary_emb.inv_freq" in name or is_kv_scale(name):  # kv scales: models/kv_scales.py, for an fp8 cache
            continue
        target, pieces = _place(model, params, name)
        if target is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has no place in {arch}")
        slot = expert_slot(name) if isinstance(tensor, QuantizedWeight) else None
        if slot is not None and slot[0] in kept_experts:  # the experts become a QuantExperts once all are read
            (_, src), = pieces  # tensor parallelism: this rank's intermediate rows (gate, up) or columns (down)
            experts.setdefault(slot[0], {})[slot[1:]] = rank_shard(tensor, src, name)
            for index, _ in pieces:
                covered[target][index[:covered[target].dim()]] = True
            continue
        if isinstance(tensor, QuantizedWeight):
            parts = quantized_parts(model, target, pieces, tensor) if keep_quantized else None
            if parts is not None:  # kept quantized: the module becomes a QuantLinear once all its slices are read
                quantized.setdefault(target[: -len(".weight")], []).extend(parts)
                for index, _ in pieces:
                    covered[target][index[:covered[target].dim()]] = True
                continue
            tensor = dequantize(tensor, params[target].dtype)  # into the compute dtype, then loaded as any weight
        shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
        for index, src in pieces:
            dst = params[target].data[index]
            if src is None:  # rows past the vocabulary (padding of a vocab-parallel shard), or another rank's bias
                dst.zero_()
            else:
                part = tensor[src]
                if dst.shape != part.shape:
                    raise ModelLoadError(f"{name}: shape {shape} does not match the config's {tuple(dst.shape)}")
                dst.copy_(part)  # cast on the way (a float32 checkpoint into bf16: per tensor)
            covered[target][index[:covered[target].dim()]] = True
    for module_name, parts in quantized.items():
        place_quant_linear(model, params, module_name, parts, device)
    for module_name, slots in experts.items():
        install_quant_experts(model, module_name, slots, device)
    unread = sorted(n for n, p in model.named_parameters() if p.is_meta)
    if unread:  # a kept layer that was not replaced: its checkpoint tensors did not come as its module expects
        raise ModelLoadError(f"{model_dir}: quantized weights of {unread[:8]} were not read as quantized")
    missing = sorted(n for n, c in covered.items() if not bool(c.all())
                     and not (n == "lm_head.weight" and model.tie_word_embeddings))
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ModelLoadError(f"{model_dir}: checkpoint lacks weights for {missing[:8]}{more}")
    if tied_with_head:
        if torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
            model.set_tied(True)
        else:
            log.warning("%s: tie_word_embeddings is true but the checkpoint's lm_head.weight differs from "
                        "embed_tokens.weight: both are used, untied (as transformers does)", model_dir)
    model.eval()
    return model, cfg


def build_meta_model(cfg, max_position: int, tp, dtype: torch.dtype):
    """The model of a config on the meta device, its parameters in `dtype`: every tensor shaped, nothing allocated
    (the loader materialises it; loom.engine.worker.memory_plan counts its bytes without weights). tp: a rank group,
    or any object with `rank` and `world_size` (what the layers' shapes depend on), or None."""
    with torch.device("meta"):
        return SUPPORTED_ARCHITECTURES[cfg.architectures[0]](cfg, max_position, tp=tp).to(dtype=dtype)


def materialize(model, device, keep_meta: list[str] = ()):
    """A meta model's tensors allocated (uninitialised) on `device`, the rope caches rebuilt there in float32
    (non-persistent buffers are lost by to_empty()); the parameters named in keep_meta left unallocated."""
    held = []
    for name in keep_meta:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        held.append((module, attr, module._parameters.pop(attr)))
    model = model.to_empty(device=device)
    for module, attr, p in held:
        module._parameters[attr] = p
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.rebuild(device)
    return model


def _lazy_tensors(files: list[str]):
    """(path, name, safetensors slice) of every tensor: indexing a slice reads only those rows/columns."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield path, name, f.get_slice(name)


def _has_tensor(path: str, name: str) -> bool:
    with safe_open(path, framework="pt", device="cpu") as f:
        return name in f.keys()


# checkpoint names -> ours: Mixtral's legacy block name, one expert's projection, one slice of a fused linear
_SLICES = {name: (fused, i) for fused, names in FUSED.items() for i, name in enumerate(names)}
_SLICE = re.compile(r"^(?P<pre>.*)\.(?P<proj>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<kind>weight|bias)$")


def _place(model, params: dict, name: str) -> tuple[str | None, list]:
    """(our parameter name, pieces) for a checkpoint tensor, or (None, []) if it has no place; a piece is (index
    into our parameter, index into the checkpoint tensor or None for zeros) - the module says which part it holds
    (`checkpoint_pieces`; a tensor-parallel shard holds part of the tensor, layers/parallel_linear.py).

    Phi-3's fused qkv_proj / gate_up_proj tensors have our layout (q|k|v rows, gate|up rows) and load whole; split
    q/k/v and gate/up tensors fill their slice; per-expert tensors (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj)
    fill one expert's rows of the stacked experts.gate_up_proj / down_proj, which transformers 5 files also hold
    whole."""
    name = MIXTRAL_BLOCK.sub(".mlp.", name)
    m = EXPERT.match(name)
    if m:
        experts_name = m.group("pre")
        if f"{experts_name}.gate_up_proj" not in params:
            return None, []
        e, proj = int(m.group("e")), m.group("proj")
        experts = model.get_submodule(experts_name)
        if proj in ("w2", "down_proj"):
            return f"{experts_name}.down_proj", experts.checkpoint_pieces("down_proj", e)
        half = 0 if proj in ("w1", "gate_proj") else 1
        return f"{experts_name}.gate_up_proj", experts.checkpoint_pieces("gate_up_proj", e, half)
    if name in params:
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        pieces = getattr(module, "checkpoint_pieces", None)
        return name, pieces(kind, None) if pieces is not None else [(ALL, ALL)]
    m = _SLICE.match(name)
    if m:
        fused, i = _SLICES[m.group("proj")]
        module_name = f"{m.group('pre')}.{fused}"
        target = f"{module_name}.{m.group('kind')}"
        if target in params:
            return target, model.get_submodule(module_name).checkpoint_pieces(m.group("kind"), i)
    return None, []
