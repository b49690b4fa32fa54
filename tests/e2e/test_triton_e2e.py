"""The loom backend on a real tritonserver, over tritonclient gRPC streaming (and HTTP generate_stream)."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from loom.engine.sampling_params import SamplingParams
from tests.e2e.conftest import Stream, make_inputs, metric, scrape, text_of, wait_for

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "In 1969, astronauts", "Water boils at", "My favourite colour is", "The quick brown fox"]
GREEDY = {"max_tokens": 16, "temperature": 0}


def offline_text(offline, prompt, max_tokens=16, lora=None, **kw):
    out = offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **kw), lora_names=[lora])[0]
    return out


@pytest.fixture
def stream(server):
    s = Stream(server)
    yield s
    s.close()


def test_greedy_stream_equals_offline(stream, offline):
    rid = stream.send(make_inputs(PROMPTS[0], GREEDY))
    results, err = stream.collect(rid)
    assert err is None
    assert len(results) > 1  # streamed, not one blob
    assert text_of(results) == offline_text(offline, PROMPTS[0]).text


def test_16_concurrent_streams_with_adapters(stream, offline):
    loras = [None, "alpha", "beta", None]
    jobs = [(PROMPTS[i % len(PROMPTS)], loras[i % len(loras)]) for i in range(16)]
    rids = []
    for prompt, lora in jobs:
        params = dict(GREEDY, **({"lora_name": lora} if lora else {}))
        rids.append(stream.send(make_inputs(prompt, params)))
    got = {}
    for rid in rids:
        results, err = stream.collect(rid, timeout=300)
        assert err is None, err
        got[rid] = text_of(results)
    expect = offline.generate([p for p, _ in jobs], SamplingParams(max_tokens=16, temperature=0),
                              lora_names=[l for _, l in jobs])
    for rid, e, (p, l) in zip(rids, expect, jobs):
        assert got[rid] == e.text, (p, l)
    # the adapters visibly change the text
    assert len({got[rids[i]] for i in (0, 1, 2)}) == 3


def test_non_streaming_prepends_prompt_unless_excluded(stream, offline):
    ref = offline_text(offline, PROMPTS[1]).text
    results, err = stream.collect(stream.send(make_inputs(PROMPTS[1], GREEDY, stream=False)))
    assert err is None and len(results) == 1 and text_of(results) == PROMPTS[1] + ref
    results, err = stream.collect(
        stream.send(make_inputs(PROMPTS[1], GREEDY, stream=False, exclude_input_in_output=True)))
    assert err is None and len(results) == 1 and text_of(results) == ref


def test_every_return_flag_and_logprobs(stream, offline):
    ref = offline_text(offline, PROMPTS[2], max_tokens=8, logprobs=2)
    flags = {f"return_{f}": True for f in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                                          "num_output_tokens")}
    rid = stream.send(make_inputs(PROMPTS[2], {"max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True},
                                  **flags))
    results, err = stream.collect(rid)
    assert err is None
    n_out = sum(int(r.as_numpy("num_output_tokens")[0]) for r in results)
    assert n_out == 8
    assert int(results[-1].as_numpy("num_input_tokens")[0]) == len(ref.prompt_token_ids)
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
    assert reasons[-1] == "length" and all(x == "None" for x in reasons[:-1])
    assert results[-1].as_numpy("cumulative_logprob")[0] == pytest.approx(ref.cumulative_logprob, abs=1e-3)
    lps = [e for r in results for e in json.loads(r.as_numpy("logprobs")[0])]
    assert len(lps) == 8
    for entry, tok, ref_lp in zip(lps, ref.token_ids, ref.logprobs):
        assert str(tok) in entry and entry[str(tok)]["rank"] == 1  # greedy: the sampled token is the best
        assert entry[str(tok)]["logprob"] == pytest.approx(ref_lp.logprob, abs=1e-3)
        assert len(entry) == 2 and all("decoded_token" in v for v in entry.values())
    # without logprobs requested the tensor is "null", as in vllm_backend
    results, err = stream.collect(stream.send(make_inputs(PROMPTS[2], {"max_tokens": 2}, return_logprobs=True)))
    assert err is None and results[-1].as_numpy("logprobs")[0] == b"null"


def test_stop_string(stream, offline):
    ref = offline_text(offline, PROMPTS[3], max_tokens=24).text
    words = ref.split()
    stop = words[len(words) // 2]
    rid = stream.send(make_inputs(PROMPTS[3], {"max_tokens": 24, "temperature": 0, "stop": [stop]},
                                  return_finish_reason=True))
    results, err = stream.collect(rid)
    assert err is None
    assert text_of(results) == ref[: ref.index(stop)]
    assert results[-1].as_numpy("finish_reason")[0] == b"stop"


def test_input_ids_in_output_ids_out(stream, offline):
    ref = offline_text(offline, PROMPTS[4], max_tokens=6)
    rid = stream.send(make_inputs(None, {"max_tokens": 6, "temperature": 0}, input_ids=ref.prompt_token_ids))
    results, err = stream.collect(rid)
    assert err is None
    assert [int(t) for r in results for t in r.as_numpy("output_ids")] == ref.token_ids
    assert text_of(results) == ref.text


def test_cancellation_mid_stream_frees_blocks(server):
    s = Stream(server)
    rid = s.send(make_inputs(PROMPTS[5], {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}))
    got = 0
    for r, e in s.responses(rid):
        assert e is None
        got += 1
        if got == 5:
            break
    assert wait_for(lambda: metric(scrape(server), "loom_kv_blocks_used") > 0, 10)
    s.close(cancel=True)
    assert wait_for(lambda: metric(scrape(server), "loom_kv_blocks_used") == 0
                    and metric(scrape(server), "loom_num_requests_running") == 0, 20)
    assert wait_for(lambda: metric(scrape(server), "loom_request_finished_total", reason="cancelled") >= 1, 10)


BAD = [
    (dict(sp_raw="{not json"), "sampling_parameters"),
    (dict(params={"max_tokens": "many"}), "max_tokens"),
    (dict(params={"temperature": [1]}), "temperature"),
    (dict(params={"ignore_eos": "maybe"}), "ignore_eos"),
    (dict(params={"max_tokens": -5}), "max_tokens"),
    (dict(params={"max_tokens": 10**12}), "max_tokens"),
    (dict(params={"top_p": 7}), "top_p"),
    (dict(params={"logprobs": 99}), "logprobs"),
    (dict(params={"n": 2, "temperature": 0}), "n"),  # n > 1 needs sampling (vLLM)
    (dict(params={"frobnicate": 1}), "frobnicate"),
    (dict(params={"lora_name": "no_such_adapter"}), "lora_name"),
    (dict(prompt=""), "text_input"),
    (dict(prompt="word " * 20000), "prompt"),
    (dict(prompt=None), "text_input"),
]


def test_bad_input_matrix_while_another_stream_streams(server):
    good = Stream(server)
    rid = good.send(make_inputs(PROMPTS[6], {"max_tokens": 400, "ignore_eos": True, "temperature": 0}))
    progress = []
    done = threading.Event()

    def consume():
        for r, e in good.responses(rid, timeout=300):
            progress.append((time.monotonic(), e))
        done.set()
    threading.Thread(target=consume, daemon=True).start()
    assert wait_for(lambda: len(progress) > 0, 60)
    for kw, field in BAD:
        kw = dict(kw)
        prompt = kw.pop("prompt", "hello")
        params = kw.pop("params", None)
        bad = Stream(server)
        try:
            brid = bad.send(make_inputs(prompt, params, **kw))
            results, err = bad.collect(brid, timeout=60)
        finally:
            bad.close()
        assert err is not None, (kw, field, [text_of(results)])
        assert str(err.message()).startswith(f"{field}:") or f"{field}:" in str(err), (field, str(err))
    before = len(progress)
    assert wait_for(lambda: len(progress) > before, 30), "the good stream stopped streaming"
    assert all(e is None for _, e in progress)
    good.close(cancel=True)


def test_adapter_ops_through_the_client(stream, offline):
    def op(**p):
        results, err = stream.collect(stream.send(make_inputs("", None, stream=None), parameters=p))
        assert err is None, err
        return json.loads(text_of(results))

    assert op(adapter_op="load", lora_name="gamma")["adapter_op"] == "load"
    names = [a["name"] if isinstance(a, dict) else a for a in op(adapter_op="list")["result"]]
    assert "gamma" in names
    results, err = stream.collect(stream.send(make_inputs(PROMPTS[7], dict(GREEDY, lora_name="gamma"))))
    assert err is None and text_of(results) == offline_text(offline, PROMPTS[7], lora="gamma").text
    op(adapter_op="unload", lora_name="gamma")
    # a path outside the adapter roots is refused
    results, err = stream.collect(stream.send(make_inputs("", None, stream=None),
                                              parameters={"adapter_op": "load", "lora_name": "x", "lora_path": "/etc"}))
    assert err is not None and "lora_path" in str(err)


def test_metrics_consistent_with_requests(stream, server):
    # a stream cancelled by the previous test may still be finishing: start from a quiet engine
    assert wait_for(lambda: metric(scrape(server), "loom_num_requests_running") == 0, 30)
    before = scrape(server)
    n, max_tokens = 3, 5
    for i in range(n):
        rid = stream.send(make_inputs(PROMPTS[i], {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
                                      return_num_input_tokens=True))
        results, err = stream.collect(rid)
        assert err is None
    def delta(name, **lab):
        return metric(scrape(server), name, **lab) - metric(before, name, **lab)
    assert wait_for(lambda: delta("loom_generation_tokens_total") == n * max_tokens, 10)
    assert delta("loom_request_finished_total", reason="length") == n
    assert delta("loom_e2e_request_latency_seconds_count") == n
    assert delta("loom_time_to_first_token_seconds_count") == n
    assert delta("loom_time_per_output_token_seconds_count") == n
    assert delta("loom_request_generation_tokens_sum") == n * max_tokens
    assert delta("loom_prompt_tokens_total") == delta("loom_request_prompt_tokens_sum") > 0
    snap = scrape(server)
    assert metric(snap, "loom_kv_blocks_total") > 0 and metric(snap, "loom_num_requests_waiting") == 0
    for name in ("loom_prefix_cache_hit_rate", "loom_resident_adapters", "loom_num_preemptions",
                 "loom_kv_cache_usage_perc"):
        assert any(k.startswith(name) for k in snap), name


def test_http_generate_stream(server, offline):
    body = json.dumps({"text_input": PROMPTS[0], "stream": True, "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps(GREEDY)}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/loom_smollm2/generate_stream", data=body,
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data:"):
                text += json.loads(line[5:])["text_output"]
    assert text == offline_text(offline, PROMPTS[0]).text


def test_client_script(server, offline):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "client.py"
    for lora in (None, "alpha"):
        cmd = [sys.executable, str(script), PROMPTS[0], "--url", server.grpc_url, "--max-tokens", "16", "--stats"]
        if lora:
            cmd += ["--adapter", lora]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout == offline_text(offline, PROMPTS[0], lora=lora).text + "\n"
        assert "finish_reason=" in p.stderr
    p = subprocess.run([sys.executable, str(script), "--url", server.grpc_url, "--adapter-op", "list"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and '"result"' in p.stdout, p.stderr
