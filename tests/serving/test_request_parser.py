"""The request parser: vllm_backend compatibility and the bad-input matrix (every refusal names its field)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from loom.errors import RequestError
from loom.serving.request_parser import Limits, parse_adapter_op, parse_request


def T(s):  # a TYPE_STRING tensor as the Python backend hands it over
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


def B(v):
    return np.array([v], dtype=bool)


def req(text="hi", sp=None, params=None, limits=None, **inputs):
    d = {"text_input": T(text) if text is not None else None}
    if sp is not None:
        d["sampling_parameters"] = T(sp if isinstance(sp, str) else json.dumps(sp))
    d.update(inputs)
    return parse_request(d, params, limits)


def refused(field, *a, **kw):
    with pytest.raises(RequestError) as ei:
        req(*a, **kw)
    assert ei.value.field == field, str(ei.value)
    return str(ei.value)


def test_defaults_match_vllm_backend():
    r = req()
    assert r.prompt == "hi" and not r.stream and r.params.max_tokens == 16
    assert r.exclude_input_in_output is False  # prompt prepended when not streaming
    assert req(stream=B(True)).exclude_input_in_output is True
    assert req(exclude_input_in_output=B(True)).exclude_input_in_output is True


def test_genai_perf_strings_are_converted_by_type():
    r = req(sp={"max_tokens": "32", "temperature": "0", "top_p": "0.5", "ignore_eos": "false", "seed": "7",
                "stop": "\n", "logprobs": "2", "skip_special_tokens": "true"})
    p = r.params
    assert ((p.max_tokens, p.temperature, p.top_p, p.ignore_eos, p.seed, p.stop, p.logprobs)
            == (32, 0.0, 0.5, False, 7, ["\n"], 2))
    assert req(sp={"ignore_eos": "true"}).params.ignore_eos is True
    assert req(sp={"ignore_eos": "FALSE"}).params.ignore_eos is False
    assert req(sp={"temperature": "1.5"}).params.temperature == 1.5
    assert req(sp={"max_tokens": 8.0}).params.max_tokens == 8
    assert req(sp={"max_tokens": None}).params.max_tokens == 16
    assert req(sp={"top_k": -1}).params.top_k == 0


def test_vllm_names_and_lists():
    r = req(sp={"n": 1, "best_of": 1, "stop": ["a", "b"], "stop_token_ids": [1, 2], "lora_name": "pirate",
                "prompt_logprobs": None, "use_beam_search": False})
    assert r.params.stop == ["a", "b"] and r.params.stop_token_ids == [1, 2] and r.lora_name == "pirate"
    # lists arriving as request parameters (scalars only) are JSON text
    r = req(sp=None, params=json.dumps({"stop": '["x", "y"]', "stop_token_ids": "3,4", "max_tokens": 4}))
    assert r.params.stop == ["x", "y"] and r.params.stop_token_ids == [3, 4] and r.params.max_tokens == 4


def test_request_parameters_instead_of_tensor():
    r = req(params={"max_tokens": 3, "temperature": 0, "lora_name": "a", "priority": 0,
                    "triton_enable_empty_final_response": True})
    assert r.params.max_tokens == 3 and r.params.temperature == 0 and r.lora_name == "a"
    assert req(sp={"max_tokens": 3}, params={"max_tokens": 3}).params.max_tokens == 3
    refused("max_tokens", sp={"max_tokens": 3}, params={"max_tokens": 4})


def test_input_ids_mode():
    r = parse_request({"input_ids": np.array([1, 2, 3], dtype=np.int32)})
    assert r.ids_mode and r.prompt_token_ids == [1, 2, 3] and r.prompt is None
    with pytest.raises(RequestError, match="input_ids"):
        parse_request({"input_ids": np.array([], dtype=np.int64)})
    with pytest.raises(RequestError, match="input_ids"):
        parse_request({"input_ids": np.array([1.5], dtype=np.float32)})
    with pytest.raises(RequestError, match="input_ids"):
        parse_request({"input_ids": np.array([-1], dtype=np.int64)})
    with pytest.raises(RequestError, match="either"):
        parse_request({"text_input": T("a"), "input_ids": np.array([1], dtype=np.int64)})


def test_return_flags():
    r = req(return_finish_reason=B(True), return_logprobs=B(True), return_num_output_tokens=B(False))
    assert r.returns.finish_reason and r.returns.logprobs and not r.returns.num_output_tokens
    assert not r.returns.cumulative_logprob and not r.returns.num_input_tokens


@pytest.mark.parametrize("kw, field, words", [
    (dict(sp="{not json"), "sampling_parameters", "valid JSON"),
    (dict(sp="[1, 2]"), "sampling_parameters", "object"),
    (dict(sp={"max_tokens": "abc"}), "max_tokens", "integer"),
    (dict(sp={"max_tokens": "1.5"}), "max_tokens", "integer"),
    (dict(sp={"max_tokens": True}), "max_tokens", "integer"),
    (dict(sp={"max_tokens": -1}), "max_tokens", ">= 1"),
    (dict(sp={"max_tokens": 0}), "max_tokens", ">= 1"),
    (dict(sp={"max_tokens": 10**9}, limits=Limits(max_tokens=4096)), "max_tokens", "4096"),
    (dict(sp={"temperature": -0.1}), "temperature", "[0, 100]"),
    (dict(sp={"temperature": "hot"}), "temperature", "number"),
    (dict(sp={"temperature": "nan"}), "temperature", "finite"),
    (dict(sp={"temperature": 1e309}), "temperature", "finite"),
    (dict(sp={"top_p": 0}), "top_p", "(0, 1]"),
    (dict(sp={"top_p": 1.5}), "top_p", "(0, 1]"),
    (dict(sp={"top_k": -5}), "top_k", "positive"),
    (dict(sp={"min_p": 2}), "min_p", "[0, 1]"),
    (dict(sp={"repetition_penalty": 0}), "repetition_penalty", "(0, 10]"),
    (dict(sp={"presence_penalty": 5}), "presence_penalty", "[-2, 2]"),
    (dict(sp={"frequency_penalty": -3}), "frequency_penalty", "[-2, 2]"),
    (dict(sp={"seed": -2}), "seed", "2^63"),
    (dict(sp={"seed": 2**64}), "seed", "2^63"),
    (dict(sp={"ignore_eos": "maybe"}), "ignore_eos", "boolean"),
    (dict(sp={"ignore_eos": 2}), "ignore_eos", "boolean"),
    (dict(sp={"logprobs": 1000}), "logprobs", "[0, 20]"),
    (dict(sp={"logprobs": -1}), "logprobs", "[0, 20]"),
    (dict(sp={"stop": 5}), "stop", "string"),
    (dict(sp={"stop": [""]}), "stop", "non-empty"),
    (dict(sp={"stop": ["x"] * 50}), "stop", "at most 16"),
    (dict(sp={"stop_token_ids": ["a"]}), "stop_token_ids", "integer"),
    (dict(sp={"min_tokens": 20, "max_tokens": 10}), "min_tokens", "max_tokens=10"),
    (dict(sp={"n": 2, "temperature": 0}), "n", "greedy"),
    (dict(sp={"n": 17}), "n", "max_n"),
    (dict(sp={"n": 0}), "n", "[1, 64]"),
    (dict(sp={"best_of": 3}), "best_of", "only 1"),
    (dict(sp={"use_beam_search": True}), "use_beam_search", "only false"),
    (dict(sp={"prompt_logprobs": 21}), "prompt_logprobs", "[0, 20]"),
    (dict(sp={"logit_bias": {"x": 1}}), "logit_bias", "token ids"),
    (dict(sp={"logit_bias": {"5": "nan"}}), "logit_bias", "finite"),
    (dict(sp={"logit_bias": [1, 2]}), "logit_bias", "object"),
    (dict(sp={"allowed_token_ids": []}), "allowed_token_ids", "non-empty"),
    (dict(sp={"allowed_token_ids": [-1]}), "allowed_token_ids", "non-negative"),
    (dict(sp={"bad_words": [" "]}), "bad_words", "non-blank"),
    (dict(sp={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens", "-1 or an integer >= 1"),
    (dict(sp={"spaces_between_special_tokens": "x"}), "spaces_between_special_tokens", "boolean"),
    (dict(sp={"structured_outputs": "{"}), "structured_outputs", "valid JSON"),
    (dict(sp={"structured_outputs": {}}), "structured_outputs", "exactly one"),
    (dict(sp={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
    (dict(sp={"structured_outputs": {"choice": []}}), "structured_outputs", "choice"),
    (dict(sp={"structured_outputs": {"json": "{not"}}), "structured_outputs", "JSON schema"),
    (dict(sp={"structured_outputs": {"regex": "a", "color": 1}}), "structured_outputs", "unknown key 'color'"),
    (dict(sp={"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}), "structured_outputs",
     "disable_any_whitespace"),
    (dict(sp={"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}), "guided_decoding", "not both"),
    (dict(sp={"guided_decoding": "[]"}), "guided_decoding", "JSON object"),
    (dict(sp={"bogus_key": 1}), "bogus_key", "unknown sampling parameter; allowed: allowed_token_ids"),
    (dict(sp={"lora_name": 5}), "lora_name", "string"),
    (dict(sp={"request_timeout_s": 0}), "request_timeout_s", "seconds"),
    (dict(text=""), "text_input", "non-empty"),
    (dict(text=None), "text_input", "required"),
    (dict(text=b"\xff\xfe"), "text_input", "UTF-8"),
    (dict(text="x" * 100, limits=Limits(max_prompt_chars=10)), "text_input", "limit is 10"),
    (dict(stream=B(True), exclude_input_in_output=B(False)), "exclude_input_in_output", "streaming"),
    (dict(stream=np.array([True, False])), "stream", "exactly one"),
    (dict(stream=T("perhaps")), "stream", "boolean"),
])
def test_bad_input_matrix(kw, field, words):
    msg = refused(field, **kw)
    assert words in msg, msg


def test_false_strings_are_false_everywhere():
    r = req(stream=T("false"), return_logprobs=T("false"), sp={"ignore_eos": "false", "skip_special_tokens": "False"})
    assert not r.stream and not r.returns.logprobs and not r.params.ignore_eos and not r.params.skip_special_tokens


def test_adapter_ops():
    assert parse_adapter_op(None) is None
    assert parse_adapter_op(json.dumps({"max_tokens": 3})) is None
    op = parse_adapter_op(json.dumps({"adapter_op": "load", "lora_name": "pirate"}))
    assert (op.op, op.name, op.path) == ("load", "pirate", None)
    assert parse_adapter_op({"adapter_op": "list"}).op == "list"
    with pytest.raises(RequestError, match="adapter_op"):
        parse_adapter_op({"adapter_op": "explode"})
    with pytest.raises(RequestError, match="lora_name"):
        parse_adapter_op({"adapter_op": "unload"})



DEEP = 10_000


@pytest.mark.parametrize("where, text", [
    ("sampling_parameters", '{"a":' * DEEP + "1" + "}" * DEEP),
    ("sampling_parameters", '{"max_tokens": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("sampling_parameters", '{"stop": ' + "[" * DEEP),  # unterminated as well as deep
    ("parameters", '{"stop": "' + "[" * DEEP + "]" * DEEP + '"}'),  # a list sent as JSON text in a request parameter
    ("parameters", '{"x": ' + "[{" * DEEP + "}]" * DEEP + "}"),
])
def test_deep_json_refused_before_parsing(where, text):
    """Any nesting beyond the bound is refused with the field named, never a RecursionError."""
    limits = Limits(max_parameters_bytes=1 << 20)
    kw = ({"sp": text} if where == "sampling_parameters"
          else {"params": json.loads(text) if text.count("[") < 100 else text})
    with pytest.raises(RequestError) as ei:
        req(limits=limits, **kw)
    field = "stop" if "stop" in text and where == "parameters" else where
    assert ei.value.field == field and "nested" in str(ei.value), str(ei.value)
    with pytest.raises(RequestError) as ei:
        parse_adapter_op(text if where == "parameters" and "stop" not in text else '{"adapter_op":' + "[" * DEEP,
                         1 << 20)
    assert "nested" in str(ei.value)


def test_nesting_inside_strings_and_at_the_bound_is_fine():
    brackets = "[" * 100 + "{" * 100
    assert req(sp={"stop": [brackets], "max_tokens": 3}).params.stop == [brackets]
    nested = {"a": 1}
    for _ in range(30):
        nested = {"a": nested}
    with pytest.raises(RequestError) as ei:  # parsed (31 levels are allowed), then refused as an unknown key
        req(sp=nested)
    assert ei.value.field == "a"


def test_vllm_parameters_with_their_meaning():
    p = req(sp={"n": "3", "logit_bias": {"7": 250, "9": -0.5}, "allowed_token_ids": [1, 2, 2], "bad_words": ["x", "x"],
                "truncate_prompt_tokens": 4, "spaces_between_special_tokens": "false", "prompt_logprobs": 2}).params
    assert p.n == 3 and p.logit_bias == {7: 100.0, 9: -0.5}  # vLLM clamps biases to [-100, 100]
    assert p.allowed_token_ids == [1, 2, 2] and p.bad_words == ["x"] and p.truncate_prompt_tokens == 4
    assert p.spaces_between_special_tokens is False and p.prompt_logprobs == 2
    # request parameters carry only scalars: the bias comes as JSON text there
    assert req(sp=None, params=json.dumps({"logit_bias": '{"5": 1}'})).params.logit_bias == {5: 1.0}


def test_structured_outputs_as_vllm_backend_and_older_clients_send_them():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    # vllm_backend: a JSON string inside sampling_parameters
    so = req(sp={"structured_outputs": json.dumps({"json": schema})}).params.structured_outputs
    assert so.kind == "json" and json.loads(so.schema_text()) == schema
    assert req(sp={"structured_outputs": {"choice": ["yes", "no"]}}).params.structured_outputs.choice == ("yes", "no")
    # guided_decoding (older vLLM; Triton's OpenAI frontend sends every field, unset ones as null, and backend)
    old = {"json": None, "regex": "[0-9]+", "choice": None, "grammar": None, "json_object": None,
           "backend": "xgrammar", "whitespace_pattern": None}
    so = req(sp={"guided_decoding": json.dumps(old)}).params.structured_outputs
    assert so.kind == "regex" and so.regex == "[0-9]+"


def test_openai_frontend_chat_logprobs_and_seed():
    assert req(sp={"logprobs": True, "top_logprobs": 3}).params.logprobs == 3
    assert req(sp={"logprobs": False, "top_logprobs": 3}).params.logprobs is None
    assert req(sp={"logprobs": "true"}).params.logprobs == 0
    assert req(sp={"logprobs": "2"}).params.logprobs == 2
    assert req(sp={"seed": -1}).params.seed is None  # vLLM: -1 = no seed


def test_truncate_prompt_tokens_cuts_input_ids_before_the_length_check():
    ids = np.arange(1, 101, dtype=np.int32)
    r = req(text=None, input_ids=ids, sp={"truncate_prompt_tokens": 5}, limits=Limits(max_prompt_tokens=10))
    assert r.prompt_token_ids == [96, 97, 98, 99, 100]
    r = req(text=None, input_ids=ids, sp={"truncate_prompt_tokens": -1}, limits=Limits(max_prompt_tokens=10))
    assert r.prompt_token_ids == list(range(91, 101))
    refused("input_ids", text=None, input_ids=ids, limits=Limits(max_prompt_tokens=10))
