"""vllm_backend's response outputs from deltas (loom.serving.responses), checked field by field."""
from __future__ import annotations

import json

import numpy as np

from loom.engine.outputs import TokenLogprob
from loom.serving.deltas import RequestDelta
from loom.serving.request_parser import parse_request
from loom.serving.responses import ResponseBuilder, ResponseState


class _Decoder:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _state(sp: dict, **inputs) -> ResponseState:
    d = {"text_input": np.array([b"hello"], dtype=np.object_),
         "sampling_parameters": np.array([json.dumps(sp).encode()], dtype=np.object_)}
    d.update({k: np.array([v], dtype=bool) for k, v in inputs.items()})
    return ResponseState(parse_request(d), [7, 8])


def test_n_completions_in_index_order_with_reasons_counts_and_cumulative():
    st = _state({"n": 2, "temperature": 1.0, "seed": 1}, stream=True, return_finish_reason=True,
                return_num_output_tokens=True, return_cumulative_logprob=True, return_num_input_tokens=True)
    b = ResponseBuilder(_Decoder())
    out = dict(b.outputs(st, [RequestDelta("r", text="B", token_ids=[5, 6], index=1, cumulative_logprob=-1.5,
                                           num_prompt_tokens=2)]))
    assert list(out["text_output"]) == [b"", b"B"]  # completion 0 sent nothing yet: an empty element
    assert list(out["num_output_tokens"]) == [0, 2] and list(out["num_input_tokens"]) == [2]
    assert list(out["finish_reason"]) == [b"None", b"None"]
    assert out["cumulative_logprob"].tolist() == [0.0, -1.5]
    out = dict(b.outputs(st, [RequestDelta("r", text="A", token_ids=[3], index=0, finish_reason="length",
                                           cumulative_logprob=-0.25)]))
    assert list(out["text_output"]) == [b"A", b""]
    assert list(out["finish_reason"]) == [b"length", b"None"]  # reasons are remembered per completion
    assert out["cumulative_logprob"].tolist() == [-0.25, -1.5]
    assert "output_ids" not in out and "logprobs" not in out and "prompt_logprobs" not in out


def test_whole_text_carries_the_prompt_unless_excluded():
    b = ResponseBuilder(_Decoder())
    st = _state({}, stream=False, exclude_input_in_output=False)
    assert dict(b.outputs(st, [RequestDelta("r", text=" world")]))["text_output"].tolist() == [b"hello world"]
    st = _state({}, stream=False, exclude_input_in_output=True)
    assert dict(b.outputs(st, [RequestDelta("r", text=" world")]))["text_output"].tolist() == [b" world"]


def test_logprobs_json_ranks_the_sampled_token_outside_the_top_n():
    b = ResponseBuilder(_Decoder())
    top = [(1, -0.1), (2, -0.5)]
    got = json.loads(b.logprobs_json([TokenLogprob(2, -0.5, top), TokenLogprob(9, -0.3, top)]))
    assert got[0] == {"1": {"logprob": -0.1, "rank": 1, "decoded_token": "<1>"},
                      "2": {"logprob": -0.5, "rank": 2, "decoded_token": "<2>"}}
    # token 9 is not in the top-2 but beats token 2: its rank is 1 + the top entries above it
    assert list(got[1]) == ["9", "1", "2"] and got[1]["9"] == {"logprob": -0.3, "rank": 2, "decoded_token": "<9>"}
    assert b.logprobs_json(None) == "null"


def test_prompt_logprobs_json_first_token_null_and_exact_rank():
    b = ResponseBuilder(_Decoder())
    got = json.loads(b.prompt_logprobs_json([None, TokenLogprob(4, -2.0, [(3, -0.2), (4, -2.0)], rank=2)]))
    assert got[0] is None
    assert got[1] == {"4": {"logprob": -2.0, "rank": 2, "decoded_token": "<4>"},
                      "3": {"logprob": -0.2, "rank": 1, "decoded_token": "<3>"}}
