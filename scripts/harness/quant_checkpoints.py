"""Quantized checkpoints of the tiny random models (hf_models.py), for the quantized-loading tests.

compressed-tensors checkpoints are written by compressed-tensors itself (its schemes, qparams and ModelCompressor,
as llm-compressor does after calibration; the weight scales and zero points are min-max over each group). GPTQ, AWQ
and HF fine-grained FP8 have no CPU tool here, so small packers written from each format's documentation write them:

- GPTQ (AutoGPTQ, checkpoint_format "gptq"): qweight int32 [in * bits / 32, out], the input dim packed (element j of a
  word at bit shift bits * j); qzeros int32 [groups, out * bits / 32], zero point minus one, the output dim packed;
  scales float16 [groups, out]; g_idx int32 [in] (with desc_act: a permutation's groups).
- AWQ (AutoAWQ GEMM): qweight int32 [in, out / 8], the output dim packed in the order [0, 2, 4, 6, 1, 3, 5, 7];
  qzeros int32 [groups, out / 8] packed the same way (zero points as they are); scales float16 [groups, out].
- fine-grained FP8: weight float8_e4m3fn, weight_scale_inv float32 [ceil(out / 128), ceil(in / 128)], the block's
  max |w| / 448 (it multiplies on dequantisation).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from harness.hf_models import build_hf_model, hf_config

# hidden and intermediate sizes that hold 128-column groups (1-3 of them per row)
GROUPED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=8, num_key_value_heads=4)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantized_linears(state: dict) -> list[str]:
    """The linear weights a quantizer converts: every 2-D projection weight (MoE experts' too: Mixtral's w1 / w2 / w3)
    but lm_head, the embeddings and the MoE routers."""
    return sorted(n for n, t in state.items() if t.dim() == 2 and n.endswith(("proj.weight", ".w1.weight",
                                                                               ".w2.weight", ".w3.weight")))


def checkpoint_state(model) -> dict:
    """The float model's tensors under the names its checkpoint gives them (transformers 5 saves MoE experts one
    tensor per expert and projection, as the hub's checkpoints hold them, though the model stacks them)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        return {k: v.clone() for k, v in load_file(os.path.join(d, "model.safetensors")).items()}


def _linear_tree(state: dict, names: list[str]) -> torch.nn.Module:
    """nn.Linear modules holding state's weights `names`, at their checkpoint paths (what llm-compressor quantizes:
    for MoE models the per-expert linears its calibration modules expose)."""
    root = torch.nn.Module()
    for n in names:
        *path, leaf = n[: -len(".weight")].split(".")
        parent = root
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        w = state[n]
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.clone()
        parent.add_module(leaf, linear)
    return root


def _save(model, path: str, state: dict, quant_config: dict) -> str:
    model.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def _float_model(arch: str, overrides: dict):
    return build_hf_model(hf_config(arch, **{**GROUPED, **overrides}))


# ---- compressed-tensors, by compressed-tensors ----

def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """What a memoryless min-max observer sees, per the strategy's scale shape."""
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    r, c = args.block_structure
    b = w.unflatten(0, (-1, r)).unflatten(-1, (-1, c))
    return b.amin((1, 3)), b.amax((1, 3))


@torch.no_grad()
def _quantize_and_compress(model, qs, fmt: str | None = None):
    """Quantize model's Linear layers (but lm_head) by scheme qs with min-max qparams, then compress them in place as
    compressed-tensors writes a checkpoint (format fmt, or its default for the scheme): -> the ModelCompressor (its
    update_config writes the quantization_config of the saved folder)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qs}, ignore=["lm_head"]),
                              show_progress=False)
    for m in model.modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None:
            continue
        scale, zp = calculate_qparams(*_minmax(m.weight, s.weights), s.weights)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zp.to(m.weight_zero_point.dtype).reshape(m.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    return compressor


def make_ct_moe_checkpoint(arch: str, root, scheme, name: str, fmt: str | None = None, **overrides):
    """make_ct_checkpoint for a MoE family: every projection, experts included (one linear per expert and projection,
    as the checkpoint names them), quantized and compressed by compressed-tensors; the routers, lm_head and the
    embeddings left in float -> (float model, path)."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    model = _float_model(arch, overrides)
    state = checkpoint_state(model)
    names = quantized_linears(state)
    tree = _linear_tree(state, names)
    qs = preset_name_to_scheme(scheme, ["Linear"]) if isinstance(scheme, str) else \
        QuantizationScheme(targets=["Linear"], **scheme)
    compressor = _quantize_and_compress(tree, qs, fmt)
    out = {k: v for k, v in state.items() if k not in set(names)}
    out.update(tree.state_dict())
    path = _save(model, os.path.join(str(root), name), out, {})
    compressor.update_config(path)
    return model, path


def make_ct_checkpoint(arch: str, root, scheme, name: str, fmt: str | None = None, **overrides):
    """A tiny model quantized and compressed by compressed-tensors -> (float model, path). `scheme`: a preset name
    (W4A16, W4A16_ASYM, W8A16, FP8, FP8_DYNAMIC, FP8_BLOCK, W8A8) or a dict of QuantizationScheme fields; `fmt`
    forces the compression format (e.g. naive-quantized); lm_head is left unquantized."""
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    model = _float_model(arch, overrides)
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    qs = preset_name_to_scheme(scheme, ["Linear"]) if isinstance(scheme, str) else \
        QuantizationScheme(targets=["Linear"], **scheme)
    compressor = _quantize_and_compress(model, qs, fmt)
    path = os.path.join(str(root), name)
    model.save_pretrained(path, safe_serialization=True)
    compressor.update_config(path)
    float_model = _float_model(arch, overrides)
    float_model.load_state_dict(float_state)
    return float_model, path


# ---- GPTQ and AWQ, from their documentation ----

def pack_along(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unsigned ints -> int32 words, `32 // bits` consecutive values along `dim` per word, the value at position
    order[i] (default i) of each run at bit shift bits * i."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.unflatten(-1, (-1, per))
    if order is not None:
        v = v[..., list(order)]
    words = (v << (torch.arange(per) * bits)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _int_quantize(w: torch.Tensor, bits: int, groups: torch.Tensor, n_groups: int, sym: bool):
    """Per (output row, group) min-max quantization -> unsigned q [out, in], scales and zeros [n_groups, out]."""
    maxq = 2 ** bits - 1
    scales = torch.empty(n_groups, w.shape[0])
    zeros = torch.empty(n_groups, w.shape[0], dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-8).half().float()  # stored as float16
        z = torch.full_like(lo, 2 ** (bits - 1)).long() if sym else (-lo / s).round().clamp(1, maxq).long()
        scales[g], zeros[g] = s, z
    q = (w / scales[groups].t()).round() + zeros[groups].t()
    return q.clamp(0, maxq).long(), scales.half(), zeros


def gptq_pack(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True, desc_act: bool = False,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """One linear weight [out, in] as an AutoGPTQ (v1) checkpoint stores it; desc_act: groups over a seeded random
    permutation of the input columns (GPTQ orders them by the Hessian's diagonal)."""
    out, inp = w.shape
    size = inp if group_size == -1 else group_size
    order = torch.randperm(inp, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // size).to(torch.int32)
    n_groups = -(-inp // size)
    q, scales, zeros = _int_quantize(w.float(), bits, g_idx.long(), n_groups, sym)
    return {"qweight": pack_along(q.t(), bits, 0), "qzeros": pack_along((zeros - 1) & (2 ** bits - 1), bits, 1),
            "scales": scales, "g_idx": g_idx}


def awq_pack(w: torch.Tensor, group_size: int = 128) -> dict[str, torch.Tensor]:
    """One linear weight [out, in] as AutoAWQ's GEMM layout stores it (4-bit, zero points)."""
    inp = w.shape[1]
    n_groups = inp // group_size
    q, scales, zeros = _int_quantize(w.float(), 4, torch.arange(inp) // group_size, n_groups, sym=False)
    return {"qweight": pack_along(q.t(), 4, 1, AWQ_ORDER), "qzeros": pack_along(zeros, 4, 1, AWQ_ORDER),
            "scales": scales}


def fp8_block_pack(w: torch.Tensor, block=(128, 128)) -> dict[str, torch.Tensor]:
    """One linear weight as a fine-grained FP8 checkpoint stores it: per-block max |w| / 448."""
    out, inp = w.shape
    r, c = block
    pad = torch.nn.functional.pad(w.float(), (0, -inp % c, 0, -out % r))
    blocks = pad.unflatten(0, (-1, r)).unflatten(-1, (-1, c))
    scale = (blocks.abs().amax((1, 3)) / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(r, 0)[:out].repeat_interleave(c, 1)[:, :inp]
    return {"weight": (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def make_packed_checkpoint(arch: str, root, method: str, name: str, pack_kw: dict | None = None, **overrides):
    """A tiny model whose projections are GPTQ / AWQ / fine-grained FP8 packed -> (float model, path)."""
    model = _float_model(arch, overrides)
    pack_kw = dict(pack_kw or {})
    state = checkpoint_state(model)
    for i, n in enumerate(quantized_linears(state)):
        module = n[: -len(".weight")]
        w = state.pop(n)
        if method == "gptq":
            parts = gptq_pack(w, seed=i, **pack_kw)
        elif method == "awq":
            parts = awq_pack(w, **pack_kw)
        else:
            parts = fp8_block_pack(w, **pack_kw)
        state.update({f"{module}.{k}": v for k, v in parts.items()})
    if method == "gptq":
        qc = dict(quant_method="gptq", bits=pack_kw.get("bits", 4), group_size=pack_kw.get("group_size", 128),
                  desc_act=pack_kw.get("desc_act", False), sym=pack_kw.get("sym", True), checkpoint_format="gptq",
                  damp_percent=0.01, true_sequential=True)
    elif method == "awq":
        qc = dict(quant_method="awq", bits=4, group_size=pack_kw.get("group_size", 128), zero_point=True,
                  version="gemm", modules_to_not_convert=None)
    else:
        qc = dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=list(pack_kw.get("block",
                                                                                                       (128, 128))))
    return model, _save(model, os.path.join(str(root), name), state, qc)


# ---- QuantizedWeight inputs for the quantized GEMM kernels (loom.kernels.quant_gemm / fp8_gemm) ----

def int_weight(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True, desc_act: bool = False,
               seed: int = 0):
    """One linear weight [out, in] as loom's loader holds a GPTQ checkpoint of it: gptq_pack (group_size -1: one
    group per channel), read by the GPTQ reader; symmetric without zero points (as compressed-tensors' symmetric
    schemes are read; the same weight: GPTQ's symmetric zero point is 2**(bits - 1)). An input width GPTQ cannot
    pack (not a multiple of 32 / bits) is zero-padded for packing and cut back (its word's tail is never read)."""
    from loom.models.quant.gptq import Gptq
    from loom.models.quant.weight import QuantizedWeight

    out, inp = w.shape
    pad = -inp % (32 // bits)
    assert not (pad and desc_act), "act-order groups over padded columns would not match the unpadded weight"
    parts = gptq_pack(torch.nn.functional.pad(w, (0, pad)), bits=bits, group_size=group_size, sym=sym,
                      desc_act=desc_act, seed=seed)
    qw = Gptq(bits, None if group_size == -1 else group_size, desc_act, sym, 1).read("w", parts)
    qw = QuantizedWeight(shape=(out, inp), kind="int", bits=bits, weight=qw.weight, scale=qw.scale,
                         zero=None if sym else qw.zero, group_size=qw.group_size,
                         g_idx=None if qw.g_idx is None else qw.g_idx[:inp])
    qw.validate()
    return qw


def fp8_weight(w: torch.Tensor, granularity: str = "block", block=(128, 128)):
    """One linear weight [out, in] as an FP8 QuantizedWeight, by fp8_block_pack: `block` (HF fine-grained),
    `channel` (one scale per output row) or `tensor` (one scale)."""
    from loom.models.quant.weight import QuantizedWeight

    out, inp = w.shape
    shape = {"block": block, "channel": (1, inp), "tensor": (out, inp)}[granularity]
    parts = fp8_block_pack(w, shape)
    qw = QuantizedWeight(shape=(out, inp), kind="fp8", bits=8, weight=parts["weight"],
                         scale=parts["weight_scale_inv"], block=tuple(block) if granularity == "block" else None)
    qw.validate()
    return qw


def launch_quant_kernels(dtype: torch.dtype, a16: bool = True, w8a8: bool = True) -> None:
    """Launch the quantized-GEMM kernel variants on CPU tensors of serving-like shapes, at decode and prefill batch
    sizes: for scripts/kernel_compile_check.py, which intercepts the launches and compiles them. a16: the weight-only
    paths (int4 / int8 / fp8 weights, any GPU); w8a8: the FP8 W8A8 path (FP8 tensor cores: compile it for sm_89+
    targets only)."""
    from loom.kernels import fp8_gemm, quant_gemm

    N, K = 256, 512
    w = torch.randn(N, K) * 0.05
    fp8s = [fp8_weight(w, g) for g in ("block", "channel", "tensor")]
    # tile-constant groups / act-order gather / per channel / groups narrower than the tile
    ints = [int_weight(w, 4, 128, sym=True), int_weight(w, 4, 128, sym=False, desc_act=True),
            int_weight(w, 8, -1, sym=False), int_weight(w, 4, 32, sym=True)] if a16 else []
    bias = torch.zeros(N, dtype=dtype)
    for M in (1, 300):
        x = torch.zeros(M, K, dtype=dtype)
        for qw in ints + (fp8s if a16 else []):
            quant_gemm.quant_gemm_triton(x, qw, bias)
        for qw in fp8s if w8a8 else []:
            fp8_gemm.fp8_gemm_triton(x, qw, bias, capability=(9, 0))


@torch.no_grad()
def quantize_model_dir(src: str, dst: str, scheme: str = "W4A16") -> str:
    """An HF model folder quantized by compressed-tensors into `dst` (round-to-nearest, min-max scales as
    make_ct_checkpoint: no calibration data; the projections of every decoder layer, lm_head and the embeddings left
    as they are), with its tokenizer files. `scheme`: a preset (W4A16: int4 groups of 128, symmetric - halved until
    they divide every input width; W8A16: int8 per output channel, symmetric; ...). Kept if `dst` already holds a
    config.json (delete it to remake)."""
    import shutil

    from compressed_tensors.quantization import preset_name_to_scheme
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    qs = preset_name_to_scheme(scheme, ["Linear"])
    size = qs.weights.group_size
    if size:  # groups that divide every projection's input width (SmolLM2's 576: 64, not the preset's 128)
        widths = {m.in_features for n, m in model.named_modules() if n.endswith("proj")}
        while any(w % size for w in widths):
            size //= 2
        qs.weights.group_size = size
    compressor = _quantize_and_compress(model, qs)
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    compressor.update_config(tmp)
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "generation_config")) and not os.path.exists(
                os.path.join(tmp, f)):
            shutil.copy(os.path.join(src, f), os.path.join(tmp, f))
    os.replace(tmp, dst)
    return dst
