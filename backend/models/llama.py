"""The Llama family (Llama 1-3, Mistral, Qwen2): flattened, padding-free decoder over paged KV.

Differences inside the family are config flags: qkv bias (Qwen2), rope scaling (Llama 3),
tied embeddings, head_dim and GQA group size.
"""
from __future__ import annotations

import torch
from torch import nn

from loom.kernels import silu_and_mul
from loom.layers.attention import PagedAttention
from loom.layers.linear import LoRALinear
from loom.layers.norm import RMSNorm
from loom.layers.rotary import RotaryEmbedding, rope_parameters


class LlamaAttention(nn.Module):
    def __init__(self, cfg, max_position: int, qkv_bias: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = LoRALinear(cfg.hidden_size, [q, kv, kv], bias=qkv_bias)
        self.o_proj = LoRALinear(q, [cfg.hidden_size], bias=False)
        theta, scaling = rope_parameters(cfg)
        self.rotary = RotaryEmbedding(self.head_dim, max_position, theta, scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        t = x.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        # split() gives views into qkv; rotary works in place on contiguous copies
        q, k = q.contiguous(), k.contiguous()
        self.rotary(positions, q, k)
        o = self.attn(q, k, v.contiguous())
        return self.o_proj(o.reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = LoRALinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = LoRALinear(cfg.intermediate_size, [cfg.hidden_size], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, max_position: int, qkv_bias: bool):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, max_position, qkv_bias)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_position: int, qkv_bias: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, max_position, qkv_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names of projections that are merged here: name -> (merged module, slice index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, max_position: int):
        super().__init__()
        arch = (cfg.architectures or ["LlamaForCausalLM"])[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        self.config = cfg
        self.model = LlamaModel(cfg, max_position, qkv_bias)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
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
        return self.lm_head(hidden).float()

    def lora_modules(self) -> dict[tuple[int, str], LoRALinear]:
        """(layer index, group name) -> the fused linear that adapters of that group apply to."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            out.update({(i, "qkv_proj"): attn.qkv_proj, (i, "o_proj"): attn.o_proj,
                        (i, "gate_up_proj"): mlp.gate_up_proj, (i, "down_proj"): mlp.down_proj})
        return out

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
