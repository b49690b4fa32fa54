"""The CPU layer pass (models/layer_pass.py, kernels/csrc/layer.cpp: a decoder layer in one C++ call) gives the bits
of the Python layer path: the hidden states the logits are computed from are bitwise equal, step by step, through
single decodes, mixed prefill + decode batches in chunks, a prefix-cache hit and LoRA adapters (all projections, q/v
only, mixed with base rows), for every family; the families whose layers it does not take run the Python path."""
from __future__ import annotations

import pytest
import torch

from harness.hf_models import MOE_FAMILIES, make_hf_model, make_peft_adapter, random_prompts
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.kernels import cpu_ext, cpu_linear, policy
from loom.models import layer_pass as lp_mod
from loom.models.layer_pass import LayerPass

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# families whose layers the pass takes (rope scaling, windows, q/k/v biases, q/k norms, partial rotary, Gemma's norms,
# soft-capping and GELU; MoE layers up to their block's input)
TAKEN = {"llama": True, "mistral": True, "qwen2": True, "qwen3": True, "phi3": True, "gemma2": True, "gemma3": True,
         "mixtral": True, "qwen3_moe": True}


@pytest.fixture(scope="module", params=sorted(TAKEN))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"layerpass-{request.param}")
    # Qwen3-MoE with a dense layer among the MoE ones: layers of two kinds (and sizes) in one step
    extra = {"mlp_only_layers": [1]} if request.param == "qwen3_moe" else {}
    _, path = make_hf_model(request.param, root, bias_std=0.5, **extra)
    adapters = root / "adapters"
    every = ATTN + ([] if request.param in MOE_FAMILIES else MLP)  # MoE experts are not modules
    some = ["q_proj", "v_proj"]
    if request.param == "phi3":  # fused in the checkpoint
        every, some = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]
    make_peft_adapter(path, str(adapters / "all"), seed=1, r=8, target_modules=every)
    make_peft_adapter(path, str(adapters / "qv"), seed=2, r=4, target_modules=some)
    return request.param, path, str(adapters)


def _record(llm: LLM, on: bool) -> tuple[list, list[torch.Tensor]]:
    """Tokens of every scenario, and every hidden-state batch the logits were computed from, pass on or off."""
    model = llm.engine.runner.model
    decoder = model.model
    assert isinstance(decoder.layer_pass, LayerPass)  # the engine sets it on CPU
    if not on:
        decoder.layer_pass = None
    for name in ("all", "qv"):  # resident before the recorded steps: a load in the background would change batches
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), lora_names=name)
    seen: list[torch.Tensor] = []
    logits = model.compute_logits
    model.compute_logits = lambda h: (seen.append(h.clone()), logits(h))[1]
    prompts = random_prompts([1, 9, 23, 40, 64], 320, seed=5)
    toks = [o.token_ids for o in llm.generate(prompts[:1], GREEDY)]  # one sequence: steps of one token
    toks += [o.token_ids for o in llm.generate(prompts, GREEDY)]  # mixed prefill + decode, chunked (budget 32)
    toks += [o.token_ids for o in llm.generate([prompts[4][:32] + [7, 8]], GREEDY)]  # a prefix-cache hit
    toks += [o.token_ids for o in llm.generate(prompts, GREEDY, lora_names=["all", None, "qv", "all", "qv"])]
    toks += [o.token_ids for o in llm.generate(prompts[2:4], GREEDY, lora_names="all")]  # one adapter, every row
    toks += [o.token_ids for o in llm.generate(prompts[:3], GREEDY, lora_names="qv")]  # q and v only
    return toks, seen


def _llm(path: str, adapters: str, threads: int, dtype: str = "auto") -> LLM:
    return LLM(path, adapter_roots=[adapters], max_lora_rank=8, lora_memory_bytes=1 << 20, block_size=16,
               max_num_batched_tokens=32, kv_cache_memory_bytes=2 << 20, cpu_threads=threads, dtype=dtype)


# every family on two threads (the work split between them); one thread for a dense and a MoE family (~10 s a case)
@pytest.mark.parametrize("family,threads", [(f, 2) for f in sorted(TAKEN)] + [("llama", 1), ("mixtral", 1)],
                         indirect=["family"])
def test_layer_pass_gives_the_python_layers_bits(family, threads, monkeypatch):
    name, path, adapters = family
    calls = []
    run = lp_mod.decoder_layer
    monkeypatch.setattr(lp_mod, "decoder_layer", lambda *a: (calls.append(1), run(*a))[1])
    toks_py, hidden_py = _record(_llm(path, adapters, threads), on=False)
    assert not calls
    toks, hidden = _record(_llm(path, adapters, threads), on=True)
    assert bool(calls) == TAKEN[name]
    assert toks == toks_py
    assert len(hidden) == len(hidden_py) > 20
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden_py))


# bfloat16 over loom's bfloat16 GEMM: a family of each kind of layer the C++ layer takes (plain; q/k norms; Gemma's
# float32 norm weights, GELU and soft-capping; MoE up to the block)
BF16_FAMILIES = ["llama", "qwen3", "gemma2", "qwen3_moe"]


@pytest.fixture(scope="module")
def loom_bf16_gemm():
    """The bfloat16 layer pass runs over loom's bfloat16 GEMM, which the policy picks where the CPU has avx512_bf16
    and no AMX (oneDNN drives AMX): picked here on every host, where the CPU lacks avx512_bf16 as the GEMM's plain
    loop in VDPBF16PS's order (kernels/csrc/gemm_bf16.cpp), so the layer pass and the Python layers share one GEMM
    on every x86 CI host."""
    if cpu_ext.load() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_linear, "loom_bf16_gemm", lambda lib=None: True)
        mp.setattr(policy, "_bf16_gemms", lambda: (True, False))
        assert policy.decide("cpu", torch.bfloat16).layer_pass
        yield


@pytest.fixture(scope="module", params=BF16_FAMILIES)
def bf16_family(request, tmp_path_factory, loom_bf16_gemm):
    root = tmp_path_factory.mktemp(f"layerpass-bf16-{request.param}")
    _, path = make_hf_model(request.param, root, bias_std=0.5)
    every = ATTN + ([] if request.param in MOE_FAMILIES else MLP)
    make_peft_adapter(path, str(root / "adapters" / "all"), seed=1, r=8, target_modules=every)
    make_peft_adapter(path, str(root / "adapters" / "qv"), seed=2, r=4, target_modules=["q_proj", "v_proj"])
    return request.param, path, str(root / "adapters")


def test_bf16_layer_pass_gives_the_python_layers_bits(bf16_family, monkeypatch):
    """In bfloat16 the one-call layer runs the kernels the Python layers call (loom's bfloat16 GEMM, the bfloat16
    norms, rope, KV store, attention, activation, each linear's LoRA pass on the GEMM's bfloat16 output) in the same
    order: the same bits, through steps with adapters of ranks 8 and 4 (all projections, q/v only) beside base rows."""
    name, path, adapters = bf16_family
    calls = []
    run = lp_mod.decoder_layer
    monkeypatch.setattr(lp_mod, "decoder_layer", lambda *a: (calls.append(a[1].struct.groups), run(*a))[1])
    toks_py, hidden_py = _record(_llm(path, adapters, 2, "bfloat16"), on=False)
    assert not calls
    toks, hidden = _record(_llm(path, adapters, 2, "bfloat16"), on=True)
    assert hidden[0].dtype == torch.bfloat16
    assert any(g == 0 for g in calls) and any(g > 0 for g in calls)  # steps without and with adapters in the pass
    assert toks == toks_py
    assert len(hidden) == len(hidden_py) > 20
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden_py))


def test_layer_args_follow_rebound_caches_and_pools(tmp_path):
    """A layer's C++ arguments are made once and made again when its KV cache or a LoRA pool is rebound (the pools
    are replaced when they grow): the pass never reads memory a layer no longer uses."""
    _, path = make_hf_model("llama", tmp_path)
    llm = LLM(path, max_lora_rank=8, lora_memory_bytes=1 << 20, block_size=16, kv_cache_memory_bytes=2 << 20)
    decoder = llm.engine.runner.model.model
    lp, layer = decoder.layer_pass, decoder.layers[0]
    args = lp._args(layer)
    assert args is not None and lp._args(layer) is args
    mlp = layer.mlp.down_proj
    mlp.lora_a, mlp.lora_b = mlp.lora_a.clone(), mlp.lora_b.clone()
    again = lp._args(layer)
    assert again is not args and again.struct.down.lora_a == mlp.lora_a.data_ptr()
    att = layer.self_attn.attn
    att.k_cache = att.k_cache.clone()
    assert lp._args(layer).struct.k_cache == att.k_cache.data_ptr()
    att.k_cache = None  # no cache bound (the memory profile's state): the Python path
    assert lp._args(layer) is None


def test_each_layer_is_handed_the_next_layers_arguments(tmp_path, monkeypatch):
    """Every layer but the last gets the next layer's C++ arguments (its last GEMM asks for that layer's q|k|v adapter
    rows), once that layer has run once (in the first step they may not be made yet)."""
    _, path = make_hf_model("llama", tmp_path)
    llm = LLM(path, max_lora_rank=8, lora_memory_bytes=1 << 20, block_size=16, kv_cache_memory_bytes=2 << 20)
    decoder = llm.engine.runner.model.model
    seen = []
    run = lp_mod.decoder_layer
    monkeypatch.setattr(lp_mod, "decoder_layer", lambda *a: (seen.append((a[0], a[-1])), run(*a))[1])
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    layers, lp = list(decoder.layers), decoder.layer_pass
    n = len(layers)
    assert n > 1 and len(seen) == 3 * n
    made = [lp._args(layer) for layer in layers]
    for step in range(3):
        for i, (args, following) in enumerate(seen[step * n:(step + 1) * n]):
            assert args is made[i]
            if step > 0 or following is not None or i + 1 == n:
                assert following is (made[i + 1] if i + 1 < n else None)
