"""vLLM's sampling parameters through a real tritonserver, as vllm_backend clients send them, each against an
independent computation: transformers (float32) for logit_bias, allowed_token_ids, bad_words,
truncate_prompt_tokens and prompt_logprobs; a JSON-schema validator / the regex / the choice list for structured
outputs; single seeded requests for n; the tokenizer's own decode for spaces_between_special_tokens."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from harness.triton_client import make_inputs
from loom.engine.sample.logits_processors import bad_words_token_ids
from tests.e2e.compat.conftest import Client, streamed_texts, texts

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    c = Client(server)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def ids_request(client, ids, **params):
    res, err = client.run(make_inputs(None, params, stream=False, input_ids=ids, exclude_input_in_output=True))
    assert err is None, err
    return res[-1]


# ------------------------------------------------------------------ n


def test_n_answers_like_vllm_backend_one_response_with_n_texts(client):
    """vllm_backend's n test, in our words: n=2 at temperature 1 (strings, as its clients send them), not streamed:
    one response, n texts each with the prompt in front; each completion is the single request with seed + i."""
    params = {"n": "2", "temperature": "1", "top_p": "1", "seed": "21", "max_tokens": "8"}
    res, err = client.run(make_inputs(PROMPT, params, stream=False, return_finish_reason=True,
                                      return_num_output_tokens=True), parameters=params)
    assert err is None, err
    assert len(res) == 1
    out = texts(res[0])
    assert len(out) == 2 and all(t.startswith(PROMPT) for t in out)
    assert [r.decode() for r in res[0].as_numpy("finish_reason")] == ["length", "length"]
    assert res[0].as_numpy("num_output_tokens").tolist() == [8, 8]
    for i in range(2):
        single, err = client.run(make_inputs(PROMPT, {"temperature": 1, "seed": 21 + i, "max_tokens": 8}, stream=False))
        assert err is None and texts(single[0]) == [out[i]]


def test_n_streamed_deltas_per_index(client):
    params = {"n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 10, "ignore_eos": True}
    streamed, err = client.run(make_inputs(PROMPT, params, stream=True, return_finish_reason=True,
                                           return_num_output_tokens=True))
    assert err is None, err
    assert len(streamed) > 1 and all(len(texts(r)) == 3 for r in streamed)
    whole, err = client.run(make_inputs(PROMPT, params, stream=False, exclude_input_in_output=True))
    assert err is None
    assert streamed_texts(streamed) == texts(whole[0])
    counts = sum(r.as_numpy("num_output_tokens").astype(int) for r in streamed)
    assert counts.tolist() == [10, 10, 10]
    assert [r.decode() for r in streamed[-1].as_numpy("finish_reason")] == ["length"] * 3
    assert all(x == b"None" for r in streamed[:-1] for x in r.as_numpy("finish_reason"))


# ------------------------------------------------------------------ structured outputs

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}


@pytest.mark.parametrize("lora", [None, "alpha"])
def test_json_schema_outputs_parse_greedy_and_seeded(client, lora):
    so = json.dumps({"json": PERSON, "disable_any_whitespace": True})  # vllm_backend: a JSON string in the JSON
    runs = [dict(temperature=0), dict(temperature=1.0, seed=3, n=2)]
    for extra in runs:
        params = {"max_tokens": 64, "structured_outputs": so, **extra, **({"lora_name": lora} if lora else {})}
        res, err = client.run(make_inputs("Describe a person as JSON: ", params, stream=False,
                                          exclude_input_in_output=True, return_finish_reason=True))
        assert err is None, err
        for text, reason in zip(texts(res[0]), res[0].as_numpy("finish_reason")):
            assert reason == b"stop", (text, reason)
            jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_grammar_and_guided_decoding(client):
    def one(so_key, so, **extra):
        params = {"max_tokens": 24, "temperature": 1.0, "seed": 8, "n": 2, so_key: json.dumps(so), **extra}
        res, err = client.run(make_inputs("Answer: ", params, stream=False, exclude_input_in_output=True))
        assert err is None, err
        return texts(res[0])

    for t in one("structured_outputs", {"regex": r"[0-9]{3}-[a-z]{2,4}"}):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t), t
    for t in one("structured_outputs", {"choice": ["Positive", "Negative"]}, lora_name="beta"):
        assert t in ("Positive", "Negative"), t
    for t in one("structured_outputs", {"grammar": 'root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'}):
        assert re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", t), t
    # older clients (and Triton's OpenAI frontend): guided_decoding, every field present, unset ones null
    old = {"json": None, "regex": r"(yes|no)!", "choice": None, "grammar": None, "json_object": None,
           "backend": None, "whitespace_pattern": None}
    for t in one("guided_decoding", old):
        assert t in ("yes!", "no!"), t


def test_invalid_grammar_is_refused_naming_the_field(client):
    res, err = client.run(make_inputs(PROMPT, {"structured_outputs": json.dumps({"regex": "[unclosed"})}))
    assert err is not None and "structured_outputs: invalid regex" in str(err), err


# ------------------------------------------------------------------ token-level parameters vs transformers


def test_logit_bias_against_transformers(client, hf):
    model, tok = hf
    ids = tok.encode(PROMPT, add_special_tokens=False)
    last = hf_logits(model, ids)[-1]
    top = int(last.argmax())
    bias = {str(top): -100, "3300": 7.5}
    out = ids_request(client, ids, max_tokens=1, temperature=0, logit_bias=bias)
    want = last.clone()
    want[top] -= 100
    want[3300] += 7.5
    assert out.as_numpy("output_ids").tolist() == [int(want.argmax())]


def test_allowed_token_ids_against_transformers(client, hf):
    model, tok = hf
    ids = tok.encode(PROMPT, add_special_tokens=False)
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0] for w in (" Paris", " London", " the", ".", " a")})
    got = ids_request(client, ids, max_tokens=3, temperature=0, allowed_token_ids=allowed).as_numpy("output_ids")
    seq, want = list(ids), []
    for _ in range(3):  # greedy restricted to the allowed ids, one forward per token
        logits = hf_logits(model, seq)[-1]
        t = allowed[int(logits[allowed].argmax())]
        want.append(t)
        seq.append(t)
    assert got.tolist() == want


def test_bad_words_against_transformers(client, hf):
    model, tok = hf
    ids = tok.encode(PROMPT, add_special_tokens=False)
    first = int(hf_logits(model, ids)[-1].argmax())
    word = tok.decode([first]).strip()  # the word greedy decoding starts with
    banned = [w[-1] for w in bad_words_token_ids(tok, [word]) if len(w) == 1]
    assert first in banned
    logits = hf_logits(model, ids)[-1]
    logits[banned] = float("-inf")
    got = ids_request(client, ids, max_tokens=1, temperature=0, bad_words=[word]).as_numpy("output_ids").tolist()
    assert got == [int(logits.argmax())]


def test_truncate_prompt_tokens_against_transformers(client, hf):
    model, tok = hf
    ids = tok.encode("A long preamble that will be cut away. " + PROMPT, add_special_tokens=False)
    k = len(tok.encode(PROMPT, add_special_tokens=False))
    with torch.no_grad():
        want = model.generate(torch.tensor([ids[-k:]]), max_new_tokens=5, do_sample=False,
                              attention_mask=torch.ones(1, k, dtype=torch.long), pad_token_id=0)[0, k:].tolist()
    res, err = client.run(make_inputs("A long preamble that will be cut away. " + PROMPT,
                                      {"max_tokens": 5, "temperature": 0, "truncate_prompt_tokens": k,
                                       "ignore_eos": True},
                                      stream=False, exclude_input_in_output=True, return_num_input_tokens=True))
    assert err is None, err
    assert int(res[0].as_numpy("num_input_tokens")[0]) == k
    assert texts(res[0]) == [tok.decode(want)]


def test_prompt_logprobs_against_transformers(client, hf):
    model, tok = hf
    ids = tok.encode(PROMPT, add_special_tokens=False)
    res, err = client.run(make_inputs(PROMPT, {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
                                      stream=True))
    assert err is None, err
    sent = [r.as_numpy("prompt_logprobs") for r in res]
    assert sent[0] is not None and all(s is None for s in sent[1:])  # once, with the first token
    plp = json.loads(sent[0][0])
    lp = torch.log_softmax(hf_logits(model, ids), -1)
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        entry, row = plp[j], lp[j - 1]
        mine = entry[str(ids[j])]
        assert mine["logprob"] == pytest.approx(row[ids[j]].item(), abs=1e-4)
        assert mine["rank"] == int((row >= row[ids[j]]).sum())
        assert mine["decoded_token"] == tok.decode([ids[j]])
        top = row.topk(2).indices.tolist()
        assert all(str(t) in entry for t in top)


def test_spaces_between_special_tokens_is_the_tokenizers_decode(client, hf):
    _, tok = hf
    specials = sorted(tok.all_special_ids)[:3]
    allowed = specials + [tok.encode(" hi", add_special_tokens=False)[0]]
    ids = tok.encode(PROMPT, add_special_tokens=False)
    for spaces in (False, True):
        out = ids_request(client, ids, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True,
                          allowed_token_ids=allowed, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        got_ids = out.as_numpy("output_ids").tolist()
        assert texts(out) == [tok.decode(got_ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)]
