"""Quantized checkpoints under tensor parallelism (CPU, gloo): each rank keeps its shard of the quantized weights
quantized (QuantLinear over exactly its rows or columns, QuantExperts over its intermediate slice), and TP=2 gives
TP=1's greedy tokens on the same checkpoint in float32. A layout a rank cannot split (not whole groups or blocks)
is refused naming tensor_parallel_size, by the loader and the memory plan alike."""
from __future__ import annotations

import pytest
import torch

from harness.hf_models import random_prompts
from harness.quant_checkpoints import make_ct_checkpoint, make_ct_moe_checkpoint, make_packed_checkpoint
from loom.engine.config import EngineConfig
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.engine.worker.memory_plan import RankShape, plan
from loom.errors import ConfigError
from loom.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from loom.layers.quant_experts import QuantExperts
from loom.layers.quant_linear import QuantLinear
from loom.models.loader import build_meta_model, load_hf_config, load_model
from tests.models.parity import GREEDY

pytest.importorskip("compressed_tensors")

MAX_LEN = 64
# W4A16 in groups of 64: the tiny model's row-parallel inputs (o_proj 256 / 2, down_proj 384 / 2) are whole groups
W8_CHANNEL = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}
W4_G64 = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}}
CASES = {
    "ct-w8a16-channel": lambda root: make_ct_checkpoint("llama", root, W8_CHANNEL, "w8a16"),
    "ct-w4a16-g64": lambda root: make_ct_checkpoint("llama", root, W4_G64, "w4a16-g64"),
    # Phi-3's fused q|k|v and gate|up tensors, act-order groups: each rank's columns keep their own g_idx entries
    "gptq-desc-act-asym-g32": lambda root: make_packed_checkpoint(
        "phi3", root, "gptq", "gptq-act", dict(desc_act=True, group_size=32, sym=False)),
}
DENSE = list(CASES)
# shards checked without an engine: zero points packed along the output (AWQ), FP8 row and column blocks
SHARDED = {
    "awq-g64": lambda root: make_packed_checkpoint("llama", root, "awq", "awq-g64", dict(group_size=64)),
    "fp8-block32": lambda root: make_packed_checkpoint("llama", root, "fp8", "fp8-b32", dict(block=(32, 32))),
}
# experts split by their intermediate features, each rank's slice kept quantized
CASES["ct-w8a16-channel-qwen3_moe"] = lambda root: make_ct_moe_checkpoint(
    "qwen3_moe", root, W8_CHANNEL, "moe-w8", moe_intermediate_size=128, head_dim=32)


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict = {}
    root = tmp_path_factory.mktemp("tp_quantized")

    def get(case: str) -> str:
        if case not in cache:
            cache[case] = {**CASES, **SHARDED}[case](root)[1]
        return cache[case]

    return get


def _expected(full: torch.Tensor, meta_module) -> torch.Tensor:
    """A rank's part of the full dequantised weight: its rows of each fused slice, or its input columns."""
    if isinstance(meta_module, RowParallelLinear):
        return full[:, meta_module.shard.start:meta_module.shard.stop]
    assert isinstance(meta_module, ColumnParallelLinear)
    return torch.cat([full[o + s.start:o + s.stop] for o, s in zip(meta_module.full_offsets, meta_module.shards)])


@pytest.mark.parametrize("case", DENSE + list(SHARDED))
def test_each_rank_holds_its_shard_quantized(checkpoints, case):
    """Every projection of every rank a QuantLinear whose dequantised weight is exactly its slice of TP=1's; the
    memory plan's per-GPU weights are the largest rank's bytes as loaded."""
    from loom.engine.worker.memory_plan import model_bytes

    path = checkpoints(case)
    cpu = torch.device("cpu")
    whole, _ = load_model(path, torch.float32, cpu, MAX_LEN)
    cfg = load_hf_config(path)
    sizes = []
    for rank in range(2):
        model, _ = load_model(path, torch.float32, cpu, MAX_LEN, tp=RankShape(rank, 2))
        meta = build_meta_model(cfg, MAX_LEN, RankShape(rank, 2), torch.float32)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        assert len(layers) == 4 * cfg.num_hidden_layers
        for name, layer in layers.items():
            assert (layer.reduce is not None) == name.endswith(("o_proj", "down_proj"))
            want = _expected(whole.get_submodule(name).dequantized(), meta.get_submodule(name))
            assert torch.equal(layer.dequantized(), want), name
        sizes.append(model_bytes(model))
    p = plan(path, EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=MAX_LEN,
                                kv_cache_memory_bytes=1 << 20, tensor_parallel_size=2))
    assert "kept quantized" in p.quantization and p.weight_bytes == max(sizes)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_tokens_equal_tp1(checkpoints, case):
    path = checkpoints(case)
    prompts = random_prompts([5, 23], 320, seed=3)
    params = SamplingParams(max_tokens=6, **GREEDY)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(path, block_size=16, kv_cache_memory_bytes=1 << 20, cpu_threads=1, tensor_parallel_size=tp,
                  max_num_batched_tokens=16, dtype="float32")
        try:
            assert any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
            outs = llm.generate(prompts, params)
            assert all(o.error is None for o in outs), [o.error for o in outs]
            tokens[tp] = [o.token_ids for o in outs]
        finally:
            llm.engine.close()
    assert tokens[2] == tokens[1]


def test_moe_experts_keep_their_intermediate_slice_quantized(checkpoints):
    """Qwen3-MoE, W8A16 per channel: each rank's QuantExperts hold their gate|up rows and down columns of its slice of
    every expert's intermediate features, exactly TP=1's dequantised weights cut there."""
    path = checkpoints("ct-w8a16-channel-qwen3_moe")
    cpu = torch.device("cpu")
    whole, _ = load_model(path, torch.float32, cpu, MAX_LEN)
    experts = [n for n, m in whole.named_modules() if isinstance(m, QuantExperts)]
    assert experts
    for rank in range(2):
        model, _ = load_model(path, torch.float32, cpu, MAX_LEN, tp=RankShape(rank, 2))
        for name in experts:
            mine = model.get_submodule(name)
            assert isinstance(mine, QuantExperts)
            n, a, b = mine.intermediate_size, mine.shard.start, mine.shard.stop
            full_n = mine.full_intermediate
            w13, w2 = whole.get_submodule(name).dequantized()
            got13, got2 = mine.dequantized()
            assert torch.equal(got13, torch.cat([w13[:, a:b], w13[:, full_n + a:full_n + b]], dim=1)) and n == b - a
            assert torch.equal(got2, w2[:, :, a:b])


UNSPLITTABLE = {  # down_proj's 384 input columns split 192 a rank: not whole groups (blocks) of 128
    "ct-w4a16-g128": (lambda root: make_ct_checkpoint("llama", root, "W4A16", "w4a16-g128"), "group size 128"),
    "fp8-block128": (lambda root: make_packed_checkpoint("llama", root, "fp8", "fp8-b128"), r"block \(128, 128\)"),
}


@pytest.mark.parametrize("case", list(UNSPLITTABLE))
def test_a_split_that_cuts_a_group_or_block_is_refused(tmp_path, case):
    make, what = UNSPLITTABLE[case]
    _, path = make(tmp_path)
    with pytest.raises(ConfigError, match=f"tensor_parallel_size.*down_proj.*{what}"):
        load_model(path, torch.float32, torch.device("cpu"), MAX_LEN, tp=RankShape(1, 2))
    with pytest.raises(ConfigError, match=f"tensor_parallel_size.*{what}"):  # the first layer it cuts
        plan(path, EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=MAX_LEN,
                                kv_cache_memory_bytes=1 << 20, tensor_parallel_size=2))
