"""Quantized MoE checkpoints (Mixtral, Qwen3-MoE): every projection quantized, the experts too (one checkpoint linear
per expert and projection, as the hub's checkpoints store them), loaded as saved and kept quantized - the experts a
QuantExperts over the C++ weight-only GEMM, one per expert - give transformers' greedy tokens on the dequantised
float32 weights (transformers' own from_pretrained of them, which stacks the experts its way). The memory plan
counts the same bytes."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from harness.hf_models import random_prompts
from harness.quant_checkpoints import make_ct_moe_checkpoint, make_packed_checkpoint
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.worker.memory_plan import plan
from loom.kernels.cpu_quant import PackedQuantWeight
from loom.layers.quant_experts import QuantExperts
from loom.layers.quant_linear import QuantLinear
from tests.models.parity import check
from tests.models.test_quantized import dequantized_state

pytest.importorskip("compressed_tensors")

# sizes that hold 128-column groups in every projection (the experts' down included)
MOE = {"mixtral": dict(intermediate_size=128), "qwen3_moe": dict(moe_intermediate_size=128, head_dim=32)}
CASES = [
    ("ct-w4a16-g128", "mixtral", ("ct", "W4A16", None)),
    ("ct-w4a16-asym-g128", "qwen3_moe", ("ct", "W4A16_ASYM", None)),
    ("ct-w8a16-channel", "qwen3_moe", ("ct", "W8A16", None)),
    ("ct-fp8-channel-dynamic", "mixtral", ("ct", "FP8_DYNAMIC", None)),
    ("gptq-desc-act-g64", "mixtral", ("gptq", dict(desc_act=True, group_size=64))),
    ("awq-g128", "qwen3_moe", ("awq", {})),
    ("fp8-block128", "mixtral", ("fp8", {})),
]
KV = 4 << 20


def _make(root, case_id, family, how):
    name = f"{case_id}-{family}"
    if how[0] == "ct":
        return make_ct_moe_checkpoint(family, root, how[1], name, fmt=how[2], **MOE[family])
    return make_packed_checkpoint(family, root, how[0], name, how[1], **MOE[family])


def oracle(float_model, path: str, root) -> torch.nn.Module:
    """transformers in float32 loading the checkpoint's dequantised weights, under the original (float) config."""
    from transformers import AutoModelForCausalLM

    folder = os.path.join(str(root), os.path.basename(path) + "-dequantised")
    float_model.save_pretrained(folder, safe_serialization=True)
    save_file({k: v.contiguous() for k, v in dequantized_state(path).items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("case_id,family,how", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_quantized_experts_give_transformers_tokens(tmp_path, case_id, family, how):
    float_model, path = _make(tmp_path, case_id, family, how)
    hf = oracle(float_model, path, tmp_path)
    theirs = hf.model.layers[0].mlp.experts
    assert not torch.equal(theirs.down_proj, float_model.model.layers[0].mlp.experts.down_proj)  # quantized
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=KV, max_num_batched_tokens=32, cpu_threads=1)
    model = llm.engine.runner.model
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantExperts), f"layer {i}: experts dequantised at load"
        assert all(isinstance(w, PackedQuantWeight) for w in experts.down)
        w13, w2 = experts.dequantized()
        ref = hf.model.layers[i].mlp.experts
        assert torch.equal(w13, ref.gate_up_proj) and torch.equal(w2, ref.down_proj), i
        assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    check(llm, hf, random_prompts([3, 21, 40], hf.config.vocab_size, seed=5), 8)
    # the plan from config.json counts what was loaded
    p = plan(path, EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=KV))
    assert p.weight_bytes == llm.engine.runner.weight_bytes
    llm.close()



def test_float_weights_of_kept_layers_are_never_allocated(tmp_path, monkeypatch):
    """The load's peak is the quantized model: the float weights of the layers and experts kept quantized stay on
    the meta device until their module is replaced (Mixtral-8x7B FP8 on one 80 GB GPU could not load otherwise)."""
    import loom.models.loader as loader
    import loom.models.quant_layers as quant_layers

    _, path = _make(tmp_path, "ct-w4a16-g128", "mixtral", ("ct", "W4A16", None))
    seen = []

    def experts(base, gate_up, down):
        seen.append(base.gate_up_proj.is_meta and base.down_proj.is_meta)
        return QuantExperts(base, gate_up, down)

    def linear(base, parts):
        seen.append(base.weight.is_meta)
        return QuantLinear(base, parts)

    monkeypatch.setattr(quant_layers, "QuantExperts", experts)
    monkeypatch.setattr(quant_layers, "QuantLinear", linear)
    loader.load_model(path, torch.float32, torch.device("cpu"), 64)
    assert len(seen) == 2 * 3 and all(seen)  # per layer: q|k|v, o_proj, the experts (the router stays float)


def test_expert_lora_on_quantized_experts(tmp_path):
    """A PEFT adapter on the experts and attention, trained on the dequantised base (QLoRA's way), served on the
    quantized one: PEFT's tokens on the dequantised base."""
    from harness.hf_models import make_peft_adapter, peft_model

    float_model, path = _make(tmp_path, "ct-w8a16-channel", "qwen3_moe", ("ct", "W8A16", None))
    base = oracle(float_model, path, tmp_path)
    base_dir = os.path.join(str(tmp_path), os.path.basename(path) + "-dequantised")
    root = tmp_path / "adapters"
    ad = make_peft_adapter(base_dir, str(root / "a"), seed=4, r=3, alpha=6, target_modules=["q_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=KV, adapter_roots=[str(root)], max_lora_rank=8,
              lora_expert_memory_bytes=16 << 20, cpu_threads=1)
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.experts, QuantExperts)
    names = ["a", None]
    oracles = {None: base, "a": peft_model(base_dir, ad)}
    prompts = random_prompts([9, 4], base.config.vocab_size, seed=23)
    outs = check(llm, base, prompts, 5, lora_names=names, oracle=lambda i: oracles[names[i]])
    assert outs[0].token_ids != check(llm, base, prompts[:1], 5)[0].token_ids  # the adapter matters
    llm.close()


def test_tensor_parallel_keeps_each_ranks_shard_quantized_and_the_plan_counts_it(tmp_path):
    """Under tensor parallelism each rank keeps its shard quantized (its experts' intermediate slice, its attention
    rows and columns; groups of 64 so that each rank's 64 intermediate columns are whole groups), which the plan
    counts per rank. tests/distributed/test_tp_quantized.py checks the shards' values and the tokens."""
    from loom.engine.worker.memory_plan import RankShape, model_bytes
    from loom.models.loader import load_model

    w4_g64 = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}}
    _, path = _make(tmp_path, "ct-w4a16-g64", "mixtral", ("ct", w4_g64, None))
    p = plan(path, EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=64, tensor_parallel_size=2))
    assert "kept quantized" in p.quantization
    sizes = []
    for rank in range(2):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), 64, tp=RankShape(rank, 2))
        assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)
        sizes.append(model_bytes(model))
    assert p.weight_bytes == max(sizes)
