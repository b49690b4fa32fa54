"""Gemma 2 and Gemma 3 (text): the shared attention and MLP (loom.models.llama) in a layer of their own.

What differs from Llama, and where:
- norms: RMSNorm scales by (1 + w) (layers.norm offset=True); the attention output and the MLP output are
  normalised before their residual add (post_attention_layernorm, post_feedforward_layernorm), the MLP input by
  pre_feedforward_layernorm - this layer's forward;
- GELU-tanh MLP, embeddings scaled by sqrt(hidden), attention scale query_pre_attn_scalar^-0.5, sliding windows on
  the layers layer_types marks, Gemma 2's attention and final logit soft-capping, Gemma 3's q/k norms and a
  separate rope base for sliding layers - ModelSpec, applied by the shared code.
"""
from __future__ import annotations

from torch import nn

from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding
from loom.models.llama import Attention, LlamaForCausalLM, make_mlp
from loom.models.spec import ModelSpec


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, tp=None):
        super().__init__()
        self.self_attn = Attention(spec, layer, rotary, tp)
        self.mlp = make_mlp(spec, layer, tp)
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=True)

    def forward(self, positions, x, residual):
        # residual carries the stream; each fused norm adds its input to it first (see layers.norm)
        x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))[0]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.post_feedforward_layernorm(self.mlp(x))[0]
        return x, residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer
