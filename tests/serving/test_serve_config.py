"""vllm_backend's `<model>/<version>/model.json`: loom ignores it, and says so once at load with the config.pbtxt
parameter to set for each key (serve_config.MODEL_JSON_KEYS), never naming a parameter loom does not accept."""
from __future__ import annotations

import json
import logging
import sys

import pytest

from loom.errors import ConfigError
from loom.models.loader import ModelLoadError
from loom.serving.serve_config import MODEL_JSON_KEYS, model_json_warning, parse_model_parameters
from tests.reliability.test_engine_faults import fake_pb_utils

VLLM_ARGS = {"model": "meta-llama/Llama-3.2-1B", "gpu_memory_utilization": 0.5, "enforce_eager": True,
             "tensor_parallel_size": 2, "max_loras": 4, "speculative_config": {"method": "ngram"}}


def unknown_parameter(name: str, model_dir: str) -> bool:
    """Whether parse_model_parameters refuses `name` as a key it does not know (an empty value keeps defaults, so
    a known key either loads or is refused for its value)."""
    try:
        parse_model_parameters({name: {"string_value": ""}}, model_dir)
    except ConfigError as e:
        return "unknown parameter" in str(e)
    return False


def write_model_json(model_dir, content, version="1"):
    (model_dir / version).mkdir(parents=True, exist_ok=True)
    path = model_dir / version / "model.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_every_mapped_parameter_is_one_serve_config_accepts(tmp_path):
    targets = {param for param, _ in MODEL_JSON_KEYS.values() if param is not None}
    assert unknown_parameter("gpu_memory_utilisation", str(tmp_path))  # the check can fail
    assert [t for t in sorted(targets) if unknown_parameter(t, str(tmp_path))] == []


def test_the_warning_names_each_key_and_what_to_set(tmp_path):
    path = write_model_json(tmp_path, VLLM_ARGS, version="3")
    w = model_json_warning(str(tmp_path), 3)
    assert path in w and "ignore" in w
    assert "gpu_memory_utilization=0.5: set parameter 'gpu_memory_utilization'" in w
    assert "enforce_eager=true: set parameter 'cuda_graphs' (enforce_eager true is cuda_graphs false)" in w
    assert "max_loras=4: set parameter 'lora_memory_bytes'" in w
    assert "tensor_parallel_size=2: set parameter 'tensor_parallel_size'" in w
    assert 'speculative_config={"method": "ngram"}: loom has no such parameter' in w
    assert all(f"{k}=" in w for k in VLLM_ARGS)


def test_no_warning_without_engine_arguments(tmp_path):
    assert model_json_warning(str(tmp_path), 1) is None  # no file
    write_model_json(tmp_path, {"enable_lora": True})  # what multi_lora writes for Triton's OpenAI frontend
    assert model_json_warning(str(tmp_path), 1) is None
    write_model_json(tmp_path, {"enable_lora": True, "max_lora_rank": 16})
    assert "max_lora_rank=16: set parameter 'max_lora_rank'" in model_json_warning(str(tmp_path), 1)


@pytest.mark.parametrize("content, says", [("{not json", "not readable JSON"), ("[1, 2]", "not a JSON object")])
def test_a_broken_model_json_is_still_reported(tmp_path, content, says):
    path = write_model_json(tmp_path, content)
    w = model_json_warning(str(tmp_path), "1")
    assert path in w and says in w


@pytest.fixture
def model_py(monkeypatch):
    pb = fake_pb_utils()
    warned: list[str] = []
    pb.Logger.log_warn = warned.append
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    sys.modules.pop("loom.model", None)
    import loom.model as model_py

    handlers = list(logging.getLogger("loom").handlers)
    yield model_py, warned
    logging.getLogger("loom").handlers[:] = handlers
    sys.modules.pop("loom.model", None)


def test_model_load_warns_once_in_tritons_log(model_py, tmp_path):
    """Through backend/model.py's initialize: one warning in Triton's log, before the engine loads (the model folder
    here does not exist, so the load then fails; the warning must already be out)."""
    module, warned = model_py
    write_model_json(tmp_path, VLLM_ARGS)
    config = {"name": "m", "model_transaction_policy": {"decoupled": True},
              "parameters": {"model": {"string_value": "no-such-model"}, "metrics": {"string_value": "false"}}}
    args = {"model_config": json.dumps(config), "model_repository": str(tmp_path), "model_name": "m",
            "model_version": "1"}
    with pytest.raises(ModelLoadError):
        module.TritonPythonModel().initialize(args)
    assert warned == [f"[loom] {model_json_warning(str(tmp_path), 1)}"]


def test_list_parameters_keep_uris_and_resolve_paths(tmp_path):
    """adapter_sources' URIs pass through as given; adapter_roots' relative paths are under the model's folder."""
    (tmp_path / "adapters").mkdir()
    cfg = parse_model_parameters({"adapter_sources": {"string_value": "file:///srv/a, memory://bucket/x"},
                                  "adapter_roots": {"string_value": "adapters"}}, str(tmp_path))
    assert cfg.engine.adapter_sources == ["file:///srv/a", "memory://bucket/x"]
    assert cfg.engine.adapter_roots == [str(tmp_path / "adapters")]


def test_kv_cache_dtype_parameter(tmp_path):
    """config.pbtxt's kv_cache_dtype (vLLM's model.json key maps to it): fp8 / fp8_e4m3 / auto taken, the rest refused
    naming the parameter and the value."""
    assert MODEL_JSON_KEYS["kv_cache_dtype"][0] == "kv_cache_dtype"
    for value in ("auto", "fp8", "fp8_e4m3"):
        cfg = parse_model_parameters({"kv_cache_dtype": {"string_value": value}}, str(tmp_path))
        assert cfg.engine.kv_cache_dtype == value
    with pytest.raises(ConfigError, match="kv_cache_dtype.*'fp8_e5m2'"):
        parse_model_parameters({"kv_cache_dtype": {"string_value": "fp8_e5m2"}}, str(tmp_path))
