"""Request bounds, configured in config.pbtxt (the `loom_limits` model, conftest.LIMITS), each refused with an
error naming the field; a prompt larger than the whole KV cache is refused up front; the model keeps serving.
Plus the config side: each bound is a parameter with a default, and out-of-range values stop the load."""
from __future__ import annotations

import json
import time

import pytest

from loom.errors import ConfigError
from loom.serving.serve_config import parse_model_parameters
from tests.reliability.conftest import LIMITS, LIMITS_MODEL, Stream


def _inputs(prompt="Hello", params=None, **kw):
    from harness.triton_client import make_inputs
    return make_inputs(prompt, params, **kw)


CASES = [  # (id, inputs kwargs, request parameters, expected start of the error)
    ("prompt_chars", dict(prompt="x" * 301), None, "text_input: is 301 characters long; the limit is 300"),
    ("prompt_tokens_text", dict(prompt="a " * 60), None, "prompt: has"),
    ("prompt_tokens_ids", dict(prompt=None, input_ids=list(range(100, 145))), None,
     "input_ids: has 45 tokens; the limit is 40"),
    ("max_tokens", dict(params={"max_tokens": 9}), None, "max_tokens: must be an integer in [1, 8] on this server"),
    ("logprobs", dict(params={"logprobs": 3}), None, "logprobs: must be an integer in [0, 2]"),
    ("stop_items", dict(params={"stop": ["a", "b", "c"]}), None, "stop: has 3 entries; at most 2 are allowed"),
    ("stop_token_ids", dict(params={"stop_token_ids": [5, 6, 7]}), None,
     "stop_token_ids: has 3 entries; at most 2 are allowed"),
    ("stop_chars", dict(params={"stop": ["123456789"]}), None, "stop: a stop string has 9 characters; at most 8"),
    ("json_size", dict(params={"max_tokens": 4, "seed": 1, "stop": ["ab"], "temperature": 0.5, "top_p": 0.9,
                               "min_p": 0.0, "lora_name": None, "pad": None, **{f"k{i}": None for i in range(60)}}),
     None, "sampling_parameters: is"),
    ("request_params_size", dict(params={"max_tokens": 4}), {"stop": "x" * 600}, "parameters: is"),
    ("request_timeout", dict(params={"request_timeout_s": 10}), None,
     "request_timeout_s: must be a number of seconds in (0, 5]"),
    ("kv_budget", dict(prompt=None, input_ids=list(range(100, 135))), None,
     "prompt: has 35 tokens but the whole KV cache holds 32; raise kv_cache_memory_bytes"),
]


@pytest.fixture(scope="module")
def limited(server):
    s = Stream(server, model=LIMITS_MODEL)
    yield s
    s.close()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_bound_is_refused_with_a_named_error(limited, case):
    _, kw, req_params, expect = case
    t0 = time.monotonic()
    text, err, _ = limited.request(_inputs(**kw), req_params, timeout=60)
    assert err is not None, f"accepted: {text!r}"
    assert err.startswith(expect), err
    assert time.monotonic() - t0 < 10, "a refusal must be immediate"


def test_within_bounds_is_served_after_all_refusals(limited):
    # 20 prompt tokens + 8 generated fit the 32-token cache; asked for more, it ends by length at the cap
    text, err, _ = limited.request(_inputs(None, {"max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                                  "logprobs": 2, "stop": ["zz"]}, input_ids=list(range(100, 120))))
    assert err is None and text
    info, err = limited.adapter_op("info")
    assert err is None and info["result"]["kv_blocks_total"] == 2 and info["result"]["kv_blocks_used"] == 0


def test_bounds_are_config_keys_with_defaults_and_ranges():
    cfg = parse_model_parameters({}, "/tmp")
    lim = cfg.limits
    assert (lim.max_logprobs, lim.max_stop_items, lim.max_stop_chars, lim.max_parameters_bytes, lim.max_prompt_chars,
            lim.max_tokens) == (20, 16, 256, 65536, 1 << 20, 0)
    assert cfg.options.shutdown_timeout_s == 10.0
    cfg = parse_model_parameters({k: {"string_value": v} for k, v in LIMITS.items()}, "/tmp")
    lim = cfg.limits
    assert (lim.max_logprobs, lim.max_stop_items, lim.max_stop_chars, lim.max_parameters_bytes, lim.max_prompt_chars,
            lim.max_tokens, lim.max_request_timeout_s) == (2, 2, 8, 512, 300, 8, 5.0)
    assert cfg.engine.max_prompt_tokens == 40
    for key, bad in (("max_logprobs", "21"), ("max_stop_items", "17"), ("max_stop_chars", "0"),
                     ("max_stop_chars", "257"), ("max_parameters_bytes", "10"), ("shutdown_timeout_s", "0"),
                     ("max_prompt_chars", "0"), ("max_tokens_limit", "-1")):
        with pytest.raises(ConfigError) as ei:
            parse_model_parameters({key: {"string_value": bad}}, "/tmp")
        assert ei.value.field == key


def test_oversized_json_is_refused_before_it_is_parsed():
    from loom.errors import RequestError
    from loom.serving.request_parser import Limits, load_parameters

    huge = "[" * 10 ** 6  # would be slow (or recurse deeply) to parse
    t0 = time.monotonic()
    with pytest.raises(RequestError) as ei:
        load_parameters(huge.encode(), None, Limits().max_parameters_bytes)
    assert ei.value.field == "sampling_parameters" and time.monotonic() - t0 < 0.1
    with pytest.raises(RequestError) as ei:
        load_parameters(None, json.dumps({"stop": "x" * 70000}), Limits().max_parameters_bytes)
    assert ei.value.field == "parameters"
