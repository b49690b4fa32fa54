"""backend/metrics.py with a stand-in for pb_utils (the rules that keep Triton 2.51 alive), and
backend/serve_config.py (config.pbtxt parameters)."""
from __future__ import annotations

import time

import pytest

from loom.engine.outputs import EngineStats
from loom.errors import ConfigError
from loom.serving import metrics as metrics_module
from loom.serving.async_engine import RequestTiming
from loom.serving.metrics import LoomMetrics, buckets_1_2_5
from loom.serving.serve_config import parse_model_parameters


class FakeMetric:
    def __init__(self, family, labels, buckets):
        self.family, self.labels, self.buckets, self.ops = family, labels, buckets, []

    def increment(self, v):
        assert self.family.kind == "counter" and v > 0, "only positive increments on counters"
        self.ops.append(("inc", v))

    def set(self, v):
        assert self.family.kind == "gauge"
        self.ops.append(("set", v))

    def observe(self, v):
        assert self.family.kind == "histogram"
        self.ops.append(("obs", v))

    def value(self):
        raise AssertionError("value() must never be called (it crashes 2.51 on histograms)")


class FakePb:
    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        created: list = []

        def __init__(self, name, description, kind):
            self.name, self.kind, self.metrics = name, kind, []
            FakePb.MetricFamily.created.append(self)

        def Metric(self, labels, buckets=None):
            assert (buckets is not None) == (self.kind == "histogram")
            self.metrics.append(FakeMetric(self, labels, buckets))
            return self.metrics[-1]


def test_metrics_flow():
    FakePb.MetricFamily.created.clear()
    m = LoomMetrics(FakePb, {"model": "m", "version": "1"}, max_model_len=100, interval_s=0.001)
    fams = {f.name: f for f in FakePb.MetricFamily.created}
    assert all(n.startswith("loom_") for n in fams)
    m.on_step(EngineStats(num_running=2, kv_blocks_used=3, kv_blocks_total=10, prefix_hit_tokens=1,
                          prefix_query_tokens=4), prompt_tokens=7, generation_tokens=2)
    m.on_step(EngineStats(), prompt_tokens=0, generation_tokens=0)
    m.on_request_finished(RequestTiming("r", 0.0, 0.5, 2.5, 7, 5, "length", None))
    m.on_request_finished(RequestTiming("c", 0.0, None, 1.0, 3, 0, "abort", "cancelled"))
    m.on_request_finished(RequestTiming("x", 0.0, None, 0.1, 0, 0, "abort", "invalid"))
    time.sleep(0.05)
    m.close()

    def ops(name, **lab):
        return [op for met in fams[name].metrics if all(met.labels.get(k) == v for k, v in lab.items())
                for op in met.ops]
    assert ops("loom_prompt_tokens_total") == [("inc", 7)]
    assert ops("loom_generation_tokens_total") == [("inc", 2)]
    assert ops("loom_time_to_first_token_seconds") == [("obs", 0.5)]
    assert ops("loom_time_per_output_token_seconds") == [("obs", 0.5)]
    assert sorted(ops("loom_e2e_request_latency_seconds")) == [("obs", 1.0), ("obs", 2.5)]
    assert ops("loom_request_finished_total", reason="length") == [("inc", 1)]
    assert ops("loom_request_finished_total", reason="cancelled") == [("inc", 1)]
    assert ops("loom_request_finished_total", reason="rejected") == [("inc", 1)]
    assert ops("loom_kv_blocks_used")[-1] == ("set", 0.0)  # the latest stats win
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_gauges_are_set_only_when_they_change(monkeypatch):
    """Every metric call is an IPC round trip holding the stub's GIL: an unchanged gauge is not set again."""
    monkeypatch.setattr(metrics_module, "LORA_INFO_REFRESH_S", 3600.0)
    FakePb.MetricFamily.created.clear()
    m = LoomMetrics(FakePb, {"model": "m"}, interval_s=0.001, names=("loom", "vllm"))
    for used in (3, 3, 3, 5, 5):
        m.on_step(EngineStats(num_running=2, kv_blocks_used=used, kv_blocks_total=10, max_loras=4,
                              running_adapters={"a": 1}), prompt_tokens=0, generation_tokens=1)
        deadline = time.monotonic() + 30
        while m._stats is not None and time.monotonic() < deadline:  # taken: each update applied on its own
            time.sleep(0.001)
    m.close()
    fams = {f.name: f for f in FakePb.MetricFamily.created}  # vllm:lora_requests_info is made on the first update

    def sets(name):
        return [v for met in fams[name].metrics for op, v in met.ops if op == "set"]
    assert sets("loom_kv_blocks_used") == [3.0, 5.0] and sets("loom_kv_blocks_total") == [10.0]
    assert sets("loom_num_requests_running") == [2.0] and sets("vllm:num_requests_running") == [2.0]
    assert sets("vllm:kv_cache_usage_perc") == [0.3, 0.5] == sets("vllm:gpu_cache_usage_perc")
    assert len(sets("vllm:lora_requests_info")) == 1  # labels unchanged, refresh not due: one set
    gen = [v for met in fams["loom_generation_tokens_total"].metrics for _, v in met.ops]
    assert sum(gen) == 5  # counters still get every increment


def P(**kw):
    return {k: {"string_value": v} for k, v in kw.items()}


def test_config_parameters(tmp_path):
    (tmp_path / "adapters").mkdir()
    c = parse_model_parameters(P(model="", dtype="float32", kv_cache_memory_bytes="512MiB", block_size="32",
                                 adapter_roots="adapters", max_queue_size="8", enable_prefix_caching="false",
                                 EXECUTION_ENV_PATH="x"), str(tmp_path))
    assert c.engine.kv_cache_memory_bytes == 512 << 20 and c.engine.block_size == 32
    assert c.engine.adapter_roots == [str(tmp_path / "adapters")] and c.engine.enable_prefix_caching is False
    assert c.options.max_queue_size == 8 and c.limits.max_logprobs == 20


@pytest.mark.parametrize("params, field", [
    (P(block_size="17"), "block_size"),
    (P(blok_size="16"), "blok_size"),
    (P(max_num_seqs="lots"), "max_num_seqs"),
    (P(adapter_roots="does/not/exist"), "adapter_roots"),
    (P(dtype="float64"), "dtype"),
    (P(max_queue_size="0"), "max_queue_size"),
    (P(enable_prefix_caching="sometimes"), "enable_prefix_caching"),
    (P(default_request_timeout_s="-1"), "default_request_timeout_s"),
])
def test_bad_config_stops_the_load(tmp_path, params, field):
    with pytest.raises(ConfigError) as ei:
        parse_model_parameters(params, str(tmp_path))
    assert ei.value.field == field
