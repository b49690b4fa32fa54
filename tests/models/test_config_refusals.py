"""What a config asks for that loom does not compute is refused at load, naming the field - never approximated."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from loom.engine.llm import LLM
from loom.errors import ConfigError
from loom.models.loader import ModelLoadError, load_hf_config

CASES = [
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 512}}, "rope_parameters.rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                   "attention_factor": 0.5}}, "rope_parameters.attention_factor"),
    ("llama", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization_config.quant_method"),
    ("llama", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("llama", {"pretraining_tp": 2}, "pretraining_tp"),
    ("gemma2", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                       "rope_theta": 1000000.0}}},
     "rope_parameters.full_attention.rope_type"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
              "original_max_position_embeddings": 512}, "rope_parameters.rope_type"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
]


def _variant(src: str, dst: str, changes: dict) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("family,changes,field", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_refused_naming_the_field(tiny_model, tmp_path, family, changes, field):
    _, path = tiny_model(family)
    bad = _variant(path, str(tmp_path / "bad"), changes)
    with pytest.raises(ConfigError) as e:
        load_hf_config(bad)
    assert e.value.field == f"config.json {field}"
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        LLM(bad, kv_cache_memory_bytes=1 << 20)


def test_unknown_architecture_refused(tiny_model, tmp_path):
    _, path = tiny_model("llama")
    bad = _variant(path, str(tmp_path / "bad"), {"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration.*not supported"):
        load_hf_config(bad)
