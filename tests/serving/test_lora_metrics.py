"""The loom_lora_* metrics (per-adapter running / waiting requests, load latencies by tier, adapters and bytes per
tier, evictions, fetches) and vllm:lora_requests_info, with test_metrics_and_config's stand-in for pb_utils."""
from __future__ import annotations

from loom.engine.outputs import EngineStats
from loom.lora.lora_stats import AdapterLoad, LoraStats
from loom.serving.metrics import LORA_LOAD_BUCKETS, LoomMetrics
from tests.serving.test_metrics_and_config import FakePb


def run(steps, names=("loom",)):
    """Apply each stats in turn, as the metrics thread does with each it takes; the families made."""
    FakePb.MetricFamily.created.clear()
    m = LoomMetrics(FakePb, {"model": "m"}, names=names)
    for st in steps:
        if m.loom:
            m._apply(st, 0, 0, [])
        if m.vllm:
            m._apply_vllm(st, 0, 0, [], [])
    m.close()
    return FakePb.MetricFamily.created


def ops(families, name, **labels):
    return [op for f in families if f.name == name for met in f.metrics
            if all(met.labels.get(k) == v for k, v in labels.items()) for op in met.ops]


def test_per_adapter_requests_are_replaced_with_the_adapter_set():
    fams = run([EngineStats(running_adapters={"a": 2, "b": 1}, waiting_adapters={"c": 3}),
                EngineStats(running_adapters={"a": 1}, waiting_adapters={})])
    running = [f for f in fams if f.name == "loom_lora_requests_running"]
    assert len(running) == 2  # made again when the set of adapters changed
    assert {m.labels["lora_name"]: m.ops for m in running[0].metrics} == {"a": [("set", 2.0)], "b": [("set", 1.0)]}
    assert [(m.labels, m.ops) for m in running[1].metrics] == [({"model": "m", "lora_name": "a"}, [("set", 1.0)])]
    waiting = [f for f in fams if f.name == "loom_lora_requests_waiting"]
    assert len(waiting) == 1 and [m.ops for m in waiting[0].metrics] == [[("set", 3.0)]]  # none once none wait


def test_load_latencies_tiers_evictions_and_fetches():
    first = LoraStats(device_adapters=2, host_adapters=1, host_bytes=1000, device_evictions=1, cache_bytes=5000,
                      remote_fetches=1, device_bytes=4096, compactions=1, load_cpu_share=0.03,
                      loads=(AdapterLoad(1, "remote_to_host", 2.0), AdapterLoad(2, "host_to_device", 0.001)))
    second = LoraStats(device_adapters=2, host_adapters=0, host_bytes=0, device_evictions=3, host_evictions=1,
                       cache_bytes=5000, cache_evictions=1, remote_fetches=1, device_bytes=6144, compactions=3,
                       load_cpu_share=0.25, loads=first.loads + (AdapterLoad(3, "disk_to_host", 0.01),))
    fams = run([EngineStats(lora=first), EngineStats(lora=second)])
    assert ops(fams, "loom_lora_load_seconds", tier="remote_to_host") == [("obs", 2.0)]  # each load once
    assert ops(fams, "loom_lora_load_seconds", tier="host_to_device") == [("obs", 0.001)]
    assert ops(fams, "loom_lora_load_seconds", tier="disk_to_host") == [("obs", 0.01)]
    assert all(m.buckets == LORA_LOAD_BUCKETS for f in fams if f.name == "loom_lora_load_seconds" for m in f.metrics)
    assert ops(fams, "loom_lora_adapters", tier="device") == [("set", 2.0)]  # unchanged: set once
    assert ops(fams, "loom_lora_adapters", tier="host") == [("set", 1.0), ("set", 0.0)]
    assert ops(fams, "loom_lora_host_bytes") == [("set", 1000.0), ("set", 0.0)]
    assert ops(fams, "loom_lora_cache_bytes") == [("set", 5000.0)]
    assert ops(fams, "loom_lora_evictions_total", tier="device") == [("inc", 1), ("inc", 2)]
    assert ops(fams, "loom_lora_evictions_total", tier="host") == [("inc", 1)]
    assert ops(fams, "loom_lora_evictions_total", tier="cache") == [("inc", 1)]
    assert ops(fams, "loom_lora_fetches_total") == [("inc", 1)]
    assert ops(fams, "loom_lora_device_bytes") == [("set", 4096.0), ("set", 6144.0)]
    assert ops(fams, "loom_lora_compactions_total") == [("inc", 1), ("inc", 2)]
    assert ops(fams, "loom_lora_load_cpu_share") == [("set", 0.03), ("set", 0.25)]


def test_lora_requests_info_lists_the_adapter_sets():
    fams = run([EngineStats(max_loras=4, running_adapters={"b": 1, "a": 2}, waiting_adapters={"c": 1}),
                EngineStats(max_loras=4, running_adapters={"a": 1})], names=("vllm",))
    info = [f for f in fams if f.name == "vllm:lora_requests_info"]
    assert [m.labels for f in info for m in f.metrics] == [
        {"model": "m", "max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"},
        {"model": "m", "max_lora": "4", "running_lora_adapters": "a", "waiting_lora_adapters": ""}]
    assert all(len(m.ops) == 1 and m.ops[0][0] == "set" for f in info for m in f.metrics)
    assert not any(f.name.startswith("loom_") for f in fams)
