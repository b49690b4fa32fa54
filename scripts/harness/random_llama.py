"""Random-weight Llama model folders at real shapes (1B- and 8B-class) for the GPU check, and their byte counts.

The weights are drawn on the device and streamed into one safetensors file tensor by tensor (an 8B model is
16 GB: never held twice in host memory). No tokenizer: the engine takes token ids.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch

_COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
               hidden_act="silu", bos_token_id=128000, eos_token_id=128001)
LLAMA_1B = dict(_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                tie_word_embeddings=True, torch_dtype="bfloat16")  # Llama-3.2-1B shapes
LLAMA_8B = dict(_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                tie_word_embeddings=False, torch_dtype="bfloat16")  # Llama-3.1-8B shapes
# the same code paths on CPU in a fraction of a second (--cpu-smoke)
TINY_A = dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
              tie_word_embeddings=True, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
TINY_B = dict(TINY_A, hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
              tie_word_embeddings=False)

_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(HF name, shape, is a norm weight) of every tensor of the checkpoint."""
    h, inter, hd, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    specs = [("model.embed_tokens.weight", (v, h), False)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (nq * hd, h), "self_attn.k_proj": (nkv * hd, h),
                  "self_attn.v_proj": (nkv * hd, h), "self_attn.o_proj": (h, nq * hd), "mlp.gate_proj": (inter, h),
                  "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
        specs += [(f"{p}{m}.weight", s, False) for m, s in shapes.items()]
        specs += [(p + "input_layernorm.weight", (h,), True), (p + "post_attention_layernorm.weight", (h,), True)]
    specs.append(("model.norm.weight", (h,), True))
    if not cfg.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (v, h), False))
    return specs


def write_random_llama(path: Path, cfg: dict, device, seed: int = 0) -> Path:
    """config.json + model.safetensors with N(0, 0.02) weights (norms N(1, 0.02)) in the config's dtype."""
    dtype = getattr(torch, cfg["torch_dtype"])
    specs = tensor_specs(cfg)
    es = torch.tensor([], dtype=dtype).element_size()
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        n = es * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)  # the data starts 8-byte aligned
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape, is_norm in specs:
            t = torch.randn(shape, generator=gen, device=device) * 0.02 + (1.0 if is_norm else 0.0)
            f.write(t.to(dtype).cpu().contiguous().view(torch.uint8).numpy().data)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def scratch_root(work_dir: Path, need_bytes: int) -> Path:
    """/dev/shm when it has room (a 16 GB checkpoint is written and read back in seconds), else work_dir."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * need_bytes:
            return shm
    except OSError:
        pass
    return work_dir


def ensure_random_llama(work_dir: Path, name: str, cfg: dict, device) -> str:
    """The model folder `name` under work_dir, written once (sections that share a model find it there)."""
    link = Path(work_dir) / name
    if (link / "config.json").is_file():
        return str(link.resolve())
    root = scratch_root(Path(work_dir), checkpoint_bytes(cfg))
    # outside work_dir the folder is named after work_dir's full path: two work dirs of the same base name (pytest's
    # tmp_path of one test in two runs) never share it; a leftover of a killed run of this work_dir is replaced
    key = hashlib.sha1(str(Path(work_dir).resolve()).encode()).hexdigest()[:12]
    target = root / f"loom-{key}-{name}" if root != Path(work_dir) else link
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_random_llama(tmp, cfg, device)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    if target != link:
        link.symlink_to(target, target_is_directory=True)
    return str(target)


def remove_scratch(work_dir: Path) -> None:
    """Delete the model folders ensure_random_llama placed outside work_dir."""
    for p in Path(work_dir).iterdir():
        if p.is_symlink():
            shutil.rmtree(p.resolve(), ignore_errors=True)
            p.unlink()


def checkpoint_bytes(cfg: dict) -> int:
    es = torch.tensor([], dtype=getattr(torch, cfg["torch_dtype"])).element_size()
    return sum(es * int(torch.Size(s).numel()) for _, s, _ in tensor_specs(cfg))


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input embedding (only the
    batch's rows are read; a tied one is read whole as the LM head)."""
    seen, total = set(), 0
    tied = getattr(model, "tie_word_embeddings", False)
    for name, p in model.named_parameters():
        if id(p) in seen or ("embed_tokens" in name and not tied):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(cfg: dict, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    es = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * es
