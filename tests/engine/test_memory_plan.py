"""The memory plan (loom.engine.worker.memory_plan, scripts/plan_memory.py) from config.json alone agrees with what
the engine allocates: the model's bytes as loaded (float32, bfloat16, a W4A16 checkpoint kept quantized, each rank
of TP=2, float or quantized) and the KV cache tensor; the model's bytes also against the checkpoint's own tensors
(safetensors headers) and a published parameter count."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from harness.hf_models import make_hf_model
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.worker.memory_plan import RankShape, model_bytes, plan
from loom.layers.quant_linear import QuantLinear
from loom.models.loader import load_model

MAX_LEN = 256
KV_BYTES = 3 << 20


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


def checkpoint_bytes(path: str, dtype: torch.dtype) -> int:
    """The oracle: the checkpoint's tensors as the engine holds them - float weights in `dtype`, quantized ones as
    stored (compressed-tensors' weight_shape is metadata, not kept) - plus the float32 rope table."""
    total = 0
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            numel = 1
            for d in t.get_shape():
                numel *= d
            kind = t.get_dtype()
            if name.endswith("weight_shape"):
                continue
            quantized = name.endswith(("weight_packed", "weight_scale", "weight_zero_point"))
            if name.endswith("weight_zero_point") and kind == "I32":  # 4-bit, eight a word: held one int32 each
                numel *= 8
            elem = torch.tensor([], dtype=dtype).element_size() if kind.startswith(("F", "BF")) and not quantized \
                else {"I32": 4, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1}[kind]
            total += numel * elem
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return total + MAX_LEN * head_dim * 4


def _engine_and_plan(path: str, dtype: str, **kw):
    llm = LLM(path, dtype=dtype, max_model_len=MAX_LEN, kv_cache_memory_bytes=KV_BYTES, cpu_threads=1, **kw)
    config = EngineConfig(model=path, dtype=dtype, device="cpu", max_model_len=MAX_LEN,
                          kv_cache_memory_bytes=KV_BYTES, **kw)
    return llm, plan(path, config)


def _assert_kv_agrees(runner, p) -> None:
    assert runner.bytes_per_block == p.kv_bytes_per_token * p.block_size
    assert runner.num_blocks * runner.block_size == p.kv_tokens
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == p.kv_tokens * p.kv_bytes_per_token
    cfg = runner.hf_config  # the direct count: K and V, every layer, every KV head
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert p.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * \
        runner.kv_cache.element_size()


@pytest.mark.parametrize("family,dtype,kv_dtype", [("llama", "float32", "auto"), ("qwen3_moe", "bfloat16", "auto"),
                                                    ("llama", "float32", "fp8"), ("llama", "bfloat16", "fp8_e4m3")])
def test_plan_is_what_the_engine_allocates(tmp_path, family, dtype, kv_dtype):
    _, path = make_hf_model(family, tmp_path)
    llm, p = _engine_and_plan(path, dtype, kv_cache_dtype=kv_dtype)
    runner = llm.engine.runner
    assert p.dtype == runner.dtype == getattr(torch, dtype)
    assert p.weight_bytes == runner.weight_bytes == checkpoint_bytes(path, runner.dtype)
    assert runner.kv_cache.element_size() == (1 if kv_dtype != "auto" else runner.dtype.itemsize)
    _assert_kv_agrees(runner, p)
    llm.close()


def test_fp8_kv_cache_holds_more_tokens(tmp_path):
    """One byte an element: for the same budget 4x the tokens of a float32 cache, 2x those of a bfloat16 one (whole
    blocks: within one block of it)."""
    _, path = make_hf_model("llama", tmp_path)
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        for kv in ("auto", "fp8"):
            tokens[dtype, kv] = plan(path, EngineConfig(model=path, dtype=dtype, device="cpu", max_model_len=MAX_LEN,
                                                        kv_cache_memory_bytes=KV_BYTES, kv_cache_dtype=kv)).kv_tokens
    block = 16
    assert abs(tokens["float32", "fp8"] - 4 * tokens["float32", "auto"]) < 4 * block
    assert abs(tokens["bfloat16", "fp8"] - 2 * tokens["bfloat16", "auto"]) < 2 * block
    assert tokens["float32", "fp8"] == tokens["bfloat16", "fp8"]


def test_plan_of_a_quantized_checkpoint_kept_quantized(tmp_path):
    pytest.importorskip("compressed_tensors")
    from harness.quant_checkpoints import make_ct_checkpoint

    float_model, path = make_ct_checkpoint("llama", tmp_path, "W4A16_ASYM", "w4a16")
    llm, p = _engine_and_plan(path, "float32")
    runner = llm.engine.runner
    assert any(isinstance(m, QuantLinear) for m in runner.model.modules())
    assert "kept quantized" in p.quantization
    assert p.weight_bytes == runner.weight_bytes == checkpoint_bytes(path, torch.float32)
    _assert_kv_agrees(runner, p)
    # the what-if "unquantized" (quantization_config None) is the float model's parameters, plus the rope table
    float_plan = plan(path, EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=MAX_LEN,
                                         kv_cache_memory_bytes=KV_BYTES), quantization_config=None)
    head_dim = float_model.config.hidden_size // float_model.config.num_attention_heads
    assert float_plan.weight_bytes == 4 * sum(t.numel() for t in float_model.parameters()) + MAX_LEN * head_dim * 4
    assert p.weight_bytes < float_plan.weight_bytes / 2
    llm.close()


def test_plan_per_rank_at_tensor_parallel_2(tmp_path):
    """Each rank's shard as the loader builds it (uneven: 3 KV heads on 2 ranks, 1 and 2): the plan is the largest
    rank's weights and KV bytes per token (every rank holds the same blocks, as many as the fullest rank's memory
    holds)."""
    _, path = make_hf_model("llama", tmp_path, num_key_value_heads=3)
    p = plan(path, EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=MAX_LEN,
                                kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2))
    weights, per_token = [], []
    for rank in range(2):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), MAX_LEN, tp=RankShape(rank, 2))
        attn = model.attention_layers()
        weights.append(model_bytes(model))
        per_token.append(2 * len(attn) * attn[0].num_kv_heads * attn[0].head_dim * 4)
    assert per_token[0] != per_token[1] and weights[0] != weights[1]
    assert (p.weight_bytes, p.kv_bytes_per_token) == (max(weights), max(per_token))
    assert p.kv_tokens == KV_BYTES // (max(per_token) * 16) * 16


def test_plan_per_rank_of_a_quantized_checkpoint_at_tensor_parallel_2(tmp_path):
    """W4A16 asymmetric (zero points packed along the output dim) over 2 ranks: each rank keeps its shard quantized,
    and the plan's weights are the largest rank's as loaded (intermediate 512: down_proj's 256 columns a rank are
    whole groups of 128)."""
    pytest.importorskip("compressed_tensors")
    from harness.quant_checkpoints import make_ct_checkpoint

    _, path = make_ct_checkpoint("llama", tmp_path, "W4A16_ASYM", "w4a16", intermediate_size=512)
    p = plan(path, EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=MAX_LEN,
                                kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2))
    weights = []
    for rank in range(2):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), MAX_LEN, tp=RankShape(rank, 2))
        assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * 2
        weights.append(model_bytes(model))
    assert "kept quantized" in p.quantization and p.weight_bytes == max(weights)
    assert p.weight_bytes < checkpoint_bytes(path, torch.float32)  # about half of TP=1's


MIXTRAL_8X7B = {  # config.json of mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters (its model card: 46.7B)
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000}


def test_plan_memory_command_from_config_json_alone(tmp_path, capsys):
    import plan_memory

    folder = tmp_path / "mixtral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MIXTRAL_8X7B))  # no weights, no tokenizer
    args = [str(folder), "--max-model-len", "32768", "--kv-tokens", "65536", "--gpu-memory-gib", "80"]
    assert plan_memory.main(args) == 1  # bfloat16: 87 GiB of weights on an 80 GiB GPU
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "dtype bfloat16" in out
    rope = 32768 * 128 * 4
    bf16 = plan(str(folder), EngineConfig(device="cuda", max_model_len=32768), 80 << 30)
    assert bf16.weight_bytes == 2 * 46_702_792_704 + rope
    assert bf16.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB a token
    tp2 = plan(str(folder), EngineConfig(device="cuda", max_model_len=32768, tensor_parallel_size=2), 80 << 30)
    assert tp2.weight_bytes < bf16.weight_bytes / 2 + rope and tp2.kv_bytes_per_token == bf16.kv_bytes_per_token // 2
    assert plan_memory.main(args + ["--tensor-parallel-size", "2"]) == 0  # 2 x 80 GiB: about 43.5 GiB of weights each
    # an fp8 KV cache: 64 KiB a token, half the bfloat16 cache's bytes
    fp8 = plan(str(folder), EngineConfig(device="cuda", max_model_len=32768, kv_cache_dtype="fp8"), 80 << 30)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token // 2 and fp8.weight_bytes == bf16.weight_bytes
    capsys.readouterr()
    assert plan_memory.main(args + ["--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "kv_cache_dtype fp8" in out and "per GPU: 32,768 B (" in out  # 4 of 8 KV heads a rank, 1 byte each
