"""config.pbtxt `parameters` -> EngineConfig + the serving options around it. Pure Python (testable).

Every key is typed by the dataclass field it sets; an unknown key or a bad value stops the model load
with a message naming the key (a typo must not silently fall back to a default). Keys in UPPER_CASE
belong to Triton or the Python backend (EXECUTION_ENV_PATH, ...) and are left alone, except vllm_backend's two:
REPORT_CUSTOM_METRICS (= `vllm_metrics`) and ENABLE_VLLM_HEALTH_CHECK (= `health_check`), so a vllm_backend
config.pbtxt keeps its meaning (given with the loom key too, the values must agree).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

from loom.engine.config import EngineConfig
from loom.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_ITEMS, MAX_STOP_STRING_CHARS
from loom.engine.worker.cpu import serving_threads
from loom.errors import ConfigError, RequestError
from loom.serving.request_parser import Limits, to_bool, to_float, to_int


@dataclass
class ServeOptions:
    max_queue_size: int = 256  # requests without a first token yet; more are refused with "overload"
    default_request_timeout_s: float = 0.0  # 0 = no deadline unless the request sets request_timeout_s
    max_request_timeout_s: float = 0.0  # 0 = no cap on request_timeout_s
    max_tokens_limit: int = 0  # cap on max_tokens (0 = only the context length)
    max_logprobs: int = 20
    max_prompt_chars: int = 1 << 20
    max_stop_items: int = MAX_STOP_ITEMS  # entries in `stop` and in `stop_token_ids` (at most 16)
    max_stop_chars: int = MAX_STOP_STRING_CHARS  # characters per stop string (at most 256)
    max_parameters_bytes: int = 1 << 16  # size of the sampling_parameters JSON and of the request parameters
    shutdown_timeout_s: float = 10.0  # finalize(): how long to wait for the engine loop and the senders
    sender_threads: int = 1
    metrics: bool = True  # loom_* metric families on Triton's metrics port
    vllm_metrics: bool = False  # vllm:* families as vllm_backend names them, plus the gateway's gauges
    lora_info_prefix: str = ""  # prepended to adapter names in vllm:lora_requests_info (e.g. "<model>_")
    health_check: bool = False  # unload the model when its engine breaks (needs --model-control-mode=explicit)
    max_failed_steps: int = 16  # engine steps failing in a row that make the engine unhealthy (0: never)
    max_n: int = 16  # completions per request (n)


@dataclass
class ServeConfig:
    engine: EngineConfig
    options: ServeOptions = field(default_factory=ServeOptions)

    @property
    def limits(self) -> Limits:
        o = self.options
        return Limits(o.max_tokens_limit, o.max_logprobs, o.max_prompt_chars, o.max_request_timeout_s,
                      o.max_stop_items, o.max_stop_chars, o.max_parameters_bytes, max_n=o.max_n)


# vllm_backend's upper-case keys and the loom keys they set.
VLLM_BACKEND_KEYS = {"REPORT_CUSTOM_METRICS": "vllm_metrics", "ENABLE_VLLM_HEALTH_CHECK": "health_check"}
_ENGINE_TYPES = {f.name: f.type for f in fields(EngineConfig)}
_OPTION_TYPES = {f.name: f.type for f in fields(ServeOptions)}


# vllm_backend keeps engine arguments in <model>/<version>/model.json; loom reads config.pbtxt parameters only.
# model.json key -> (the parameter to set instead, or None where loom has none; how it differs). Every parameter
# named here is one parse_model_parameters accepts (tests/serving/test_serve_config.py checks it).
MODEL_JSON_KEYS: dict[str, tuple[str | None, str]] = {
    "model": ("model", ""),
    "dtype": ("dtype", "auto, float32, float16 or bfloat16"),
    "block_size": ("block_size", ""),
    "gpu_memory_utilization": ("gpu_memory_utilization", ""),
    "kv_cache_memory_bytes": ("kv_cache_memory_bytes", ""),
    "max_num_seqs": ("max_num_seqs", ""),
    "max_num_batched_tokens": ("max_num_batched_tokens", ""),
    "max_model_len": ("max_model_len", ""),
    "enable_prefix_caching": ("enable_prefix_caching", ""),
    "seed": ("seed", ""),
    "async_scheduling": ("async_scheduling", ""),
    "max_logprobs": ("max_logprobs", ""),
    "enforce_eager": ("cuda_graphs", "enforce_eager true is cuda_graphs false"),
    "disable_log_stats": ("vllm_metrics", "the vllm:* metrics are on when it (or REPORT_CUSTOM_METRICS) is true"),
    "enable_lora": ("adapter_roots", "LoRA serves the adapters under these folders; Triton's OpenAI frontend reads "
                                     "enable_lora from model.json, keep it there for the frontend"),
    "max_loras": ("lora_memory_bytes", "adapters on the device are bounded by bytes, not by count"),
    "max_lora_rank": ("max_lora_rank", ""),
    "max_cpu_loras": ("max_host_adapters", ""),
    "lora_dtype": ("lora_dtype", ""),
    "tensor_parallel_size": ("tensor_parallel_size", ""),
    "pipeline_parallel_size": (None, "a model instance runs on one device; more instances: instance_group"),
    "quantization": (None, "loom serves unquantized checkpoints"),
    "kv_cache_dtype": ("kv_cache_dtype", "auto, fp8 or fp8_e4m3 (fp8_e5m2 is not served)"),
    "tokenizer": (None, "the tokenizer is the model folder's"),
    "trust_remote_code": (None, "loom runs no code from a checkpoint"),
}
# What `python -m loom.serving.multi_lora` writes to model.json for Triton's OpenAI frontend: no warning for that.
_FRONTEND_MODEL_JSON_KEYS = frozenset({"enable_lora"})


def model_json_warning(model_dir: str, version: str | int) -> str | None:
    """The one warning for `<model_dir>/<version>/model.json`, which loom ignores: for each key, the config.pbtxt
    parameter to set instead. None when there is no such file or it holds only what the OpenAI frontend reads."""
    path = os.path.join(model_dir, str(version), "model.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            args = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} is ignored (loom reads config.pbtxt parameters only); it is not readable JSON either: {e}"
    if not isinstance(args, dict):
        return f"{path} is ignored (loom reads config.pbtxt parameters only); it is not a JSON object either"
    if set(args) <= _FRONTEND_MODEL_JSON_KEYS:
        return None
    hints = []
    for key, value in args.items():
        param, note = MODEL_JSON_KEYS.get(key, (None, ""))
        hint = f"{key}={json.dumps(value)}: " + (f"set parameter {param!r}" if param else "loom has no such parameter")
        hints.append(hint + (f" ({note})" if note else ""))
    return (f"{path} holds vllm_backend engine arguments, which loom ignores; set config.pbtxt parameters instead "
            "(docs/CONFIGURATION.md): " + "; ".join(hints))


def _convert(key: str, typ: str, raw: str, base_dir: str):
    try:
        if typ == "int":
            return to_int(key, _size(raw))
        if typ == "float":
            return to_float(key, raw)
        if typ == "bool":
            return to_bool(key, raw)
        if typ == "list[str]":
            # URIs (adapter_sources) stay as given; paths are relative to the model's folder
            return [p.strip() if "://" in p else _path(p.strip(), base_dir) for p in raw.split(",") if p.strip()]
        return raw
    except RequestError as e:
        raise ConfigError(key, str(e).split(": ", 1)[1]) from None


def _size(raw: str) -> str:
    # Memory sizes may be written as 512MiB / 2GiB; plain integers are bytes.
    s = raw.strip()
    for suffix, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s.endswith(suffix):
            try:
                return str(int(float(s[: -len(suffix)]) * mult))
            except ValueError:
                return raw
    return raw


def _path(p: str, base_dir: str) -> str:
    # Relative paths are relative to the model's folder in the repository, so a repository can be moved.
    p = os.path.expandvars(os.path.expanduser(p))
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(base_dir, p))


def parse_model_parameters(parameters: dict, model_dir: str, instances: int = 1) -> ServeConfig:
    """`parameters`: config.pbtxt's parameters as in args["model_config"] ({key: {"string_value": v}});
    `instances`: how many model instances the server runs (they share the cores)."""
    eng_kwargs: dict = {}
    opt_kwargs: dict = {}
    aliased: dict[str, tuple[str, object]] = {}
    for key, val in (parameters or {}).items():
        raw = val.get("string_value", "") if isinstance(val, dict) else str(val)
        if key in VLLM_BACKEND_KEYS:
            if raw.strip():
                aliased[VLLM_BACKEND_KEYS[key]] = (key, _convert(key, "bool", raw, model_dir))
            continue
        if key.isupper():
            continue
        if key in _ENGINE_TYPES:
            typ = _ENGINE_TYPES[key]
            if raw.strip() == "" and typ != "str":
                continue  # an empty value keeps the default
            v = _convert(key, typ, raw, model_dir)
            if key == "model" and v:
                v = _path(v, model_dir)
            eng_kwargs[key] = v
        elif key in _OPTION_TYPES:
            if raw.strip() == "":
                continue
            opt_kwargs[key] = _convert(key, _OPTION_TYPES[key], raw, model_dir)
        else:
            known = sorted(set(_ENGINE_TYPES) | set(_OPTION_TYPES))
            raise ConfigError(key, f"unknown parameter; known: {', '.join(known)}")
    if not eng_kwargs.get("cpu_threads"):
        # Inside a server: the cores split between the model's instances, never more threads than cores
        eng_kwargs["cpu_threads"] = serving_threads(instances)
    for name, (key, v) in aliased.items():
        if name in opt_kwargs and opt_kwargs[name] != v:
            raise ConfigError(key, f"is {v} but {name} is {opt_kwargs[name]}; they are the same switch, set one")
        opt_kwargs[name] = v
    opts = ServeOptions(**opt_kwargs)
    for name, lo in (("max_queue_size", 1), ("max_logprobs", 0), ("max_prompt_chars", 1), ("sender_threads", 1),
                     ("max_tokens_limit", 0)):
        if getattr(opts, name) < lo:
            raise ConfigError(name, f"must be >= {lo}, got {getattr(opts, name)}")
    # SamplingParams enforces hard caps itself: a larger configured value would be silently ineffective.
    for name, lo, hi in (("max_logprobs", 0, MAX_LOGPROBS), ("max_stop_items", 0, MAX_STOP_ITEMS),
                         ("max_stop_chars", 1, MAX_STOP_STRING_CHARS), ("max_parameters_bytes", 256, 1 << 24)):
        if not lo <= getattr(opts, name) <= hi:
            raise ConfigError(name, f"must be in [{lo}, {hi}], got {getattr(opts, name)}")
    if opts.shutdown_timeout_s <= 0:
        raise ConfigError("shutdown_timeout_s", f"must be > 0 seconds, got {opts.shutdown_timeout_s}")
    for name in ("default_request_timeout_s", "max_request_timeout_s"):
        if getattr(opts, name) < 0:
            raise ConfigError(name, f"must be >= 0 seconds, got {getattr(opts, name)}")
    if not 1 <= opts.max_n <= MAX_N:
        raise ConfigError("max_n", f"must be in [1, {MAX_N}], got {opts.max_n}")
    if opts.max_failed_steps < 0:
        raise ConfigError("max_failed_steps", f"must be >= 0 (0 = never), got {opts.max_failed_steps}")
    if opts.sender_threads > 64:
        raise ConfigError("sender_threads", f"must be in [1, 64], got {opts.sender_threads}")
    return ServeConfig(EngineConfig(**eng_kwargs), opts)
