"""vllm:* metrics on Triton's metrics endpoint, parsed with prometheus_client's text parser: vllm_backend's names
and counting rules (its metrics test, in our words), REPORT_CUSTOM_METRICS switching them per model, and the
model-server-protocol gauges the Gateway API Inference Extension reads, while requests on several adapters run
and wait."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.triton_client import make_inputs
from tests.e2e.compat.conftest import COMPAT, FAULTY, MAX_NUM_SEQS, Client

PROMPTS = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def client(server):
    c = Client(server)
    yield c
    c.close()


def samples(server) -> list:
    """Every sample on the endpoint, as prometheus_client parses the exposition."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(snap, name: str, model: str = COMPAT, **labels) -> float:
    vals = [s.value for s in snap if s.name == name and s.labels.get("model") == model
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(vals) <= 1, (name, labels, vals)
    return vals[0] if vals else 0.0


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


HIST = ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n")


def test_vllm_backend_metric_names_and_counts(client, server):
    """3 prompts, twice, not streamed, parameters as strings (tensor and request parameters, as its clients do)."""
    before = samples(server)
    params = {"temperature": "0", "top_p": "1"}
    n_in = n_out = 0
    outs = []
    for _ in range(2):
        for p in PROMPTS:
            res, err = client.run(make_inputs(p, params, stream=False, return_num_input_tokens=True,
                                              return_num_output_tokens=True), parameters=params)
            assert err is None, err
            n_in += int(res[0].as_numpy("num_input_tokens")[0])
            outs.append(int(res[0].as_numpy("num_output_tokens")[0]))
    n_out = sum(outs)

    def delta(snap, name, **lab):
        return value(snap, name, **lab) - value(before, name, **lab)

    assert wait_for(lambda: delta(samples(server), "vllm:request_params_n_count") == 6)
    after = samples(server)
    assert delta(after, "vllm:prompt_tokens_total") == n_in
    assert delta(after, "vllm:generation_tokens_total") == n_out
    for name in HIST:
        assert delta(after, f"{name}_count") == (n_out - 6 if "per_output" in name else 6), name
        assert delta(after, f"{name}_bucket", le="+Inf") == delta(after, f"{name}_count"), name
    # time per output token is observed per token after the first (vLLM's inter-token latency)
    assert delta(after, "vllm:time_per_output_token_seconds_sum") > 0
    assert delta(after, "vllm:time_to_first_token_seconds_sum") > 0
    assert delta(after, "vllm:request_prompt_tokens_sum") == n_in
    assert delta(after, "vllm:request_generation_tokens_sum") == n_out
    assert delta(after, "vllm:request_params_n_sum") == 6
    # n = 2 is observed as such (vllm_backend's custom-sampling-parameters test)
    params = {"n": "2", "temperature": "1", "top_p": "1", "max_tokens": "4"}
    res, err = client.run(make_inputs(PROMPTS[0], params, stream=False), parameters=params)
    assert err is None and len(res[0].as_numpy("text_output")) == 2
    assert wait_for(lambda: delta(samples(server), "vllm:request_params_n_sum") == 8)
    # REPORT_CUSTOM_METRICS is unset for the other model: none of its series carry a vllm: name
    assert not [s for s in after if s.name.startswith("vllm:") and s.labels.get("model") == FAULTY]
    assert [s for s in after if s.name.startswith("loom_") and s.labels.get("model") == COMPAT]  # alongside


def lora_series(snap):
    return [s for s in snap if s.name == "vllm:lora_requests_info" and s.labels.get("model") == COMPAT]


def names(label: str) -> set[str]:
    return set(label.split(",")) - {""}


def settled_lora_series(server, tries: int = 20):
    """A scrape and its lora_requests_info series, scraped again while a relabel is half done: the Python backend's
    metrics API has no atomic relabel, so for the ~0.1 ms between dropping the old series, creating the new one and
    setting its value, a scrape can find no series or a value of 0. Returns the last scrape whatever it shows."""
    for _ in range(tries):
        snap = samples(server)
        series = lora_series(snap)
        if len(series) == 1 and series[0].value > 0:
            break
        time.sleep(0.005)
    return snap, series


def test_gateway_gauges_while_adapters_run_and_wait(client, server):
    res, err = client.run(make_inputs(""), parameters={"adapter_op": "info"})
    assert err is None, err
    info = json.loads(res[0].as_numpy("text_output")[0])["result"]
    max_lora = str(info["adapters"]["capacity_rows"] // 64)  # rows of the pool / max_lora_rank
    loras = ["alpha", "beta", "gamma", None] * 2
    rids = [client.send(make_inputs(f"Story number {i}:", {"max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                                            **({"lora_name": lo} if lo else {})}))
            for i, lo in enumerate(loras)]
    seen_both = False
    snaps = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        snap, series = settled_lora_series(server)
        snaps.append(snap)
        assert len(series) == 1, [s.labels for s in series]  # current sets, not a history of label sets
        lab = series[0].labels
        running, waiting = names(lab["running_lora_adapters"]), names(lab["waiting_lora_adapters"])
        assert running <= {"alpha", "beta", "gamma"} and waiting <= {"alpha", "beta", "gamma"}
        assert lab["max_lora"] == max_lora
        assert abs(series[0].value - time.time()) < 60  # the time of the last update
        n_run = value(snap, "vllm:num_requests_running")
        assert 0 <= n_run <= MAX_NUM_SEQS
        if running and waiting and value(snap, "vllm:num_requests_waiting") > 0:
            seen_both = True
        if seen_both and all(client.queues[r].qsize() for r in rids[-2:]):
            break
        time.sleep(0.05)
    for rid in rids:
        _, err = client.collect(rid)
        assert err is None, err
    assert seen_both, "never saw adapters both running and waiting"
    for snap in snaps:
        kv = value(snap, "vllm:kv_cache_usage_perc")
        assert 0.0 <= kv <= 1.0 and value(snap, "vllm:gpu_cache_usage_perc") == kv
        assert value(snap, "vllm:cache_config_info", block_size="16",
                     num_gpu_blocks=str(info["kv_blocks_total"])) == 1.0
    assert any(value(s, "vllm:kv_cache_usage_perc") > 0 for s in snaps)

    def idle():
        _, series = settled_lora_series(server)
        return len(series) == 1 and not names(series[0].labels["running_lora_adapters"]) \
            and not names(series[0].labels["waiting_lora_adapters"])
    assert wait_for(idle), "the adapter sets must empty once nothing runs or waits"
    snap = samples(server)
    assert value(snap, "vllm:num_requests_running") == 0 and value(snap, "vllm:num_requests_waiting") == 0
