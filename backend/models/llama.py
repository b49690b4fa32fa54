"""The shared decoder: flattened, padding-free, over paged KV. Llama and every family that differs from it only
by configuration (loom.models.spec.ModelSpec):

- Llama 1-3: rope scaling (linear, llama3), attention_bias (q/k/v/o), mlp_bias, tied embeddings.
- Mistral: a sliding window on every layer. Qwen2: q/k/v biases, windows per layer (layer_types).
- Qwen3: RMSNorm over each head of q and k before rope. Phi-3: q|k|v and gate|up fused in the checkpoint (the
  same layout as qkv_proj / gate_up_proj here), partial rotary.
- Mixtral, Qwen3-MoE: a sparse MoE block (loom.layers.moe) in place of the dense MLP, on every layer or on those
  decoder_sparse_step / mlp_only_layers select.
Gemma 2/3 keep this attention and MLP but order their norms differently: loom.models.gemma.
"""
from __future__ import annotations

import torch
from torch import nn

from loom.kernels import gelu_tanh_and_mul, silu_and_mul
from loom.layers.attention import PagedAttention
from loom.layers.moe import ExpertLoRA, SparseMoeBlock
from loom.layers.norm import RMSNorm
from loom.layers.parallel_linear import column_linear, embedding, head_shards, lm_head, row_linear, split
from loom.layers.rotary import RotaryEmbedding
from loom.models.spec import ModelSpec


class Attention(nn.Module):
    """tp (tensor parallelism, loom.distributed.parallel_state.ParallelGroup or None): this rank's query and KV
    heads only (layers.parallel_linear.head_shards); o_proj sums the ranks' outputs."""

    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, tp=None):
        super().__init__()
        q, kv = head_shards(spec.num_heads, spec.num_kv_heads, tp, spec.arch)
        self.num_heads, self.num_kv_heads, self.head_dim = q.size, kv.size, spec.head_dim
        d = self.head_dim
        self.qkv_proj = column_linear(spec.hidden_size, [q.scaled(d), kv.scaled(d), kv.scaled(d)], spec.qkv_bias, tp)
        self.o_proj = row_linear(q.scaled(d), spec.hidden_size, spec.o_bias, tp)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, offset=spec.gemma_norms)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, offset=spec.gemma_norms)
        self.rotary = rotary  # shared by the layers with the same rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, spec.attn_scale,
                                   sliding_window=spec.layer_windows[layer], softcap=spec.attn_softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        t = x.shape[0]
        if self.q_norm is not None:  # per head, before rope; the norms return fresh contiguous tensors
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        # views into qkv (rows strided), never copies: the kernels take them as they are, rope works in place
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = self.attn(positions, q, k, v, self.rotary)
        return self.o_proj(o.view(t, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp=None):
        super().__init__()
        inter = split(spec.intermediate_size, tp, f"intermediate_size of {spec.arch}")
        self.gate_up_proj = column_linear(spec.hidden_size, [inter, inter], spec.mlp_bias, tp)
        self.down_proj = row_linear(inter, spec.hidden_size, spec.mlp_bias, tp)
        self.act_and_mul = gelu_tanh_and_mul if spec.act == "gelu_tanh" else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def make_mlp(spec: ModelSpec, layer: int, tp=None) -> nn.Module:
    if not spec.layer_moe[layer]:
        return MLP(spec, tp)
    m = spec.moe
    inter = split(m.intermediate_size, tp, f"moe intermediate size of {spec.arch}")  # each expert's slice per rank
    return SparseMoeBlock(spec.hidden_size, m.num_experts, m.top_k, inter.size, m.renormalize,
                          round_weights=spec.arch == "Qwen3MoeForCausalLM", tp=tp,
                          shard=(inter.full, inter.start, inter.stop))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, tp=None):
        super().__init__()
        self.self_attn = Attention(spec, layer, rotary, tp)
        self.mlp = make_mlp(spec, layer, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions, x, residual):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, max_position: int, layer_cls, tp=None):
        super().__init__()
        self.embed_tokens = embedding(spec.vocab_size, spec.hidden_size, tp)
        # Gemma scales the embeddings by sqrt(hidden), rounded to the weight dtype as transformers does
        self.embed_scale = spec.hidden_size ** 0.5 if spec.gemma_norms else None
        ropes = {}  # one cos/sin cache per distinct rope, shared by its layers
        for r in set(spec.layer_ropes):
            ropes[r] = RotaryEmbedding(spec.head_dim, r.rotary_dim, max_position, r.theta,
                                       dict(r.scaling) if r.scaling else None)
        self.layers = nn.ModuleList(layer_cls(spec, i, ropes[spec.layer_ropes[i]], tp)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, offset=spec.gemma_norms)
        # on CPU the engine may run the layers through one C++ call each (models/layer_pass.py)
        self.layer_pass = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # sqrt(hidden) rounded to the weight dtype, as transformers; a Python
            # scalar, not a tensor made per step (a host-to-device copy CUDA graph capture refuses)
            x = x * float(torch.tensor(self.embed_scale, dtype=x.dtype))
        residual = None
        run = self.layer_pass
        if run is None:
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        else:
            layers = list(self.layers)
            for layer, following in zip(layers, layers[1:] + [None]):
                x, residual = run(layer, positions, x, residual, following)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg, max_position: int, tp=None):
        """tp: the tensor-parallel rank group (this rank's shard of every layer; logits gathered on rank 0), or
        None."""
        super().__init__()
        spec = ModelSpec.from_hf_config(cfg)
        self.config, self.spec = cfg, spec
        self.model = DecoderModel(spec, max_position, self.layer_cls, tp)
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.lm_head = lm_head(spec.hidden_size, spec.vocab_size, tp)
        self.set_tied(self.tie_word_embeddings)

    def set_tied(self, tied: bool) -> None:
        """Share the input embedding with lm_head, or give lm_head a weight of its own."""
        self.tie_word_embeddings = tied
        emb = self.model.embed_tokens.weight
        if tied:
            self.lm_head.weight = emb
        elif self.lm_head.weight is emb:
            self.lm_head.weight = nn.Parameter(torch.empty_like(emb), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.spec.final_softcap
        if cap is not None:  # Gemma 2: in the model dtype, as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def lora_modules(self) -> dict[tuple[int, str], nn.Module]:
        """(layer index, group name) -> the module that adapters of that group apply to: a fused LoRALinear, or
        the ExpertLoRA holder of a MoE layer's experts. Groups a layer lacks (no dense MLP) are absent."""
        out: dict[tuple[int, str], nn.Module] = {}
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            out.update({(i, "qkv_proj"): attn.qkv_proj, (i, "o_proj"): attn.o_proj})
            if isinstance(mlp, MLP):
                out.update({(i, "gate_up_proj"): mlp.gate_up_proj, (i, "down_proj"): mlp.down_proj})
            else:
                out.update({(i, "experts_gate_up"): mlp.experts.lora_gate_up,
                            (i, "experts_down"): mlp.experts.lora_down})
        return out

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]


__all__ = ["Attention", "DecoderModel", "ExpertLoRA", "LlamaDecoderLayer", "LlamaForCausalLM", "MLP"]
