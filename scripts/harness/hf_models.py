"""Small random-weight HF models of each family and the transformers oracles, for tests, benchmarks and the GPU check.

Every family's tiny config exercises what makes it differ from Llama (windows shorter than the test prompts,
soft-capping that bites, partial rotary, several experts). Norm weights and biases are random, so a missing, swapped
or mis-offset tensor changes the tokens.

    python scripts/harness/hf_models.py OUT_DIR [family ...]   # save tiny models (with the default tokenizer)
"""
from __future__ import annotations

import os
import sys

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")


def hf_config(arch: str, tie: bool = False, **overrides):
    """The transformers config of a tiny model of one family; GQA group 3 by default (like SmolLM2)."""
    import transformers

    common = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    window = overrides.pop("sliding_window", 24)
    if arch == "llama":
        common.update(overrides)
        return transformers.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                        rope_theta=500000.0, **common)
    if arch == "mistral":
        common.update(overrides)
        return transformers.MistralConfig(sliding_window=window, **common)
    if arch == "qwen2":  # layer 1 windowed (max_window_layers=1), layer 0 global
        common.update(dict(use_sliding_window=window is not None, sliding_window=window, max_window_layers=1))
        common.update(overrides)
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":  # head_dim 32 != hidden / heads, like the real ones
        common.update(dict(head_dim=32, attention_bias=True))
        common.update(overrides)
        return transformers.Qwen3Config(**common)
    if arch == "phi3":  # partial rotary, window on every layer
        common.update(dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=window,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5}))
        common.update(overrides)
        return transformers.Phi3Config(**common)
    if arch in ("gemma2", "gemma3"):
        common.update(dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=window, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, layer_types=["sliding_attention", "full_attention"]))
        if arch == "gemma2":
            common.update(dict(attn_logit_softcapping=5.0, final_logit_softcapping=8.0))
            common.update(overrides)
            return transformers.Gemma2Config(**common)
        common.update(dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0}}))
        common.update(overrides)
        return transformers.Gemma3TextConfig(**common)
    if arch == "mixtral":
        common.update(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64))
        common.update(overrides)
        return transformers.MixtralConfig(**common)
    if arch == "qwen3_moe":  # head_dim != hidden / heads, top-3 of 8 without renormalisation
        common.update(dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, head_dim=24,
                           norm_topk_prob=False))
        common.update(overrides)
        return transformers.Qwen3MoeConfig(**common)
    raise ValueError(arch)


def build_hf_model(cfg, seed: int = 1234, bias_std: float = 0.0):
    """bias_std > 0: biases drawn from N(0, bias_std) (larger than the default jitter, e.g. Qwen2's q/k/v)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # Random init gives near-uniform logits; sharpen them so greedy decoding is well separated. Norm weights and
    # biases start at 1 or 0: make them random.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
            elif bias_std and name.endswith(".bias"):
                p.normal_(0.0, bias_std)
            else:
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def make_hf_model(arch: str, tmp_path, tie: bool = False, bias_std: float = 0.0, **overrides):
    """A small random-weight model saved as safetensors under tmp_path/arch -> (model, path)."""
    model = build_hf_model(hf_config(arch, tie=tie, **overrides), bias_std=bias_std)
    path = os.path.join(str(tmp_path), arch)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def tiny_llama_config(vocab=256, layers=2, hidden=64, inter=128, heads=4, kv_heads=2, **overrides):
    """The config of the tiny Llama of the LoRA tests, the reliability tests' tiny engine and the host-overhead
    benchmark: weights N(0, 0.2) (initializer_range), untied embeddings; `overrides` are further LlamaConfig fields
    (vocab_size, max_position_embeddings, tie_word_embeddings, ...)."""
    from transformers import LlamaConfig

    fields = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=256, initializer_range=0.2,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaConfig(**(fields | overrides))


def make_tiny_llama(path: str, seed: int = 0, **kw) -> str:
    """tiny_llama_config(**kw) with the weights transformers draws after torch.manual_seed(seed), saved as
    safetensors under `path` (no tokenizer) -> path."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        dev = model.device
        out = model.generate(torch.tensor([prompt_ids], device=dev), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=dev),
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.no_grad()
def hf_greedy_logprobs(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the log-probability of each, by full recompute (no KV cache): the plainest oracle."""
    ids = torch.tensor([prompt_ids])
    toks, lps = [], []
    for _ in range(max_new_tokens):
        lsm = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
        t = int(lsm.argmax())
        toks.append(t)
        lps.append(float(lsm[t]))
        ids = torch.cat([ids, torch.tensor([[t]])], 1)
    return toks, lps


# LoRA targets per family for the PEFT parity tests: every projection kind the family has
PEFT_TARGETS = {
    "phi3": dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "mixtral": dict(target_modules=["q_proj", "v_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "qwen3_moe": dict(target_modules=["k_proj", "o_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
}
DEFAULT_PEFT_TARGETS = dict(target_modules="all-linear")


def make_peft_adapter(model_dir: str, out_dir: str, seed: int, r: int = 4, alpha: float = 8, scale: float = 2.0,
                      **lora_kw) -> str:
    """Save a PEFT adapter of any family with random, non-zero A and B (PEFT initialises B to zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    if isinstance(lora_kw.get("target_modules"), tuple):
        lora_kw["target_modules"] = list(lora_kw["target_modules"])
    pm = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False, **lora_kw))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * scale / max(p.shape[-1], 1) ** 0.5)
    pm.save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: str, adapter_dir: str | None):
    """The oracle: transformers (+ the PEFT adapter), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).eval()


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_no_leak(engine) -> None:
    bm = engine.block_manager
    assert not engine.requests, "requests still tracked"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks leaked"
    assert bm.num_used_blocks == 0


def save_tiny_models(out_dir: str, families=FAMILIES, tokenizer_dir: str | None = None) -> dict[str, str]:
    """Tiny models with a real tokenizer (vocab sized to it), for the benchmark scripts: family -> path."""
    from transformers import AutoTokenizer

    if tokenizer_dir is None:
        from loom.engine.default_model import resolve_default_model

        tokenizer_dir = resolve_default_model()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    paths = {}
    for fam in families:
        over = dict(vocab_size=len(tok), max_position_embeddings=2048)
        if fam in ("phi3", "gemma2", "gemma3"):
            over.update(pad_token_id=tok.pad_token_id or 0, bos_token_id=tok.bos_token_id or 1,
                        eos_token_id=tok.eos_token_id or 2)
        _, path = make_hf_model(fam, out_dir, **over)
        tok.save_pretrained(path)
        paths[fam] = path
    return paths


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for fam, p in save_tiny_models(sys.argv[1], sys.argv[2:] or FAMILIES).items():
        print(fam, p)
