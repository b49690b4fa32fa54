"""kv_cache_dtype fp8 (e4m3 codes, kernels/kv_fp8.py) in the engine on CPU (the reference attention: the C++ kernels
take float caches only): the default model's teacher-forced top-1 against transformers in float32; the checkpoint's
per-layer K/V scales (models/kv_scales.py) reach the layers and a float cache ignores them; values other than auto /
fp8 / fp8_e4m3 are refused naming the field."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.hf_models import make_hf_model, peft_model
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams as SP
from loom.errors import ConfigError
from loom.models.kv_scales import check_kv_cache_scheme

POSITIONS = 128


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.mark.parametrize("value", ["fp16", "int8", "fp8_e5m2", "FP8", ""])
def test_other_values_are_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match=f"kv_cache_dtype.*{value!r}"):
        EngineConfig(kv_cache_dtype=value)
    with pytest.raises(ConfigError, match=f"kv_cache_dtype.*{value!r}"):  # the offline API, before any load
        LLM("/nonexistent", kv_cache_dtype=value)


def test_default_model_teacher_forced_top1(default_model_dir):
    """Each prompt position's top-1 token (prompt_logprobs) of the fp8 engine against transformers' float32 argmax on
    the same English text, prefilled in chunks of 32 (later chunks read the earlier ones' codes). e4m3 keeps 3
    mantissa bits (each K/V element within 2^-4 relative), which moves this model's log-probs by up to ~0.7 nat
    (measured, 256 positions): the top-1 may flip only where the float model's top-2 margin is that small. Measured
    against the float32 auto engine: 0.94 agreement over 256 positions, all flips at margins < 0.32 nat; this test's
    128 positions: 0.914 against transformers (the auto engine: 1.0), flips at margins <= 0.22 nat. Asserted:
    >= 0.8 agreement, and no flip where the oracle's margin exceeds 1 nat (3x the largest flipped margin seen)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    with open(__file__.rsplit("/tests/", 1)[0] + "/README.md") as f:
        ids = tok(f.read()[:4000])["input_ids"][:POSITIONS + 1]
    assert len(ids) == POSITIONS + 1
    with torch.no_grad():
        logits = peft_model(default_model_dir, None)(input_ids=torch.tensor([ids])).logits[0, :POSITIONS].float()
    top2 = logits.log_softmax(-1).topk(2)
    want, margin = top2.indices[:, 0], top2.values[:, 0] - top2.values[:, 1]
    llm = LLM(default_model_dir, dtype="float32", kv_cache_dtype="fp8", max_model_len=512,
              kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32, cpu_threads=1)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == torch.uint8
    assert all((a.k_scale, a.v_scale) == (1.0, 1.0) for a in runner.model.attention_layers())  # none saved
    out = llm.generate([ids], SP(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    llm.close()
    got = torch.tensor([e.top[0][0] for e in out.prompt_logprobs[1:]])
    agree = got == want
    assert agree.float().mean() >= 0.8, f"top-1 agreement {agree.float().mean():.3f}"
    assert not agree.all(), "no position moved: is the cache really fp8?"
    flipped = margin[~agree]
    assert (flipped < 1.0).all(), f"top-1 flipped at margins {flipped.tolist()}"


def test_checkpoint_scales_reach_the_layers(tmp_path):
    """llm-compressor's per-layer self_attn.k_scale / v_scale tensors: the fp8 engine's layers take them (a layer
    without them 1.0) and generates; an auto engine loads the same checkpoint, scales unused."""
    _, path = make_hf_model("llama", tmp_path)
    f = f"{path}/model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.125])
    save_file(tensors, f, metadata={"format": "pt"})
    kw = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20, cpu_threads=1)
    prompt = [5, 9, 13, 2, 7, 11]
    for dt, want in (("fp8", [(0.25, 0.5), (0.125, 0.125)]), ("auto", [(1.0, 1.0), (1.0, 1.0)])):
        llm = LLM(path, kv_cache_dtype=dt, **kw)
        attn = llm.engine.runner.model.attention_layers()
        assert [(a.k_scale, a.v_scale) for a in attn][:2] == want
        assert all((a.k_scale, a.v_scale) == (1.0, 1.0) for a in attn[2:])
        assert len(llm.generate([prompt], SP(temperature=0, max_tokens=4))[0].token_ids) == 4
        llm.close()


def test_kv_cache_scheme_only_checkpoint_loads_dense_weights(tmp_path):
    """llm-compressor's KV-cache-only recipe: quantization_config has a kv_cache_scheme and no config_groups. The
    weights load as the dense model's (greedy tokens equal to the same folder without the config), an fp8 engine
    takes the saved scales; a bad scheme is still refused naming it."""
    import json

    _, path = make_hf_model("llama", tmp_path)
    f = f"{path}/model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(tensors, f, metadata={"format": "pt"})
    kw = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20, cpu_threads=1)
    prompt = [5, 9, 13, 2, 7, 11]
    plain = LLM(path, **kw)
    want = plain.generate([prompt], SP(temperature=0, max_tokens=6))[0].token_ids
    plain.close()
    with open(f"{path}/config.json") as fh:
        cfg = json.load(fh)
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                  "quantization_status": "compressed", "kv_cache_scheme": scheme}
    with open(f"{path}/config.json", "w") as fh:
        json.dump(cfg, fh)
    llm = LLM(path, **kw)
    assert llm.generate([prompt], SP(temperature=0, max_tokens=6))[0].token_ids == want
    llm.close()
    llm = LLM(path, kv_cache_dtype="fp8", **kw)
    assert (llm.engine.runner.model.attention_layers()[0].k_scale,
            llm.engine.runner.model.attention_layers()[0].v_scale) == (0.25, 0.5)
    assert len(llm.generate([prompt], SP(temperature=0, max_tokens=4))[0].token_ids) == 4
    llm.close()
    cfg["quantization_config"]["kv_cache_scheme"] = dict(scheme, strategy="channel")
    with open(f"{path}/config.json", "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(ConfigError, match="kv_cache_scheme"):
        LLM(path, **kw)


def test_kv_cache_scheme_other_than_fp8_per_tensor_is_refused():
    check_kv_cache_scheme({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    check_kv_cache_scheme(None)
    for bad in ({"num_bits": 8, "type": "int", "strategy": "tensor"},
                {"num_bits": 8, "type": "float", "strategy": "channel"},
                {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}):
        with pytest.raises(ConfigError, match="kv_cache_scheme"):
            check_kv_cache_scheme(bad)


def test_prefix_cache_hit_reads_the_same_codes(tmp_path):
    """A second request with the same prompt reuses the first's fp8 blocks (prefix caching needs nothing special:
    the codes are what a recomputation would store) and generates the same greedy tokens as a cold engine."""
    _, path = make_hf_model("llama", tmp_path)
    prompt = list(range(3, 40))
    kw = dict(kv_cache_dtype="fp8", max_model_len=128, kv_cache_memory_bytes=1 << 20, cpu_threads=1, block_size=16)
    llm = LLM(path, **kw)
    first = llm.generate([prompt], SP(temperature=0, max_tokens=8))[0]
    again = llm.generate([prompt], SP(temperature=0, max_tokens=8))[0]
    llm.close()
    cold = LLM(path, enable_prefix_caching=False, **kw)
    ref = cold.generate([prompt], SP(temperature=0, max_tokens=8))[0]
    cold.close()
    assert again.num_cached_tokens >= 32
    assert again.token_ids == first.token_ids == ref.token_ids
