"""Checkpoints as they come: tied configs that still carry lm_head.weight, in one file or sharded in any order.

The oracle is transformers loading the same directory: greedy tokens must be identical in float32.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from harness.hf_models import hf_greedy, make_hf_model, random_prompts
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams


def _write(path, shards: list[dict]) -> None:
    """Write tensors as one file, or as shards with an index (in the given order)."""
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if f.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, f))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("tied"), tie=True, num_hidden_layers=1)
    return path


@pytest.mark.parametrize("layout", ["single", "head_in_last_shard", "head_in_first_shard"])
@pytest.mark.parametrize("same", [False, True])
def test_tied_config_with_its_own_lm_head(tied, tmp_path, layout, same):
    sd = load_file(os.path.join(tied, "model.safetensors"))
    emb = sd["model.embed_tokens.weight"]
    head = emb.clone() if same else torch.randn(emb.shape, generator=torch.Generator().manual_seed(7)) * 3
    body = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    shards = {"single": [{**body, "lm_head.weight": head}],
              "head_in_last_shard": [body, {"lm_head.weight": head}],
              "head_in_first_shard": [{"lm_head.weight": head}, body]}[layout]
    path = str(tmp_path / layout)
    os.makedirs(path)
    with open(os.path.join(tied, "config.json")) as f:
        cfg = f.read()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(cfg)
    _write(path, shards)

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, kv_cache_memory_bytes=4 << 20)
    model = llm.engine.runner.model
    assert torch.equal(model.model.embed_tokens.weight, emb)  # never overwritten by the head
    assert torch.equal(model.lm_head.weight, head)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == same  # tied only when equal
    prompts = random_prompts([5, 19], 320, seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ref, p, 8)
