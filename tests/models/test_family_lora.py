"""PEFT adapters on every family served beside the base model: greedy tokens and logprobs equal to transformers +
PEFT (float32); MoE expert LoRA (PEFT target_parameters) included, and what PEFT would apply differently refused."""
from __future__ import annotations

import json
import os

import pytest

from harness.hf_models import (
    DEFAULT_PEFT_TARGETS,
    FAMILIES,
    PEFT_TARGETS,
    make_peft_adapter,
    peft_model,
    random_prompts,
)
from loom.engine.llm import LLM
from loom.errors import RequestError
from loom.lora.peft_loader import AdapterLoadError, LoraModelSpec, load_peft_adapter
from tests.models.parity import check


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


def _llm(path, root):
    return LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20, adapter_roots=[str(root)], max_lora_rank=16,
               max_num_batched_tokens=24)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_parity_mixed_with_base(tiny_model, adapters, family):
    model, path = tiny_model(family)
    root = adapters / family
    targets = PEFT_TARGETS.get(family, DEFAULT_PEFT_TARGETS)
    ad = make_peft_adapter(path, str(root / "a"), seed=3, r=4, alpha=8, **targets)
    oracles = {None: model, "a": peft_model(path, ad)}
    names = [None, "a", "a", None]
    prompts = random_prompts([5, 30, 3, 18], model.config.vocab_size, seed=21)
    llm = _llm(path, root)
    outs = check(llm, model, prompts, 6, lora_names=names, oracle=lambda i: oracles[names[i]])
    assert outs[1].token_ids != check(llm, model, prompts[1:2], 6)[0].token_ids  # the adapter matters


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_only_adapter(tiny_model, adapters, family):
    """Experts alone (target_modules=[]): the MoE LoRA path changes the tokens and matches PEFT."""
    model, path = tiny_model(family)
    root = adapters / f"{family}-experts"
    ad = make_peft_adapter(path, str(root / "e"), seed=4, r=3, alpha=9, target_modules=[],
                           target_parameters=["experts.down_proj", "mlp.experts.gate_up_proj"],
                           rank_pattern={"gate_up_proj": 2}, alpha_pattern={"down_proj": 5})
    spec = LoraModelSpec.from_model(_llm(path, root).engine.runner.model)
    w = load_peft_adapter(ad, "e", spec, model.dtype, 16)
    assert w.target_modules == ["experts.gate_up_proj", "experts.down_proj"] and w.rank == 3
    assert set(w.a) == {"experts_gate_up", "experts_down"} and w.a["experts_gate_up"][:, :, :, 2:].abs().sum() == 0
    oracle = peft_model(path, ad)
    prompts = random_prompts([26, 4], model.config.vocab_size, seed=22)
    llm = _llm(path, root)
    outs = check(llm, model, prompts, 6, lora_names=["e", "e"], oracle=lambda i: oracle)
    assert outs[0].token_ids != check(llm, model, prompts[:1], 6)[0].token_ids


def _raw_adapter(src: str, dst: str, **config) -> str:
    """A copy of a saved adapter with config changes (what PEFT would save for such a config)."""
    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        raw = json.load(f)
    raw.update(config)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(raw, f)
    with open(os.path.join(src, "adapter_model.safetensors"), "rb") as f, \
            open(os.path.join(dst, "adapter_model.safetensors"), "wb") as g:
        g.write(f.read())
    return dst


@pytest.mark.parametrize("config,fragment", [
    ({"target_parameters": ["mlp.gate.weight"]}, "router"),
    ({"target_modules": ["q_proj", "w1", "w3"]}, "transformers 4"),
    ({"target_modules": "all-linear"}, "router or experts"),
    ({"target_modules": r".*\.experts\.w2"}, "router or experts"),
    ({"target_parameters": ["self_attn.q_proj.weight"]}, "not an expert weight"),
])
def test_moe_targets_peft_would_apply_otherwise_are_refused(tiny_model, tmp_path, config, fragment):
    _, path = tiny_model("mixtral")
    src = make_peft_adapter(path, str(tmp_path / "src"), seed=5, r=2, alpha=4, **PEFT_TARGETS["mixtral"])
    bad = _raw_adapter(src, str(tmp_path / "root" / "bad"), **config)
    llm = _llm(path, tmp_path / "root")
    with pytest.raises(AdapterLoadError, match=fragment):
        load_peft_adapter(bad, "bad", LoraModelSpec.from_model(llm.engine.runner.model), llm.engine.runner.dtype, 16)
    with pytest.raises(RequestError):
        llm.engine.adapters.load("bad")


def test_router_lora_saved_by_peft_is_refused(tiny_model, tmp_path):
    _, path = tiny_model("mixtral")
    ad = make_peft_adapter(path, str(tmp_path / "r"), seed=6, r=2, alpha=4, target_modules=["q_proj"],
                           target_parameters=["mlp.gate.weight"])
    spec = LoraModelSpec.from_model(_llm(path, tmp_path).engine.runner.model)
    with pytest.raises(AdapterLoadError, match="router"):
        load_peft_adapter(ad, "r", spec, model_dtype(), 16)


def test_dense_names_on_phi3_are_refused(tiny_model, tmp_path):
    """Phi-3's modules are qkv_proj / gate_up_proj: an adapter naming q_proj matches nothing there (PEFT fails too)."""
    _, path = tiny_model("phi3")
    src = make_peft_adapter(path, str(tmp_path / "src"), seed=7, r=2, alpha=4, target_modules=["qkv_proj"])
    bad = _raw_adapter(src, str(tmp_path / "bad"), target_modules=["q_proj"])
    spec = LoraModelSpec.from_model(_llm(path, tmp_path).engine.runner.model)
    with pytest.raises(AdapterLoadError, match="'q_proj' is not a module of this Phi3ForCausalLM"):
        load_peft_adapter(bad, "bad", spec, model_dtype(), 16)


def model_dtype():
    import torch

    return torch.float32


def test_qwen3_moe_with_dense_and_sparse_layers(tmp_path):
    """mlp_only_layers=[0]: a dense MLP in layer 0, experts in layer 1 (the LoRA groups exist per layer)."""
    from harness.hf_models import make_hf_model

    model, path = make_hf_model("qwen3_moe", tmp_path, mlp_only_layers=[0])
    ad = make_peft_adapter(path, str(tmp_path / "root" / "m"), seed=9, r=2, alpha=4, target_modules=["o_proj"],
                           target_parameters=["mlp.experts.down_proj"])
    llm = _llm(path, tmp_path / "root")
    spec = LoraModelSpec.from_model(llm.engine.runner.model)
    assert {g.name: g.layers for g in spec.groups} == {"qkv_proj": (), "o_proj": (), "gate_up_proj": (0,),
                                                        "down_proj": (0,), "experts_gate_up": (1,),
                                                        "experts_down": (1,)}
    oracle = peft_model(path, ad)
    names = [None, "m"]
    prompts = random_prompts([17, 9], model.config.vocab_size, seed=23)
    check(llm, model, prompts, 5, lora_names=names, oracle=lambda i: model if names[i] is None else oracle)
