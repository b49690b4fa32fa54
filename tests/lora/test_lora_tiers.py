"""The host tier's byte bound (max_host_adapter_bytes beside max_host_adapters' count) and what the registry reports
about its tiers for metrics (AdapterRegistry.stats: residency, evictions, load latencies by tier)."""
from __future__ import annotations

import pytest
import torch

from harness.lora import holder_model, tiny_llama_config, write_raw_adapter
from loom.engine.config import EngineConfig
from loom.errors import ConfigError
from loom.lora import AdapterRegistry, LoraModelSpec, LoraPool
from loom.lora.lora_stats import LoadLog

CFG = tiny_llama_config()
ROW = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(CFG), torch.float32, "cpu")


def make_reg(root, **kw):
    for i, n in enumerate("abcd"):
        write_raw_adapter(str(root / n), CFG, seed=i, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    conf = EngineConfig(adapter_roots=[str(root)], lora_memory_bytes=4 * ROW, **kw)  # one adapter on the device
    return AdapterRegistry(conf, holder_model(CFG), "cpu", torch.float32)


def use(reg, name, activate=True):
    ref = reg.acquire(name)
    while not ref.ready:
        assert ref.error is None, ref.error
        reg.wait_for_loads(1)
    if activate:
        assert reg.activate(ref)
    return ref


def states(reg):
    return {d["name"]: d["state"] for d in reg.list()}


def test_host_tier_bounded_by_bytes(tmp_path):
    probe = make_reg(tmp_path / "probe")
    size = use(probe, "a")._v.host.nbytes  # every adapter here: the same shapes, the same bytes
    probe.close()
    reg = make_reg(tmp_path, max_host_adapters=64, max_host_adapter_bytes=size + size // 2)  # room for one
    reg.release(use(reg, "a"))
    reg.release(use(reg, "b"))  # a leaves the device for the host tier: one adapter's bytes fit
    assert states(reg) == {"a": "host", "b": "device"}
    reg.release(use(reg, "c"))  # b joins it: two adapters' bytes do not fit, a (least recently used) is dropped
    assert states(reg) == {"a": "disk", "b": "host", "c": "device"}
    st = reg.stats()
    assert (st.host_adapters, st.host_bytes, st.host_evictions, st.device_adapters) == (1, size, 1, 1)
    # adapters requests hold stay beyond the bound, and are trimmed when released
    held = [use(reg, "b", activate=False), use(reg, "c", activate=False)]
    reg.release(use(reg, "d"))
    assert states(reg) == {"a": "disk", "b": "host", "c": "host", "d": "device"}
    assert reg.stats().host_bytes == 2 * size
    for ref in held:
        reg.release(ref)
    assert states(reg) == {"a": "disk", "b": "disk", "c": "host", "d": "device"}  # b, released first, is dropped
    assert reg.stats().host_bytes == size
    reg.close()
    # 0 (the default): the count alone
    reg = make_reg(tmp_path, max_host_adapters=2)
    for n in "abcd":
        reg.release(use(reg, n))
    assert states(reg) == {"a": "disk", "b": "host", "c": "host", "d": "device"}
    reg.close()
    with pytest.raises(ConfigError, match="max_host_adapter_bytes"):
        EngineConfig(max_host_adapter_bytes=-1)


def test_stats_report_tiers_evictions_and_load_latencies(tmp_path):
    reg = make_reg(tmp_path, max_host_adapters=1)
    assert reg.stats().loads == () and reg.stats().device_adapters == 0
    for n in "abc":
        reg.release(use(reg, n))
    st = reg.stats()
    assert (st.device_adapters, st.host_adapters, st.device_evictions, st.host_evictions) == (1, 1, 2, 1)
    assert [x.tier for x in st.loads] == ["disk_to_host", "host_to_device"] * 3
    assert [x.seq for x in st.loads] == list(range(1, 7)) and all(x.seconds >= 0 for x in st.loads)
    assert st.remote_fetches == 0 and st.cache_bytes == 0  # no adapter_sources
    assert reg.stats() == st  # reading does not consume
    reg.close()


def test_load_log_keeps_the_most_recent_numbered():
    log = LoadLog(maxlen=3)
    for i in range(5):
        log.record("disk_to_host", float(i))
    assert [(x.seq, x.seconds) for x in log.recent()] == [(3, 2.0), (4, 3.0), (5, 4.0)]
