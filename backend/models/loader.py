"""Load an HF model directory as is: config.json + single or sharded safetensors (never pickle)."""
from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open
from transformers import AutoConfig

from loom.layers.rotary import RotaryEmbedding
from loom.models.gemma import GemmaForCausalLM
from loom.models.llama import LlamaForCausalLM
from loom.models.quant import QuantizedWeight, checkpoint_tensors, dequantize
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


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_position: int):
    cfg = load_hf_config(model_dir)
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = SUPPORTED_ARCHITECTURES[cfg.architectures[0]](cfg, max_position)
    # Allocate once, on the target device in the target dtype (never a float32 copy first: that would be twice the
    # weights at the peak); the rope caches are rebuilt below in float32.
    model = model.to(dtype=dtype).to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):  # non-persistent buffers are lost by to_empty()
            m.rebuild(device)
    # A tied config whose checkpoint still carries its own lm_head.weight: transformers ties the two only if
    # they are equal, else it keeps both (and warns). Load both, then decide the same way.
    tied_with_head = model.tie_word_embeddings and any(_has_tensor(f, "lm_head.weight") for f in files)
    model.set_tied(model.tie_word_embeddings and not tied_with_head)

    params = dict(model.named_parameters(remove_duplicate=False))
    # which leading-dim rows (or [expert, row] pairs) of each parameter the checkpoint has filled
    covered = {n: torch.zeros(p.shape[:max(1, p.dim() - 1)], dtype=torch.bool) for n, p in params.items()}
    # a quantized module's weight comes as one QuantizedWeight (its tensors not fitting the format: ModelLoadError)
    for path, name, tensor in checkpoint_tensors(files, model.spec.quant, ModelLoadError):
        if "rotary_emb.inv_freq" in name:
            continue
        target, index = _place(model, params, name)
        if target is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has no place in {cfg.architectures[0]}")
        dst = params[target].data[index]
        if isinstance(tensor, QuantizedWeight):  # dequantised into the compute dtype, then loaded as any weight
            tensor = dequantize(tensor, dst.dtype)
        if dst.shape != tensor.shape:
            raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)} does not match the config's "
                                 f"{tuple(dst.shape)}")
        dst.copy_(tensor)  # cast on the way (a float32 checkpoint into bf16: per tensor)
        covered[target][index[:covered[target].dim()]] = True
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


def _has_tensor(path: str, name: str) -> bool:
    with safe_open(path, framework="pt", device="cpu") as f:
        return name in f.keys()


# checkpoint names -> ours: Mixtral's legacy block name, one expert's projection, one slice of a fused linear
_MIXTRAL_BLOCK = re.compile(r"\.block_sparse_moe\.")
_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_SLICES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_SLICE = re.compile(r"^(?P<pre>.*)\.(?P<proj>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<kind>weight|bias)$")


def _place(model, params: dict, name: str) -> tuple[str | None, tuple]:
    """(our parameter name, index into it) for a checkpoint tensor, or (None, ()) if it has no place.

    Phi-3's fused qkv_proj / gate_up_proj tensors have our layout (q|k|v rows, gate|up rows) and load whole; split
    q/k/v and gate/up tensors fill their slice; per-expert tensors (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj)
    fill one expert's rows of the stacked experts.gate_up_proj / down_proj, which transformers 5 files also hold
    whole."""
    name = _MIXTRAL_BLOCK.sub(".mlp.", name)
    m = _EXPERT.match(name)
    if m:
        experts_name = m.group("pre")
        if f"{experts_name}.gate_up_proj" not in params:
            return None, ()
        e, proj = int(m.group("e")), m.group("proj")
        size = model.get_submodule(experts_name).intermediate_size
        if proj in ("w2", "down_proj"):
            return f"{experts_name}.down_proj", (e,)
        half = 0 if proj in ("w1", "gate_proj") else 1
        return f"{experts_name}.gate_up_proj", (e, slice(half * size, (half + 1) * size))
    if name in params:
        return name, (slice(None),)
    m = _SLICE.match(name)
    if m:
        fused, i = _SLICES[m.group("proj")]
        module_name = f"{m.group('pre')}.{fused}"
        target = f"{module_name}.{m.group('kind')}"
        if target in params:
            offs = model.get_submodule(module_name).slice_offsets
            return target, (slice(offs[i], offs[i + 1]),)
    return None, ()
