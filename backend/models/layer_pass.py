"""On CPU, each decoder layer of the eager forward in one C++ call (kernels/cpu_layer.py).

The engine sets a LayerPass as the decoder's `layer_pass` where its kernel path says so (kernels/policy.py: the C++
kernels, packed weights, an eager forward; engine/worker/cpu.py sets it). A layer
takes it when it is a Llama-class or Gemma decoder layer (Llama, Mistral, Qwen2, Qwen3's per-head q/k norms, Phi-3's
partial rotary, Gemma 2/3's norms around attention and MLP and GELU) whose tensors the C++ kernels read (each linear
packed for the dense GEMM, or a quantized checkpoint's weight re-laid out for a weight-only one); in a MoE
layer (Mixtral, Qwen3-MoE) the call stops at the MLP's input and the block runs after it. Every step the kernels
would not take runs the Python path. Both give the same bits: the C++ layer calls the same kernels with the same
arguments.
"""
from __future__ import annotations

from typing import Optional

import torch

from loom.kernels import gelu_tanh_and_mul, silu_and_mul
from loom.kernels.cpu_layer import LayerArgs, QuantPart, StepArgs, decoder_layer, layer_args
from loom.kernels.cpu_quant import PackedQuantBase
from loom.layers.forward_context import get_forward_context
from loom.layers.linear import LoRALinear
from loom.layers.moe import SparseMoeBlock
from loom.layers.norm import RMSNorm
from loom.layers.quant_linear import QuantLinear
from loom.models.gemma import GemmaDecoderLayer
from loom.models.llama import MLP, LlamaDecoderLayer

_GROUPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _linears(layer) -> tuple:
    """q|k|v, o, and the dense MLP's gate|up and down (none for a MoE block)."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is SparseMoeBlock:
        return attn.qkv_proj, attn.o_proj
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _norms(layer) -> tuple:
    """(before attention, after attention or None, before the MLP, after the MLP or None): the C++ layer's order."""
    if type(layer) is GemmaDecoderLayer:
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)
    return layer.input_layernorm, None, layer.post_attention_layernorm, None


def _eligible(layer) -> bool:
    if type(layer) not in (LlamaDecoderLayer, GemmaDecoderLayer):
        return False
    o_proj = layer.self_attn.o_proj
    # tensor-parallel (a RowParallelLinear, or a QuantLinear holding a row-parallel shard): no all-reduce in C++
    if type(o_proj) not in (LoRALinear, QuantLinear) or getattr(o_proj, "reduce", None) is not None:
        return False
    mlp = layer.mlp
    if not (type(mlp) is MLP and mlp.act_and_mul in (silu_and_mul, gelu_tanh_and_mul)
            or type(mlp) is SparseMoeBlock and type(layer) is LlamaDecoderLayer):
        return False
    attn, norms = layer.self_attn, _norms(layer)
    if any(n is not None and n.eps != norms[0].eps for n in norms):  # the C++ layer takes one eps
        return False
    if attn.q_norm is not None and attn.q_norm.eps != attn.k_norm.eps:
        return False
    return all(_weight_of(m) is not None for m in _linears(layer))


def _weight_of(m):
    """What the C++ layer runs a linear with: its packed dense panels, or a QuantLinear's parts all re-laid out for a
    C++ weight-only GEMM (a part left to the reference, a QuantizedWeight, runs the Python path)."""
    if m.dense is not None:
        return m.dense
    if type(m) is QuantLinear and all(isinstance(w, PackedQuantBase) for _, w in m.parts):
        return QuantPart(list(m.parts), m.bias)
    return None


def _weight(norm: Optional[RMSNorm]) -> Optional[torch.Tensor]:
    """The norm's scale (Gemma's 1 + w made once here, not per call), or None."""
    return None if norm is None else norm.scale()


def _holders(layer) -> tuple:
    """The modules whose tensors a LayerArgs holds that can change while serving: the attention's caches (bound once
    allocated) and each linear's LoRA pools (attached, grown). Either is rebound as a new tensor object, never
    changed in place."""
    return (layer.self_attn.attn, *_linears(layer))


def _key(holders: tuple) -> tuple:
    att, *linears = holders
    return (att.k_cache, att.v_cache, *(t for m in linears for t in (m.lora_a, m.lora_b)))


def _layer_args(layer) -> Optional[LayerArgs]:
    attn, att = layer.self_attn, layer.self_attn.attn
    if att.k_cache is None or att.v_cache is None:
        return None
    linears = [(_weight_of(m), m.lora_a, m.lora_b, m.slice_offsets) for m in _linears(layer)]
    qk = None if attn.q_norm is None else (_weight(attn.q_norm), _weight(attn.k_norm), attn.q_norm.eps)
    n_in, n_attn, n_mlp, n_out = _norms(layer)
    return layer_args(linears, _weight(n_in), _weight(n_mlp), n_in.eps, attn.num_heads, attn.num_kv_heads,
                      attn.head_dim, attn.rotary.cos_sin_cache, att.k_cache, att.v_cache, att.scale,
                      att.sliding_window, att.softcap, qk, attn.rotary.rotary_dim,
                      None if n_attn is None else (_weight(n_attn), _weight(n_out)),
                      getattr(layer.mlp, "act_and_mul", None) is gelu_tanh_and_mul)


def _hidden_rows(t: Optional[torch.Tensor], hidden: int, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.dim() == 2 and t.shape[1] == hidden and t.is_contiguous())


class LayerPass:
    def __init__(self):
        # by id(layer): _holders(layer), None if the pass does not take it (its kind and packing do not change)
        self._holders: dict[int, Optional[tuple]] = {}
        self._layers: dict[int, tuple[tuple, Optional[LayerArgs]]] = {}
        self._ctx = None  # the forward context the step state below was made for
        self._steps: dict[tuple, Optional[StepArgs]] = {}  # by the layer's dims (dense and MoE layers differ)
        self._buffers: tuple = ()
        # grow-only: a prefill chunk's workspace is tens of MB, above what malloc keeps for reuse
        # (engine/worker/cpu.py); allocated every step it would be mapped and zeroed afresh
        self._ws = torch.empty(0)  # float32 elements: as many as the layer's type needs (bfloat16: twice enough)
        self._row_buf = torch.empty(0)  # of the layers' dtype

    def __call__(self, layer, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                 following=None):
        """following: the decoder layer that runs next, if any (its adapter rows are asked for ahead)."""
        args = self._args(layer)
        if args is None or not (_hidden_rows(x, args.hidden, args.dtype) and
                                _hidden_rows(residual, args.hidden, args.dtype)):
            return layer(positions, x, residual)
        step = self._step_for(args, positions, x.shape[0])
        if step is None:
            return layer(positions, x, residual)
        ws, (a, b) = self._buffers
        # never the pair being read (by address: the views are made again when the buffers grow)
        reads_a = x.data_ptr() == a[0].data_ptr() or (residual is not None and residual.data_ptr() == a[1].data_ptr())
        out_x, out_res = b if reads_a else a
        # the next layer's LoomLayer as last made (None until it has run once): its pools may have been replaced since,
        # but the tensors it points to stay alive in self._layers until it is made again, so asking for them is safe
        nxt = None if following is None else self._layers.get(id(following))
        decoder_layer(args, step, x, residual, ws, out_x, out_res, None if nxt is None else nxt[1])
        if args.attn_only:  # a MoE layer: out_x is its block's input
            return layer.mlp(out_x), out_res
        return out_x, out_res

    def _args(self, layer) -> Optional[LayerArgs]:
        holders = self._holders.get(id(layer), False)
        if holders is False:
            holders = self._holders[id(layer)] = _holders(layer) if _eligible(layer) else None
        if holders is None:
            return None
        key = _key(holders)  # the tensors themselves: comparing identities costs ~1/10 of reading addresses
        have = self._layers.get(id(layer))
        if have is None or any(a is not b for a, b in zip(have[0], key)):
            have = (key, _layer_args(layer))
            self._layers[id(layer)] = have
        return have[1]

    def _step_for(self, args: LayerArgs, positions: torch.Tensor, T: int) -> Optional[StepArgs]:
        ctx = get_forward_context()
        if ctx is not self._ctx:
            self._ctx, self._steps = ctx, {}
        dims = (args.hidden, args.q_size, args.inter)
        step = self._steps.get(dims, False)
        if step is False:
            step = self._steps[dims] = self._make_step(args, ctx, positions, T)
        return step

    def _make_step(self, args: LayerArgs, ctx, positions: torch.Tensor, T: int) -> Optional[StepArgs]:
        slots = ctx.slot_mapping
        if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape[0] != T or \
                slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != T:
            return None
        lora = ctx.lora
        # the linears adapters of this step target (each applies them only where it has pools)
        groups = tuple(lora is not None and (lora.module_groups is None or name in lora.module_groups)
                       for name in _GROUPS)
        step = StepArgs(T, positions, slots, ctx.num_decode_seqs, ctx.decode, ctx.prefill, lora, groups,
                        args.hidden, args.q_size, args.inter)
        n, rows = args.workspace_floats(T), T * args.hidden
        if self._ws.numel() < n:
            self._ws = torch.empty(n)
        if self._row_buf.numel() < 4 * rows or self._row_buf.dtype != args.dtype:
            self._row_buf = torch.empty(4 * rows, dtype=args.dtype)
        x0, r0, x1, r1 = (self._row_buf[i * rows:(i + 1) * rows].view(T, args.hidden) for i in range(4))
        self._buffers = (self._ws, ((x0, r0), (x1, r1)))
        return step
