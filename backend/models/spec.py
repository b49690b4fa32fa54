"""What a model family changes in the shared decoder, read once from the HF config, with every refusal.

`ModelSpec.from_hf_config(cfg)` is the one place that interprets config.json. Each field is either
implemented by loom.models exactly as transformers computes it, or the load is refused with a ConfigError
naming the field: an unknown rope type, attention variant, activation or quantization format is never
approximated (loom.models.quant reads the quantization formats loom loads).
"""
from __future__ import annotations

from dataclasses import dataclass

from loom.errors import ConfigError
from loom.models.quant import QuantMethod, parse_quant_config

# rope types loom computes, with the keys each may carry (anything else in rope_parameters is refused)
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "linear": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: tuple | None  # None, or the linear / llama3 scaling parameters as sorted (key, value) pairs
    rotary_dim: int  # dims of each head that rotate (partial rotary: Phi-3 partial_rotary_factor)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (0 if no layer has one)
    rms_norm_eps: float
    act: str  # "silu" | "gelu_tanh"
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    gemma_norms: bool  # (1 + w) norms, post-attention and pre/post-feedforward norms, scaled embeddings (Gemma)
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]  # sliding window of each layer, None = global attention
    layer_ropes: tuple[Rope, ...]
    layer_moe: tuple[bool, ...]  # layer i has a sparse MoE block instead of the dense MLP
    moe: MoeSpec | None
    quant: QuantMethod | None = None  # the checkpoint's quantization format (weights dequantised at load)

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelSpec":
        return _read(cfg)


def _fail(field_name: str, msg: str) -> ConfigError:
    return ConfigError(f"config.json {field_name}", msg)


def _get(cfg, name, default=None):
    v = getattr(cfg, name, default)
    return default if v is None else v


def _refuse_common(cfg) -> None:
    if _get(cfg, "pretraining_tp", 1) != 1:
        raise _fail("pretraining_tp", f"{cfg.pretraining_tp} is not supported (only 1)")
    if getattr(cfg, "use_bidirectional_attention", None):
        raise _fail("use_bidirectional_attention", "bidirectional attention is not supported (causal LMs only)")


def _activation(cfg) -> str:
    field_name = "hidden_activation" if getattr(cfg, "hidden_activation", None) else "hidden_act"
    act = getattr(cfg, field_name, None) or "silu"
    if act not in _ACTIVATIONS:
        raise _fail(field_name, f"{act!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[act]


def _rope(params: dict | None, field_name: str, head_dim: int, default_theta: float) -> Rope:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise _fail(f"{field_name}.rope_type", f"{kind!r} is not supported (supported: {', '.join(_ROPE_KEYS)})")
    extra = sorted(set(params) - _ROPE_KEYS[kind])
    if extra:
        raise _fail(f"{field_name}.{extra[0]}", f"is not supported for rope_type {kind!r} (loom computes only "
                    f"{', '.join(sorted(_ROPE_KEYS[kind] - {'type', 'rope_type'}))})")
    factor = float(params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise _fail(f"{field_name}.partial_rotary_factor", f"{factor} gives {rotary_dim} rotary dims of {head_dim}")
    theta = float(params.get("rope_theta") or default_theta)
    scaling = None if kind == "default" else tuple(sorted((k, v) for k, v in params.items() if not isinstance(v, list)))
    return Rope(theta, scaling, rotary_dim)


def _rope_params(cfg) -> dict:
    """transformers 5 keeps rope settings in rope_parameters; older configs in rope_theta / rope_scaling."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(cfg, "rope_scaling", None) or {})
    if getattr(cfg, "rope_theta", None):
        params.setdefault("rope_theta", cfg.rope_theta)
    return params


def _layer_types(cfg, n: int) -> list[str] | None:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return None
    types = list(types)
    if len(types) < n:
        raise _fail("layer_types", f"has {len(types)} entries for {n} layers")
    for t in types[:n]:
        if t not in LAYER_TYPES:
            raise _fail("layer_types", f"attention type {t!r} is not supported (supported: {', '.join(LAYER_TYPES)})")
    return types[:n]


def _read(cfg) -> ModelSpec:
    arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
    _refuse_common(cfg)
    n = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    head_dim = int(_get(cfg, "head_dim", cfg.hidden_size // heads))
    gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise _fail("sliding_window", f"must be a positive integer or null, got {window!r}")
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None  # Qwen2/Qwen3 configs keep a sliding_window value they do not use

    types = _layer_types(cfg, n)
    if types is None:  # Mistral, Mixtral, Phi-3, Qwen3-MoE: one window (or none) for every layer
        windows = (window,) * n
    else:  # Qwen2, Qwen3, Gemma 2/3: per layer
        if "sliding_attention" in types and window is None:
            raise _fail("sliding_window", "layer_types has sliding_attention layers but sliding_window is null")
        windows = tuple(window if t == "sliding_attention" else None for t in types)

    params = _rope_params(cfg)
    if arch == "Gemma3ForCausalLM":  # one rope per layer type (local base frequency on sliding layers)
        by_type = {t: _rope(params.get(t), f"rope_parameters.{t}", head_dim, 10000.0) for t in LAYER_TYPES}
        ropes = tuple(by_type[t] for t in (types or ["full_attention"] * n))
    else:
        if arch == "Phi3ForCausalLM" and params.get("rope_type", params.get("type")) in ("longrope", "su", "yarn"):
            raise _fail("rope_parameters.rope_type", "Phi-3 longrope (128k-context variants) is not supported")
        ropes = (_rope(params, "rope_parameters", head_dim, 10000.0),) * n

    attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
    if arch == "Gemma3ForCausalLM" and attn_softcap is not None:
        raise _fail("attn_logit_softcapping", "is set, but transformers' Gemma 3 does not apply it; refused rather "
                    "than guessed")
    scale = head_dim ** -0.5
    if gemma:
        scale = float(cfg.query_pre_attn_scalar) ** -0.5

    moe, layer_moe = _moe(cfg, arch, n)
    dense = [i for i in range(n) if not layer_moe[i]]
    attn_bias = bool(getattr(cfg, "attention_bias", False))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM") and attn_bias:
        raise _fail("attention_bias", f"is true, but transformers' {arch} has no attention biases")
    return ModelSpec(
        arch=arch, vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size), num_layers=n,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(cfg.intermediate_size) if dense else 0,
        rms_norm_eps=float(cfg.rms_norm_eps), act=_activation(cfg),
        qkv_bias=arch == "Qwen2ForCausalLM" or attn_bias,
        o_bias=attn_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        gemma_norms=gemma, attn_scale=scale,
        attn_softcap=None if attn_softcap is None else float(attn_softcap),
        final_softcap=None if getattr(cfg, "final_logit_softcapping", None) is None
        else float(cfg.final_logit_softcapping),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        layer_windows=windows, layer_ropes=ropes, layer_moe=layer_moe, moe=moe,
        quant=parse_quant_config(getattr(cfg, "quantization_config", None)),
    )


def _moe(cfg, arch: str, n: int) -> tuple[MoeSpec | None, tuple[bool, ...]]:
    if arch == "MixtralForCausalLM":
        spec = MoeSpec(int(cfg.num_local_experts), int(cfg.num_experts_per_tok), int(cfg.intermediate_size), True)
        return _check_moe(spec), (True,) * n
    if arch == "Qwen3MoeForCausalLM":
        spec = MoeSpec(int(cfg.num_experts), int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size),
                       bool(cfg.norm_topk_prob))
        step = int(_get(cfg, "decoder_sparse_step", 1))
        dense_only = set(_get(cfg, "mlp_only_layers", []))
        if step < 1:
            raise _fail("decoder_sparse_step", f"must be >= 1, got {step}")
        layers = tuple(i not in dense_only and spec.num_experts > 0 and (i + 1) % step == 0 for i in range(n))
        return (_check_moe(spec) if any(layers) else None), layers
    return None, (False,) * n


def _check_moe(spec: MoeSpec) -> MoeSpec:
    if not 1 <= spec.top_k <= spec.num_experts:
        raise _fail("num_experts_per_tok", f"{spec.top_k} must be in [1, {spec.num_experts}]")
    if spec.intermediate_size < 1:
        raise _fail("intermediate_size", f"must be positive, got {spec.intermediate_size}")
    return spec
