"""Load an HF model directory as is: config.json + single or sharded safetensors (never pickle)."""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from transformers import AutoConfig

from loom.models.llama import LlamaForCausalLM

log = logging.getLogger("loom")

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
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
    # Materialise on the target device in the target dtype; buffers (rope cache) stay float32.
    model = model.to_empty(device=device)
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            p.data = p.data.to(dtype)
    _rebuild_buffers(model, cfg, max_position, device)
    # A tied config whose checkpoint still carries its own lm_head.weight: transformers ties the two only if
    # they are equal, else it keeps both (and warns). Load both, then decide the same way.
    tied_with_head = model.tie_word_embeddings and any(_has_tensor(f, "lm_head.weight") for f in files)
    model.set_tied(model.tie_word_embeddings and not tied_with_head)

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, slice_idx = _map_name(name, model.stacked_params)
                if target not in params:
                    raise ModelLoadError(f"{path}: tensor {name!r} has no place in {cfg.architectures[0]}")
                tensor = f.get_tensor(name).to(dtype)
                if slice_idx is None:
                    p = params[target]
                    if p.shape != tensor.shape:
                        raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)} does not match the config's {tuple(p.shape)}")
                    p.data.copy_(tensor)
                else:
                    module = model.get_submodule(target.rsplit(".", 1)[0])
                    if target.endswith(".bias"):
                        lo, hi = module.slice_offsets[slice_idx], module.slice_offsets[slice_idx + 1]
                        module.bias.data[lo:hi].copy_(tensor)
                    else:
                        try:
                            module.load_slice(slice_idx, tensor)
                        except ValueError as e:
                            raise ModelLoadError(f"{name}: {e}") from None
                loaded.add(f"{target}#{slice_idx}")
    expected = _expected_keys(model)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"{model_dir}: checkpoint lacks weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
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


def _map_name(name: str, stacked: dict) -> tuple[str, int | None]:
    for hf, (merged, idx) in stacked.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{merged}."), idx
    return name, None


def _expected_keys(model) -> set[str]:
    keys = set()
    for name, module in model.named_modules():
        n_slices = len(getattr(module, "output_sizes", [])) if hasattr(module, "slice_offsets") else 0
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if full == "lm_head.weight" and model.tie_word_embeddings:
                continue
            if n_slices > 1:
                keys.update(f"{full}#{i}" for i in range(n_slices))
            else:
                keys.add(f"{full}#None")
    return keys


def _rebuild_buffers(model, cfg, max_position: int, device) -> None:
    """Non-persistent buffers are lost by to_empty(); recompute them on the device."""
    from loom.layers.rotary import RotaryEmbedding, rope_parameters

    theta, scaling = rope_parameters(cfg)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            head_dim = m.cos_sin_cache.shape[-1]
            fresh = RotaryEmbedding(head_dim, max_position, theta, scaling)
            m.cos_sin_cache = fresh.cos_sin_cache.to(device)
