"""Small random-weight HF models of each family and the transformers oracles, for tests and the GPU check."""
from __future__ import annotations

import torch


def make_hf_model(arch: str, tmp_path, tie: bool = False, bias_std: float = 0.0, **overrides):
    """A small random-weight model saved as safetensors; GQA group 3 by default (like SmolLM2).
    bias_std > 0 draws the biases (Qwen2's q/k/v) from N(0, bias_std): at init they are zero and prove nothing."""
    import transformers

    torch.manual_seed(1234)
    common = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                       rope_theta=500000.0, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; sharpen them so greedy decoding is well separated.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(3.0) if p.dim() == 2 else None
            if bias_std and name.endswith(".bias"):
                p.normal_(0.0, bias_std)
    model.eval()
    path = tmp_path / arch
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        dev = model.device
        out = model.generate(torch.tensor([prompt_ids], device=dev),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=dev),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_no_leak(engine) -> None:
    bm = engine.block_manager
    assert not engine.requests, "requests still tracked"
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
