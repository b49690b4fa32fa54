"""Parse one Triton request (vllm_backend's tensors and parameters) into what the engine needs.

Pure Python and numpy, no Triton import, so every refusal can be unit-tested. Every refusal is a
RequestError whose field names what the client must fix and whose message says what is allowed.
Values are converted by the field's type because real clients send strings (genai-perf sends
`{"max_tokens": "32"}`); a conversion that would lose information ("1.5" for an int, "yes" for a bool)
is refused rather than guessed.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from loom.engine.sample.structured_output import StructuredOutputsParams
from loom.engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_ITEMS, MAX_STOP_STRING_CHARS, SamplingParams
from loom.errors import RequestError

# Our SamplingParams field -> converter kind. Names follow vllm's SamplingParams.
_FIELD_KINDS: dict[str, str] = {
    "max_tokens": "int", "min_tokens": "int", "temperature": "float", "top_k": "int", "top_p": "float",
    "min_p": "float", "repetition_penalty": "float", "presence_penalty": "float",
    "frequency_penalty": "float", "seed": "int", "stop": "str_list", "stop_token_ids": "int_list",
    "ignore_eos": "bool", "logprobs": "int", "include_stop_str_in_output": "bool",
    "skip_special_tokens": "bool", "n": "int", "logit_bias": "bias", "allowed_token_ids": "int_list",
    "bad_words": "str_list", "truncate_prompt_tokens": "int", "spaces_between_special_tokens": "bool",
    "prompt_logprobs": "int", "structured_outputs": "structured",
    "speculative": "bool",  # not vLLM's: false opts the request out of speculative decoding
}
# Older names: guided_decoding is what structured_outputs was called before vLLM 0.10.2 (same fields).
_ALIASES = {"guided_decoding": "structured_outputs"}
# vllm parameters we accept only at their default value (so a client asking for more is told, not ignored).
_ONLY_DEFAULT: dict[str, tuple[str, tuple[Any, ...]]] = {
    "best_of": ("int", (1,)),
    "use_beam_search": ("bool", (False,)),
    "detokenize": ("bool", (True,)),
}
# Keys that are not sampling parameters but may travel with them. top_logprobs: OpenAI chat's count, sent with
# "logprobs": true by Triton's OpenAI frontend.
_EXTRA_KEYS = {"lora_name", "request_timeout_s", "top_logprobs"}
# Request parameters set by clients or the server itself rather than by the user: ignored.
_RESERVED_PARAMS = {"priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                    "binary_data_output", "headers"}

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass
class ReturnFlags:
    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False


@dataclass
class Limits:
    """Server-side bounds from config.pbtxt, applied on top of SamplingParams' own ranges."""
    max_tokens: int = 0  # 0 = no extra cap (the engine still enforces the context length)
    max_logprobs: int = MAX_LOGPROBS
    max_prompt_chars: int = 1 << 20
    max_request_timeout_s: float = 0.0  # 0 = clients may ask for any deadline
    max_stop_items: int = MAX_STOP_ITEMS  # entries in `stop`, and in `stop_token_ids`
    max_stop_chars: int = MAX_STOP_STRING_CHARS  # characters per stop string
    max_parameters_bytes: int = 1 << 16  # the sampling_parameters JSON, and the request parameters' JSON
    max_prompt_tokens: int = 0  # input_ids length (0 = only the engine's check); set from the engine
    max_n: int = 16  # completions per request (n)


@dataclass
class ParsedRequest:
    prompt: str | None  # None when the client sent input_ids
    prompt_token_ids: list[int] | None
    stream: bool
    exclude_input_in_output: bool
    params: SamplingParams
    lora_name: str | None = None
    request_timeout_s: float | None = None
    returns: ReturnFlags = field(default_factory=ReturnFlags)

    @property
    def ids_mode(self) -> bool:
        return self.prompt_token_ids is not None


@dataclass
class AdapterOp:
    op: str  # load | unload | reload | list
    name: str | None
    path: str | None


ADAPTER_OPS = ("load", "unload", "reload", "list", "info")


# ---------------------------------------------------------------- value conversion

def to_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalar
        return to_bool(name, v.item())
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise RequestError(name, f"must be a boolean (true/false), got {v!r}")


def to_int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        raise RequestError(name, f"must be an integer, got the boolean {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f.is_integer():
                return int(f)
    raise RequestError(name, f"must be an integer, got {v!r}")


def to_float(name: str, v: Any) -> float:
    if isinstance(v, bool):
        raise RequestError(name, f"must be a number, got the boolean {v!r}")
    if isinstance(v, (int, float)):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            raise RequestError(name, f"must be a number, got {v!r}") from None
    else:
        raise RequestError(name, f"must be a number, got {v!r}")
    if not math.isfinite(f):
        raise RequestError(name, f"must be a finite number, got {v!r}")
    return f


MAX_JSON_DEPTH = 32  # nesting deeper than any parameter needs; bounded before parsing (json recurses per level)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _json_depth(text: str) -> int:
    """Deepest [ / { nesting outside string literals, in one linear pass (no recursion)."""
    if "[" not in text and "{" not in text:
        return 0
    b = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), dtype=np.uint8)
    steps = np.isin(b, _OPENERS).astype(np.int32) - np.isin(b, _CLOSERS)
    return int(np.cumsum(steps).max(initial=0))


_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)


def _check_depth(name: str, text: str) -> None:
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # the usual request: no deeper than its openers
        return
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(name, f"JSON is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")


def parse_json(name: str, text: str) -> Any:
    """json.loads with the nesting bounded first; every failure is a RequestError naming `name`."""
    _check_depth(name, text)
    try:
        return json.loads(text)
    except ValueError as e:
        raise RequestError(name, f"is not valid JSON ({e.msg} at position {e.pos}); expected an object such as "
                           '{"max_tokens": 32, "temperature": 0}') from None


def _maybe_json_list(name: str, v: Any) -> Any:
    # Triton request parameters carry only scalars, so lists arrive as JSON text.
    if isinstance(v, str) and v.strip().startswith("["):
        _check_depth(name, v)
        try:
            parsed = json.loads(v)
        except ValueError:
            return v
        if isinstance(parsed, list):
            return parsed
    return v


def to_str_list(name: str, v: Any) -> list[str]:
    v = _maybe_json_list(name, v)
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise RequestError(name, f"must be a string or a list of strings, got {v!r}")


def to_int_list(name: str, v: Any) -> list[int]:
    v = _maybe_json_list(name, v)
    if isinstance(v, str):
        v = [p for p in v.split(",") if p.strip()]
    if isinstance(v, (int, str)) and not isinstance(v, bool):
        v = [v]
    if isinstance(v, list):
        return [to_int(name, x) for x in v]
    raise RequestError(name, f"must be a list of integers, got {v!r}")


def to_bias(name: str, v: Any) -> dict:
    """{token id: bias}; Triton request parameters carry it as JSON text."""
    if isinstance(v, str):
        v = parse_json(name, v)
    if not isinstance(v, dict):
        raise RequestError(name, f'must be an object mapping token ids to biases, such as {{"50256": -100}}, got {v!r}')
    return {k: to_float(name, x) for k, x in v.items()}


def to_structured(name: str, v: Any) -> StructuredOutputsParams:
    if isinstance(v, str):
        _check_depth(name, v)
    return StructuredOutputsParams.parse(v, name)


_CONVERT = {"int": to_int, "float": to_float, "bool": to_bool, "str_list": to_str_list, "int_list": to_int_list,
            "bias": to_bias, "structured": to_structured}


# ---------------------------------------------------------------- parameters

def load_parameters(sampling_parameters: Any, request_parameters: Any, max_bytes: int = 0) -> dict[str, Any]:
    """Merge the `sampling_parameters` JSON tensor with Triton request parameters.

    Either may be absent; the same key in both with different values is refused (which one would win
    is not obvious to the client). Reserved client/server keys (priority, triton_*) are dropped.
    """
    merged: dict[str, Any] = {}
    if sampling_parameters is not None:
        merged = _json_object("sampling_parameters", sampling_parameters, max_bytes)
    extra = (_json_object("parameters", request_parameters, max_bytes)
             if request_parameters not in (None, "", b"") else {})
    for k, v in extra.items():
        if k in _RESERVED_PARAMS or k.startswith("triton_") or k in ("adapter_op", "lora_path"):
            continue
        if k in merged and merged[k] != v:
            raise RequestError(k, f"given both in sampling_parameters ({merged[k]!r}) "
                                  f"and as a request parameter ({v!r})")
        merged[k] = v
    return merged


def _json_object(name: str, raw: Any, max_bytes: int = 0) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    if max_bytes and isinstance(raw, (str, bytes)) and len(raw) > max_bytes:
        # len(str) <= its UTF-8 size: checked before decoding/parsing, so a huge JSON costs nothing
        unit = "bytes" if isinstance(raw, bytes) else "characters"
        raise RequestError(name, f"is {len(raw)} {unit} of JSON; the limit is {max_bytes} (max_parameters_bytes)")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(name, "must be UTF-8 encoded JSON") from None
    if not isinstance(raw, str):
        raise RequestError(name, f"must be a JSON object string, got {type(raw).__name__}")
    if not raw.strip():
        return {}
    obj = parse_json(name, raw)
    if not isinstance(obj, dict):
        raise RequestError(name, f"must be a JSON object, got {type(obj).__name__}")
    return obj


def build_sampling_params(raw: dict[str, Any], limits: Limits) -> tuple[SamplingParams, str | None, float | None]:
    """Convert and validate a merged parameter dict: (SamplingParams, lora_name, request_timeout_s)."""
    kwargs: dict[str, Any] = {}
    lora_name: str | None = None
    timeout: float | None = None
    allowed = sorted(set(_FIELD_KINDS) | set(_ONLY_DEFAULT) | _EXTRA_KEYS | set(_ALIASES))
    top_logprobs = None
    chat_logprobs = False
    for key, value in raw.items():
        if value is None:  # vllm_backend drops nulls so the defaults apply
            continue
        if key in _ALIASES:
            if _ALIASES[key] in raw and raw[_ALIASES[key]] is not None:
                raise RequestError(key, f"give either {key} or {_ALIASES[key]}, not both")
            kwargs[_ALIASES[key]] = _CONVERT[_FIELD_KINDS[_ALIASES[key]]](key, value)
        elif key == "top_logprobs":
            top_logprobs = to_int(key, value)
        elif key == "logprobs" and (isinstance(value, bool) or str(value).strip().lower() in ("true", "false")):
            # OpenAI chat sends a boolean: false = none, true = the top_logprobs count (Triton's OpenAI frontend)
            chat_logprobs = to_bool(key, value)
        elif key == "lora_name":
            if not isinstance(value, str):
                raise RequestError("lora_name", f"must be a string, got {value!r}")
            lora_name = value.strip() or None
        elif key == "request_timeout_s":
            timeout = to_float(key, value)
            if timeout <= 0 or (limits.max_request_timeout_s and timeout > limits.max_request_timeout_s):
                hi = f"{limits.max_request_timeout_s:g}" if limits.max_request_timeout_s else "inf"
                raise RequestError(key, f"must be a number of seconds in (0, {hi}], got {value!r}")
        elif key in _ONLY_DEFAULT:
            kind, ok = _ONLY_DEFAULT[key]
            v = _CONVERT[kind](key, value)
            if v not in ok:
                allowed_s = " or ".join(json.dumps(o) for o in ok) if ok else "null"
                raise RequestError(key, f"only {allowed_s} is supported, got {value!r}")
        elif key in _FIELD_KINDS:
            kwargs[key] = _CONVERT[_FIELD_KINDS[key]](key, value)
        else:
            raise RequestError(key, f"unknown sampling parameter; allowed: {', '.join(allowed)}")
    if chat_logprobs:
        kwargs["logprobs"] = top_logprobs or 0
    if kwargs.get("seed") == -1:  # vLLM: -1 means no seed
        kwargs.pop("seed")
    if kwargs.get("n", 1) > min(limits.max_n, MAX_N):
        raise RequestError("n", f"must be an integer in [1, {min(limits.max_n, MAX_N)}] on this server (max_n), "
                           f"got {kwargs['n']!r}")
    for key in ("stop", "stop_token_ids"):
        if len(kwargs.get(key, ())) > limits.max_stop_items:
            raise RequestError(key, f"has {len(kwargs[key])} entries; at most {limits.max_stop_items} are allowed "
                               f"(max_stop_items)")
    for item in kwargs.get("stop", ()):
        if len(item) > limits.max_stop_chars:
            raise RequestError("stop", f"a stop string has {len(item)} characters; at most {limits.max_stop_chars} "
                               f"are allowed (max_stop_chars)")
    if limits.max_tokens and "max_tokens" not in kwargs and limits.max_tokens < SamplingParams.max_tokens:
        kwargs["max_tokens"] = limits.max_tokens  # the default (16) is above this server's cap: use the cap
    if limits.max_tokens and kwargs.get("max_tokens", 16) > limits.max_tokens:
        raise RequestError("max_tokens", f"must be an integer in [1, {limits.max_tokens}] on this server, "
                           f"got {kwargs['max_tokens']!r}")
    params = SamplingParams(**kwargs)  # SamplingParamsError is a RequestError naming the field
    params.validate(max_logprobs=limits.max_logprobs)
    return params, lora_name, timeout


# ---------------------------------------------------------------- tensors

def _scalar(name: str, arr: Any) -> Any:
    try:
        flat = arr.reshape(-1)
    except AttributeError:
        return arr
    if flat.size != 1:
        raise RequestError(name, f"must hold exactly one element, got shape {list(arr.shape)}")
    return flat[0]


def _optional_bool(inputs: Mapping[str, Any], name: str) -> bool | None:
    arr = inputs.get(name)
    return None if arr is None else to_bool(name, _scalar(name, arr))


def parse_request(inputs: Mapping[str, Any], request_parameters: Any = None,
                  limits: Limits | None = None) -> ParsedRequest:
    """`inputs`: input name -> numpy array as received (absent inputs missing or None)."""
    limits = limits or Limits()
    sp = inputs.get("sampling_parameters")
    sp_raw = None if sp is None else _scalar("sampling_parameters", sp)
    merged = load_parameters(sp_raw, request_parameters, limits.max_parameters_bytes)
    params, lora_name, timeout = build_sampling_params(merged, limits)
    text_arr, ids_arr = inputs.get("text_input"), inputs.get("input_ids")
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    if text_arr is not None and ids_arr is not None:
        raise RequestError("input_ids", "send either text_input or input_ids, not both")
    if ids_arr is not None:
        if getattr(ids_arr, "dtype", None) is None or ids_arr.dtype.kind not in "iu":
            raise RequestError("input_ids", "must be an integer tensor (INT32 or INT64)")
        if params.truncate_prompt_tokens is not None:  # keep the last k (-1: as many as allowed) before converting
            k = params.truncate_prompt_tokens if params.truncate_prompt_tokens > 0 else limits.max_prompt_tokens
            if k:
                ids_arr = ids_arr.reshape(-1)[-k:]
        if limits.max_prompt_tokens and ids_arr.size > limits.max_prompt_tokens:
            raise RequestError("input_ids", f"has {ids_arr.size} tokens; the limit is {limits.max_prompt_tokens}")
        prompt_ids = [int(x) for x in ids_arr.reshape(-1)]
        if not prompt_ids:
            raise RequestError("input_ids", "must hold at least one token id")
        if min(prompt_ids) < 0:
            raise RequestError("input_ids", "token ids must be >= 0")
    elif text_arr is not None:
        raw = _scalar("text_input", text_arr)
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError("text_input", "must be UTF-8 text") from None
        if not isinstance(raw, str):
            raise RequestError("text_input", f"must be a string, got {type(raw).__name__}")
        if not raw:
            raise RequestError("text_input", "must be a non-empty string")
        if len(raw) > limits.max_prompt_chars:
            raise RequestError("text_input", f"is {len(raw)} characters long; the limit is {limits.max_prompt_chars}")
        prompt = raw
    else:
        raise RequestError("text_input", "is required (or input_ids with token ids)")

    stream = bool(_optional_bool(inputs, "stream"))
    exclude = _optional_bool(inputs, "exclude_input_in_output")
    if stream and exclude is False:
        raise RequestError("exclude_input_in_output",
                           "false is not allowed when streaming (the prompt is never streamed)")
    # vllm_backend: the prompt is prepended to non-streamed output unless excluded.
    exclude_input = True if stream else bool(exclude)

    returns = ReturnFlags(**{f: bool(_optional_bool(inputs, "return_" + f)) for f in ReturnFlags.__dataclass_fields__})
    if returns.cumulative_logprob:  # the engine computes logprobs only for requests that need them
        params.cumulative_logprob = True
    return ParsedRequest(prompt, prompt_ids, stream, exclude_input, params, lora_name, timeout, returns)


def parse_adapter_op(request_parameters: Any, max_bytes: int = 0) -> AdapterOp | None:
    """An adapter management request (`adapter_op` request parameter), or None for a generation request."""
    if request_parameters in (None, "", b""):
        return None
    params = _json_object("parameters", request_parameters, max_bytes)
    op = params.get("adapter_op")
    if op is None:
        return None
    if op not in ADAPTER_OPS:
        raise RequestError("adapter_op", f"must be one of {', '.join(ADAPTER_OPS)}, got {op!r}")
    name, path = params.get("lora_name"), params.get("lora_path")
    if op not in ("list", "info") and (not isinstance(name, str) or not name.strip()):
        raise RequestError("lora_name", f"is required for adapter_op {op!r}")
    if path is not None and (not isinstance(path, str) or not path):
        raise RequestError("lora_path", "must be a directory path")
    return AdapterOp(op, name.strip() if isinstance(name, str) else None, path)
