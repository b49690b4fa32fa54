"""PEFT adapters on every family served beside the base model: greedy tokens and logprobs equal to transformers +
PEFT (float32); MoE expert LoRA (PEFT target_parameters) included, and what PEFT would apply differently refused."""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from harness.hf_models import (
    DEFAULT_PEFT_TARGETS,
    FAMILIES,
    PEFT_TARGETS,
    make_peft_adapter,
    peft_model,
    random_prompts,
)
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError
from loom.kernels.cpu_lora import pool_row
from loom.lora import AdapterRegistry, LoraPool
from loom.lora.peft_loader import AdapterLoadError, LoraModelSpec, load_peft_adapter
from tests.models.parity import check


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


def _llm(path, root, **kw):
    kw = {"lora_expert_memory_bytes": 16 << 20, **kw}  # 0 by default: expert LoRA off
    return LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20, adapter_roots=[str(root)], max_lora_rank=16,
               max_num_batched_tokens=24, **kw)


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


def test_dense_rows_on_mixtral_cost_what_they_cost_on_a_dense_model(tiny_model, adapters):
    """The dense pools of a MoE model hold attention LoRA only: a row costs the attention groups' bytes, whatever the
    experts; a dense-only adapter takes no expert row."""
    model, path = tiny_model("mixtral")
    cfg = model.config
    root = adapters / "mixtral-rows"
    make_peft_adapter(path, str(root / "d"), seed=10, r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    H, L, E, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    p = functools.partial(pool_row, dtype=torch.float32)  # a CPU pool's row of n floats
    dense_row = L * (3 * p(H) + p(q + 2 * kv) + p(q) + p(H)) * 4  # qkv_proj (A per slice, B) and o_proj, float32
    llama = LoraModelSpec.from_hf_config(cfg)  # a dense model of the same shapes: its attention groups
    attention = LoraModelSpec(llama.num_layers, tuple(g for g in llama.groups if g.name in ("qkv_proj", "o_proj")))
    assert LoraPool.row_bytes_for(attention, torch.float32, "cpu") == dense_row
    expert_row = L * E * (2 * p(H) + p(2 * inter) + p(inter) + p(H)) * 4
    for expert_bytes in (0, 3 * expert_row + 7):
        llm = _llm(path, root, lora_memory_bytes=10 * dense_row + 5, lora_expert_memory_bytes=expert_bytes)
        reg = llm.engine.adapters
        info = reg.info()
        assert (info["row_bytes"], info["capacity_rows"]) == (dense_row, 10)
        assert (info["expert_row_bytes"], info["expert_capacity_rows"]) == (expert_row, expert_bytes // expert_row)
        assert info["expert_pool_bytes"] == info["expert_capacity_rows"] * expert_row
        reg.load("d")
        ref = reg.acquire("d")
        assert reg.activate(ref) and reg.list()[0]["rows"] == {"dense": 4, "expert": 0}
        info = reg.info()
        assert (info["free_rows"], info["expert_free_rows"]) == (6, info["expert_capacity_rows"])
        reg.release(ref)


def test_mixed_step_expert_dense_and_no_adapter(tiny_model, adapters):
    """One step with an experts+attention adapter, an experts-only adapter, an attention-only adapter and no
    adapter: each sequence matches PEFT with its own adapter (or the base model)."""
    model, path = tiny_model("mixtral")
    root = adapters / "mixtral-mixed"
    ads = {"ex": make_peft_adapter(path, str(root / "ex"), seed=11, r=3, alpha=6, target_modules=["q_proj", "o_proj"],
                                   target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
           "eo": make_peft_adapter(path, str(root / "eo"), seed=12, r=2, alpha=4, target_modules=[],
                                   target_parameters=["mlp.experts.down_proj"]),
           "de": make_peft_adapter(path, str(root / "de"), seed=13, r=4, alpha=8, target_modules=["v_proj", "o_proj"])}
    oracles = {None: model, **{n: peft_model(path, d) for n, d in ads.items()}}
    names = ["ex", None, "de", "eo", "de", None]
    prompts = random_prompts([5, 3, 4, 4, 2, 3], model.config.vocab_size, seed=24)  # 21 tokens: one prefill step
    llm = _llm(path, root)
    reg = llm.engine.adapters
    for name in ads:  # resident before the first step: a background load would leave a step without its rows
        reg.load(name)
    groups, build = [], reg.build_lora_meta
    reg.build_lora_meta = lambda refs, nt: (lambda m: (groups.append(
        (m.num_groups, m.experts.num_groups if m.experts else 0) if m else None), m)[1])(build(refs, nt))
    check(llm, model, prompts, 5, lora_names=names, oracle=lambda i: oracles[names[i]])
    assert groups and set(groups) == {(2, 2)}  # every step: dense rows of ex and de, expert rows of ex and eo
    assert {d["name"]: d["rows"] for d in reg.list()} == {
        "ex": {"dense": 3, "expert": 3}, "eo": {"dense": 0, "expert": 2}, "de": {"dense": 4, "expert": 0}}


def test_bfloat16_pools_on_mixtral_match_peft(tiny_model, adapters):
    """lora_dtype=bfloat16 under the float32 model: an adapter saved in bfloat16 on attention and experts (dense and
    expert pools both 16-bit, widened where read) gives PEFT's tokens and logprobs with that adapter."""
    from safetensors.torch import load_file, save_file

    model, path = tiny_model("mixtral")
    root = adapters / "mixtral-bf16"
    src = make_peft_adapter(path, str(root / "f32"), seed=14, r=3, alpha=6, target_modules=["q_proj", "o_proj"],
                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    dst = root / "h"
    dst.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(src, "adapter_model.safetensors")).items()},
              str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text((root / "f32" / "adapter_config.json").read_text())
    oracle = peft_model(path, str(dst))
    names = ["h", None, "h"]
    prompts = random_prompts([5, 3, 9], model.config.vocab_size, seed=25)
    llm = _llm(path, root, lora_dtype="bfloat16")
    pools = llm.engine.adapters.pools
    assert {t.dtype for pool in pools for t in (*pool.a.values(), *pool.b.values())} == {torch.bfloat16}
    outs = check(llm, model, prompts, 5, lora_names=names, oracle=lambda i: oracle if names[i] else model)
    assert outs[0].token_ids != check(llm, model, prompts[:1], 5)[0].token_ids  # the adapter matters


def test_expert_adapters_refused_without_expert_memory(tiny_model, adapters):
    """lora_expert_memory_bytes=0 (the default): an adapter targeting experts is refused naming the field and the
    bytes it needs; too little memory is refused the same way; attention adapters are served as usual."""
    model, path = tiny_model("mixtral")
    root = adapters / "mixtral-refused"
    make_peft_adapter(path, str(root / "ex"), seed=14, r=3, alpha=6, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.down_proj"])
    de = make_peft_adapter(path, str(root / "de"), seed=15, r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    llm = _llm(path, root, lora_expert_memory_bytes=0)
    reg = llm.engine.adapters
    assert reg.expert_pool.a == {} and llm.engine.runner.model.model.layers[0].mlp.experts.lora_down.lora_a is None
    row = reg.info()["expert_row_bytes"]
    with pytest.raises(RequestError, match=f"lora_expert_memory_bytes=0 holds no rank row .*at least {3 * row} ") \
            as ei:
        reg.load("ex")
    assert ei.value.field == "lora_path" and "MoE expert LoRA" in str(ei.value)
    with pytest.raises(RequestError, match="lora_expert_memory_bytes") as ei:
        llm.engine.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="ex")
    assert ei.value.field == "lora_name" and reg.list() == []
    small = AdapterRegistry(EngineConfig(adapter_roots=[str(root)], lora_expert_memory_bytes=2 * row), None, "cpu",
                            torch.float32, spec=reg.spec)
    with pytest.raises(RequestError, match=f"rank 3 does not fit .* lora_expert_memory_bytes to at least {3 * row}"):
        small.acquire("ex")
    small.close()
    prompts = random_prompts([6, 4], model.config.vocab_size, seed=25)
    oracle = peft_model(path, de)
    check(llm, model, prompts, 4, lora_names=["de", None], oracle=lambda i: oracle if i == 0 else model)


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
    # each group's rows cover only its layers: the dense MLP of layer 0, the experts of layer 1
    cfg, f32 = model.config, 4
    H, hd, inter, E = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = 2 * (3 * H + q + 2 * kv + q + H)
    mlp = (2 * H + 2 * cfg.intermediate_size) + (cfg.intermediate_size + H)
    info = llm.engine.adapters.info()
    assert info["row_bytes"] == (attn + mlp) * f32 and info["expert_row_bytes"] == E * (2 * H + 3 * inter + H) * f32
    oracle = peft_model(path, ad)
    names = [None, "m"]
    prompts = random_prompts([17, 9], model.config.vocab_size, seed=23)
    check(llm, model, prompts, 5, lora_names=names, oracle=lambda i: model if names[i] is None else oracle)
