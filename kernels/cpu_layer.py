"""A Llama-class or Gemma decoder layer in one C++ call on CPU (kernels/csrc/layer.cpp): the kernels the Python layer
path calls one by one (RMS norms, packed GEMMs or weight-only quantized ones with their LoRA, rope, KV store, paged
attention, the gated activation), with the same arguments in the same order, so the same bits, without ~115 us of
Python a layer around them.

`LayerArgs` holds one layer's weights, caches and pools as the C++ side reads them (made once, again when a pointer
changes); `StepArgs` what every layer of a step shares (batch, attention metadata, LoRA groups). Whether an engine
runs it is kernels/policy.py's decision (layer_pass), which layers take it models/layer_pass.py's.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch

from loom.kernels import cpu_ext, cpu_lora
from loom.kernels.cpu_linear import PackedBf16, PackedWeight, row_block
from loom.kernels.cpu_paged_attention import PREFILL_TILE, attention_options
from loom.kernels.cpu_quant import PackedQuantWeight
from loom.kernels.cpu_quant_bf16 import PackedQuantBf16
from loom.kernels.kv_layout import block_size_of

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Quant(ctypes.Structure):
    _fields_ = [("q", _P), ("col", _I64), ("N", _I64), ("kernel", _I64), ("kind", _I64), ("scale", _P), ("zero", _P),
                ("zc", _F32), ("gb", _P), ("groups", _I64), ("perm", _P), ("kp", _I64)]


class _Linear(ctypes.Structure):
    _fields_ = [("panels", _P), ("N", _I64), ("bias", _P), ("lora_a", _P), ("lora_b", _P), ("dt", _I64), ("S", _I64),
                ("R", _I64), ("ak", _I64), ("bn", _I64), ("offs", _P), ("parts", _P), ("nparts", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("norm_in", _P),
                ("norm_post", _P), ("eps", _F32), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("inter", _I64), ("cos_sin", _P), ("k_cache", _P), ("v_cache", _P),
                ("block_size", _I64), ("scale", _F32), ("window", _I64), ("softcap", _F32), ("q_norm", _P),
                ("k_norm", _P), ("qk_eps", _F32), ("rotary_dim", _I64), ("norm_post_attn", _P), ("norm_post_ff", _P),
                ("gelu", _I64), ("attn_only", _I64), ("act", _I64), ("norm_f32", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [("T", _I64), ("positions", _P), ("slots", _P), ("num_decode", _I64), ("dec_bt", _P),
                ("dec_bt_width", _I64), ("dec_sl", _P), ("num_prefill", _I64), ("pre_cu", _P), ("pre_sl", _P),
                ("pre_bt", _P), ("pre_bt_width", _I64), ("prefill_tile", _I64), ("tok", _P), ("seg", _P),
                ("rows", _P), ("ranks", _P), ("scal", _P), ("groups", _I64), ("fuse_min", _I64), ("lora_mask", _I64),
                ("mc_hidden", _I64), ("mc_q", _I64), ("mc_inter", _I64), ("nthreads", _I32)]


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _f32(*tensors: Optional[torch.Tensor]) -> bool:
    return all(t is None or (cpu_ext.usable(t) and t.is_contiguous()) for t in tensors)


def _of(dtype: torch.dtype, *tensors: Optional[torch.Tensor]) -> bool:
    return all(t is None or (t.is_cpu and t.dtype == dtype and t.is_contiguous()) for t in tensors)


class QuantPart(NamedTuple):
    """A quantized linear layer's weights (layers/quant_linear.QuantLinear's parts: (first output column, weight)
    pairs) and its bias: the C++ layer runs the weight-only GEMMs its Python forward runs (PackedQuantWeight's; a
    bfloat16 layer's PackedQuantBf16's too), each into its columns."""
    parts: list
    bias: Optional[torch.Tensor]

    @property
    def lib(self):
        return self.parts[0][1].lib

    @property
    def in_features(self) -> int:
        return self.parts[0][1].in_features


def _takes(p, dtype: torch.dtype) -> bool:
    """Whether the C++ layer of this activation dtype runs this linear: dense panels of its GEMM (a float32 bias), or
    quantized weights whose kernels the Python layer would call for these activations."""
    if isinstance(p, QuantPart):
        kinds = (PackedQuantWeight,) if dtype == torch.float32 else (PackedQuantWeight, PackedQuantBf16)
        return all(isinstance(w, kinds) and w.lib is p.lib for _, w in p.parts) and \
            (p.bias is None or (p.bias.is_cpu and p.bias.dim() == 1))
    return isinstance(p, PackedWeight if dtype == torch.float32 else PackedBf16) and _f32(p.bias)


class LayerArgs:
    """One layer's tensors as loom_decoder_layer reads them (layer_args() makes it)."""

    def __init__(self, lib, struct: _Layer, keep: list, hidden: int, q_size: int, inter: int,
                 dtype: torch.dtype = torch.float32):
        self.lib, self.struct, self.keep = lib, struct, keep  # keep: tensors only the struct points to
        self.hidden, self.q_size, self.inter = hidden, q_size, inter
        self.dtype = dtype  # of the activations, caches and workspace: float32 or bfloat16
        self.attn_only = bool(struct.attn_only)  # a MoE layer: the call stops at its block's input

    def workspace_floats(self, T: int) -> int:
        return self.lib.loom_decoder_layer_workspace(ctypes.byref(self.struct), T)


def layer_args(linears, norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float, heads: int, kv_heads: int,
               head_dim: int, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               window: Optional[int], softcap: Optional[float], qk_norms: Optional[tuple] = None,
               rotary_dim: Optional[int] = None, output_norms: Optional[tuple] = None,
               gelu: bool = False) -> Optional[LayerArgs]:
    """linears: (PackedWeight or QuantPart, lora_a or None, lora_b or None, slice_offsets) of q|k|v, o, gate|up and
    down, or of q|k|v and o only (a MoE layer: the call stops at the MLP's input, x_out);
    norm_post: the norm before the MLP; qk_norms: (q weight, k weight, eps) of per-head norms before rope (Qwen3,
    Gemma 3); rotary_dim: the dims of each head rope turns (head_dim when None); output_norms: (attention output,
    MLP output) norm weights (Gemma); gelu: the MLP's activation is GELU-tanh, not SiLU. Norm weights as the kernel
    multiplies by (Gemma's 1 + w already added). None when a tensor is not what the kernels read (the layer then
    runs its Python path).

    bfloat16 (the caches' dtype): every linear a PackedBf16 (loom's bfloat16 GEMM) or a QuantPart, the norm weights
    all bfloat16 or all float32; each linear's LoRA runs after its GEMM on the bfloat16 output (lora.cpp
    run_pass_bf16)."""
    if not all(a is None or cpu_ext.adapter_type(a, b) is not None for _, a, b, _ in linears):
        return None
    dtype = k_cache.dtype
    if dtype not in (torch.float32, torch.bfloat16) or not all(_takes(p, dtype) for p, *_ in linears):
        return None
    if dtype == torch.bfloat16:
        return _bf16_layer_args(linears, norm_in, norm_post, eps, heads, kv_heads, head_dim, cos_sin, k_cache, v_cache,
                                scale, window, softcap, qk_norms, rotary_dim, output_norms, gelu)
    lib = linears[0][0].lib
    q_norm, k_norm, qk_eps = qk_norms or (None, None, 0.0)
    post_attn, post_ff = output_norms or (None, None)
    if any(p.lib is not lib for p, *_ in linears) or not _f32(norm_in, norm_post, cos_sin, k_cache, v_cache, q_norm,
                                                               k_norm, post_attn, post_ff) \
            or k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        return None
    keep = []
    structs = _linear_structs(linears, keep)
    window, cap = attention_options(window, softcap)
    attn_only = len(linears) == 2
    hidden, inter = linears[0][0].in_features, 0 if attn_only else linears[3][0].in_features
    structs += [_Linear()] * (4 - len(structs))
    struct = _Layer(*structs, norm_in.data_ptr(), norm_post.data_ptr(), eps, hidden, heads, kv_heads, head_dim, inter,
                    cos_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_size_of(k_cache), scale, window,
                    cap, _ptr(q_norm), _ptr(k_norm), qk_eps, rotary_dim or head_dim, _ptr(post_attn), _ptr(post_ff),
                    int(gelu), int(attn_only), 0, 0)
    keep += [norm_in, norm_post, q_norm, k_norm, post_attn, post_ff]  # (1 + w) copies live only here
    return LayerArgs(lib, struct, keep, hidden, heads * head_dim, inter)


def _linear_structs(linears, keep: list) -> list:
    """The linears as the C++ layer reads them: panels (or a quantized weight), bias, LoRA pools and slice offsets
    (added to keep)."""
    structs = []
    for p, a, b, offs in linears:
        o = cpu_lora.offsets_tensor(tuple(offs))
        keep.append(o)
        lora = (_ptr(a), _ptr(b), 0 if a is None else cpu_ext.ADAPTER_TYPES[a.dtype], 0 if a is None else a.shape[0],
                0 if a is None else a.shape[1], 0 if a is None else a.stride(1), 0 if b is None else b.stride(0),
                o.data_ptr())
        if isinstance(p, QuantPart):
            structs.append(_quant_struct(p, lora, keep))
        else:
            structs.append(_Linear(p.panels.data_ptr(), p.out_features, _ptr(p.bias), *lora, None, 0))
    return structs


def _quant_struct(p: QuantPart, lora: tuple, keep: list) -> _Linear:
    """A quantized linear: each part's packed bytes, scales, zero points and groups as its kernel's Python call passes
    them; the bias widened once here (the Python call widens it each time: the same values)."""
    parts = (_Quant * len(p.parts))()
    for i, (col, w) in enumerate(p.parts):
        perm = None if w.perm is None else w.perm.to(torch.int64).contiguous()
        keep += [w, perm]
        if isinstance(w, PackedQuantBf16):
            kernel, kind, kp = 2 if w.emulate else 1, int(w.bits == 4), w.kp
        else:
            kernel, kind, kp = 0, w.kind, w.in_features
        parts[i] = _Quant(w.q.data_ptr(), col, w.out_features, kernel, kind, w.scale.data_ptr(), _ptr(w.zero), w.zc,
                          w.bounds.data_ptr(), w.groups, _ptr(perm), kp)
    bias = None if p.bias is None else p.bias.detach().float().contiguous()
    keep += [parts, bias]
    N = p.parts[-1][0] + p.parts[-1][1].out_features
    return _Linear(None, N, _ptr(bias), *lora, ctypes.addressof(parts), len(p.parts))


def _bf16_layer_args(linears, norm_in, norm_post, eps, heads, kv_heads, head_dim, cos_sin, k_cache, v_cache, scale,
                     window, softcap, qk_norms, rotary_dim, output_norms, gelu) -> Optional[LayerArgs]:
    """layer_args for a bfloat16 layer over loom's bfloat16 GEMM (and weight-only quantized ones)."""
    lib = linears[0][0].lib
    q_norm, k_norm, qk_eps = qk_norms or (None, None, 0.0)
    post_attn, post_ff = output_norms or (None, None)
    norms = (norm_in, norm_post, q_norm, k_norm, post_attn, post_ff)
    norm_f32 = norm_in.dtype == torch.float32
    if any(p.lib is not lib for p, *_ in linears) or not _f32(cos_sin) \
            or not _of(torch.float32 if norm_f32 else torch.bfloat16, *norms) \
            or not _of(torch.bfloat16, k_cache, v_cache) or k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        return None
    keep = list(norms)
    structs = _linear_structs(linears, keep)
    window, cap = attention_options(window, softcap)
    attn_only = len(linears) == 2
    hidden, inter = linears[0][0].in_features, 0 if attn_only else linears[3][0].in_features
    structs += [_Linear()] * (4 - len(structs))
    struct = _Layer(*structs, norm_in.data_ptr(), norm_post.data_ptr(), eps, hidden, heads, kv_heads, head_dim, inter,
                    cos_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_size_of(k_cache), scale, window,
                    cap, _ptr(q_norm), _ptr(k_norm), qk_eps, rotary_dim or head_dim, _ptr(post_attn), _ptr(post_ff),
                    int(gelu), int(attn_only), cpu_ext.ACT_CODES[torch.bfloat16], int(norm_f32))
    return LayerArgs(lib, struct, keep, hidden, heads * head_dim, inter, torch.bfloat16)


class StepArgs:
    """What every layer of one step reads: made once per forward context."""

    def __init__(self, T: int, positions: torch.Tensor, slots: torch.Tensor, num_decode: int, decode, prefill,
                 lora, lora_groups: tuple[bool, bool, bool, bool], hidden: int, q_size: int, inter: int):
        def c32(t):
            return cpu_ext.contiguous(t, torch.int32)

        keep = [positions, slots]
        dec_bt = dec_sl = pre_cu = pre_sl = pre_bt = None
        if num_decode:
            dec_bt, dec_sl = c32(decode.block_tables), c32(decode.seq_lens)
        if prefill is not None:
            pre_cu, pre_sl, pre_bt = c32(prefill.cu_seqlens_q), c32(prefill.seq_lens), c32(prefill.block_tables)
        keep += [dec_bt, dec_sl, pre_cu, pre_sl, pre_bt]
        tok = seg = rows = ranks = scal = None
        groups = mask = 0
        if lora is not None and lora.num_groups and lora.token_indices.numel():
            tok, seg, rows, ranks, scal = cpu_lora.group_arrays(lora)
            keep += [tok, seg, rows, ranks, scal]
            groups = lora.num_groups
            mask = sum(1 << i for i, on in enumerate(lora_groups) if on)
        self.keep = keep
        self.struct = _Step(T, positions.data_ptr(), slots.data_ptr(), num_decode, _ptr(dec_bt),
                            0 if dec_bt is None else dec_bt.shape[1], _ptr(dec_sl),
                            0 if pre_sl is None else pre_sl.shape[0], _ptr(pre_cu), _ptr(pre_sl), _ptr(pre_bt),
                            0 if pre_bt is None else pre_bt.shape[1], PREFILL_TILE, _ptr(tok), _ptr(seg), _ptr(rows),
                            _ptr(ranks), _ptr(scal), groups, cpu_lora.FUSE_MIN_TOKENS, mask, row_block(T, hidden),
                            row_block(T, q_size), row_block(T, inter) if inter else 0, cpu_ext.nthreads())
        self.T = T


def decoder_layer(layer: LayerArgs, step: StepArgs, x: torch.Tensor, residual: Optional[torch.Tensor],
                  workspace: torch.Tensor, x_out: torch.Tensor, res_out: torch.Tensor,
                  following: Optional[LayerArgs] = None) -> None:
    """x, residual [T, hidden] of layer.dtype, contiguous -> x_out (the layer's MLP output), res_out (its residual).
    following: the layer that runs next, whose q|k|v adapter rows the last GEMM asks for while it computes (only
    read as a hint: what it points to must stay allocated, not be current)."""
    layer.lib.loom_decoder_layer(ctypes.byref(layer.struct), ctypes.byref(step.struct), x.data_ptr(),
                                 _ptr(residual), workspace.data_ptr(), x_out.data_ptr(), res_out.data_ptr(),
                                 None if following is None else ctypes.byref(following.struct))
