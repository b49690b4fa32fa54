"""Adapters fetched on first use from adapter_sources (fsspec's memory:// and file:// filesystems) into the local
cache: fetched once, cached within the byte budget (least recently used dropped), URIs outside the sources refused
naming the field, a corrupt or partial transfer never served and never left in the cache, concurrent first uses
fetching once."""
from __future__ import annotations

import os
import threading
import uuid

import fsspec
import pytest
import torch

from harness.lora import holder_model, tiny_llama_config, write_raw_adapter
from loom.engine.config import EngineConfig
from loom.errors import ConfigError, RequestError
from loom.lora import AdapterRegistry, LoraModelSpec, LoraPool
from loom.lora import adapter_sources as sources_mod
from loom.lora.adapter_cache import AdapterCache
from loom.lora.adapter_sources import AdapterSources
from loom.lora.peft_config import AdapterLoadError

CFG = tiny_llama_config()
ROW = LoraPool.row_bytes_for(LoraModelSpec.from_hf_config(CFG), torch.float32, "cpu")
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture
def mem():
    """A fresh folder on fsspec's (process-wide) memory filesystem: its URI; removed afterwards."""
    root = f"/{uuid.uuid4().hex}/adapters"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root.rsplit("/", 1)[0], recursive=True)


def upload(tmp_path, uri: str, name: str, seed: int = 0, r: int = 2) -> dict[str, bytes]:
    """Write adapter `name` locally and put its files at `<uri>/<name>/`; returns them."""
    local = write_raw_adapter(str(tmp_path / "src" / name), CFG, seed=seed, r=r, alpha=2 * r,
                              target_modules=["q_proj", "v_proj"])
    fs, root = fsspec.core.url_to_fs(uri)
    data = {}
    for f in FILES:
        with open(os.path.join(local, f), "rb") as fh:
            data[f] = fh.read()
        fs.pipe(f"{root}/{name}/{f}", data[f])
    return data


def make_reg(tmp_path, sources, roots=(), rows=64, **kw):
    conf = EngineConfig(adapter_roots=[str(r) for r in roots], adapter_sources=list(sources),
                        adapter_cache_dir=str(tmp_path / "cache"), lora_memory_bytes=rows * ROW, **kw)
    return AdapterRegistry(conf, holder_model(CFG), "cpu", torch.float32)


def settle(reg, ref):
    """Wait (on the registry's load events) until the ref's load finished; the ref."""
    while not ref.ready and ref.error is None:
        reg.wait_for_loads(1)
    return ref


def cache_listing(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "cache"))


def test_first_use_fetches_once_and_serves_from_the_cache(tmp_path, mem):
    data = upload(tmp_path, mem, "a", seed=1)
    upload(tmp_path, mem, "b", seed=2, r=8)
    reg = make_reg(tmp_path, [mem], rows=8, max_host_adapters=0)
    ref = settle(reg, reg.acquire("a"))
    assert ref.error is None and reg.activate(ref)
    (info,) = reg.list()
    assert info["state"] == "device" and info["rank"] == 2 and info["path"].startswith(str(tmp_path / "cache"))
    for f in FILES:  # the cache entry is the source's files, byte for byte
        with open(os.path.join(info["path"], f), "rb") as fh:
            assert fh.read() == data[f]
    weights = reg.pool.read(ref.row_start, ref.rank)
    reg.release(ref)
    assert reg.stats().remote_fetches == 1
    # b takes every row: a leaves the device, and host memory (max_host_adapters=0); it is read again from the cache
    rb = settle(reg, reg.acquire("b"))
    assert reg.activate(rb)
    reg.release(rb)
    assert {d["name"]: d["state"] for d in reg.list()} == {"a": "disk", "b": "device"}
    assert reg.stats().remote_fetches == 2
    ref = settle(reg, reg.acquire("a"))
    assert reg.activate(ref) and reg.stats().remote_fetches == 2
    assert [x.tier for x in reg.stats().loads] == ["remote_to_host", "host_to_device"] * 2 + ["disk_to_host",
                                                                                              "host_to_device"]
    again = reg.pool.read(ref.row_start, ref.rank)
    assert all(torch.equal(x[g], y[g]) for x, y in zip(weights, again) for g in x)
    reg.release(ref)
    reg.close()
    # a new engine on the same cache folder finds the entry: no transfer
    reg = make_reg(tmp_path, [mem])
    assert settle(reg, reg.acquire("a")).error is None and reg.stats().remote_fetches == 0
    reg.close()


def test_local_roots_first_then_sources_then_unknown(tmp_path, mem):
    root = tmp_path / "root"
    write_raw_adapter(str(root / "a"), CFG, seed=5, r=2, alpha=4, target_modules=["q_proj"])
    upload(tmp_path, mem, "a", seed=6)
    reg = make_reg(tmp_path, [mem], roots=[root])
    ref = settle(reg, reg.acquire("a"))
    assert reg.list()[0]["path"] == os.path.realpath(root / "a") and reg.stats().remote_fetches == 0
    reg.release(ref)
    ref = settle(reg, reg.acquire("nowhere"))  # looked up by the loader: the request fails, the name is not kept
    assert "unknown adapter 'nowhere'" in ref.error and "adapter_sources" in ref.error
    assert "nowhere" not in [d["name"] for d in reg.list()]
    reg.release(ref)
    upload(tmp_path, mem, "b")
    info = reg.load("b")  # a load by name alone looks there too
    assert info["source"] == f"memory://{mem.split('://')[1]}/b" and info["state"] == "host"
    with pytest.raises(RequestError, match="unknown adapter 'nowhere'") as ei:
        reg.load("nowhere")
    assert ei.value.field == "lora_path"
    reg.close()


def test_file_source_and_uris_outside_the_sources_refused(tmp_path, mem):
    src = tmp_path / "remote"
    write_raw_adapter(str(src / "x"), CFG, seed=2, r=2, alpha=4, target_modules=["v_proj"])
    os.makedirs(tmp_path / "elsewhere")
    write_raw_adapter(str(tmp_path / "elsewhere" / "y"), CFG, seed=3, r=2, alpha=4, target_modules=["v_proj"])
    os.symlink(tmp_path / "elsewhere" / "y", src / "link")
    reg = make_reg(tmp_path, [f"file://{src}"])
    info = reg.load("x", f"file://{src}/x")
    assert info["state"] == "host" and info["path"] != str(src / "x") and reg.stats().remote_fetches == 1
    for bad in (f"file://{tmp_path}/elsewhere/y", f"file://{src}/../elsewhere/y", f"{mem}/x", f"file://{src}",
                f"file://{src}x/y"):
        with pytest.raises(RequestError, match="outside the configured adapter_sources|may not contain") as ei:
            reg.load("y", bad)
        assert ei.value.field == "lora_path"
    with pytest.raises(RequestError, match="outside the configured adapter roots") as ei:  # a symlink out
        reg.load("y", f"file://{src}/link")
    assert ei.value.field == "lora_path" and "y" not in [d["name"] for d in reg.list()]
    reg.close()
    plain = make_reg(tmp_path, [], roots=[src])
    with pytest.raises(RequestError, match="no adapter_sources are configured") as ei:
        plain.load("x", f"file://{src}/x")
    assert ei.value.field == "lora_path"
    plain.close()
    with pytest.raises(ConfigError, match="adapter_sources"):
        EngineConfig(adapter_sources=["/a/local/path"])
    with pytest.raises(ConfigError, match="adapter_sources"):
        make_reg(tmp_path, ["nosuchprotocol://x"])


def test_reload_fetches_afresh(tmp_path, mem):
    upload(tmp_path, mem, "a", seed=1)
    reg = make_reg(tmp_path, [mem])
    first = reg.load("a", f"{mem}/a")
    upload(tmp_path, mem, "a", seed=2)
    assert reg.load("b", f"{mem}/a")["version"] != first["version"]  # the same URI again: from the cache
    assert reg.stats().remote_fetches == 1
    second = reg.reload("a")  # from its URI, transferred again
    assert reg.stats().remote_fetches == 2 and second["version"] != first["version"]
    ra, rb = settle(reg, reg.acquire("a")), settle(reg, reg.acquire("b"))
    assert reg.activate(ra) and reg.activate(rb)
    pa, pb = reg.pool.read(ra.row_start, 2), reg.pool.read(rb.row_start, 2)
    assert not all(torch.equal(pa[0][g], pb[0][g]) for g in pa[0])  # the reload serves the new weights
    reg.close()


def test_cache_keeps_its_byte_budget_least_recently_used_first(tmp_path, mem):
    sizes = {n: sum(map(len, upload(tmp_path, mem, n, seed=i).values())) for i, n in enumerate("abcd")}
    assert len(set(sizes.values())) == 1
    size = sizes["a"]
    sources = AdapterSources([mem], str(tmp_path / "cache"), 2 * size + size // 2)  # room for two
    path = {n: sources.fetch(f"{mem}/{n}") for n in "ab"}
    assert sources.fetch(f"{mem}/a") == path["a"] and sources.cache.fetches == 2  # a: cached, now the most recent
    path["c"] = sources.fetch(f"{mem}/c")  # drops b, the least recently used
    assert os.path.isdir(path["a"]) and os.path.isdir(path["c"]) and not os.path.exists(path["b"])
    assert sources.cache.bytes == 2 * size <= sources.cache.max_bytes and sources.cache.evictions == 1
    assert cache_listing(tmp_path) == sorted(os.path.basename(path[n]) for n in "ac")
    # a restart keeps the order (folders' modification times): a is older than c, so d drops a
    os.utime(path["a"], (1, 1))
    sources = AdapterSources([mem], str(tmp_path / "cache"), 2 * size + size // 2)
    sources.fetch(f"{mem}/d")
    assert not os.path.exists(path["a"]) and os.path.isdir(path["c"]) and sources.cache.fetches == 1
    small = AdapterSources([mem], str(tmp_path / "cache2"), size - 1)
    with pytest.raises(AdapterLoadError, match=f"adapter_cache_bytes .* at least {size}"):
        small.fetch(f"{mem}/a")
    assert os.listdir(tmp_path / "cache2") == []


def test_corrupt_or_partial_transfers_are_never_served(tmp_path, mem, monkeypatch):
    data = upload(tmp_path, mem, "a")
    fs, root = fsspec.core.url_to_fs(mem)
    reg = make_reg(tmp_path, [mem])
    # the source holds a truncated weights file: found by the check, the request fails, nothing is cached
    fs.pipe(f"{root}/a/adapter_model.safetensors", data["adapter_model.safetensors"][:-100])
    ref = settle(reg, reg.acquire("a"))
    assert "truncated or corrupt" in ref.error and not ref.ready
    reg.release(ref)
    assert cache_listing(tmp_path) == []
    # a config that does not parse
    fs.pipe(f"{root}/a/adapter_model.safetensors", data["adapter_model.safetensors"])
    fs.pipe(f"{root}/a/adapter_config.json", b"{not json")
    with pytest.raises(RequestError, match="adapter_config.json does not parse"):
        reg.load("a", f"{mem}/a")
    assert cache_listing(tmp_path) == []
    fs.pipe(f"{root}/a/adapter_config.json", data["adapter_config.json"])
    real_transfer = sources_mod._transfer

    def cut(fs, remote_path, dest):  # the connection drops half way
        with fs.open(remote_path, "rb") as src, open(dest, "wb") as dst:
            dst.write(src.read(10))
        raise ConnectionResetError("peer went away")

    monkeypatch.setattr(sources_mod, "_transfer", cut)
    with pytest.raises(RequestError, match="peer went away"):
        reg.load("a", f"{mem}/a")
    assert cache_listing(tmp_path) == []

    def short(fs, remote_path, dest):  # the transfer ends early without an error
        with fs.open(remote_path, "rb") as src, open(dest, "wb") as dst:
            dst.write(src.read()[:-10])

    monkeypatch.setattr(sources_mod, "_transfer", short)
    with pytest.raises(RequestError, match="incomplete transfer"):
        reg.load("a", f"{mem}/a")
    assert cache_listing(tmp_path) == []
    monkeypatch.setattr(sources_mod, "_transfer", real_transfer)
    assert reg.load("a", f"{mem}/a")["state"] == "host" and len(cache_listing(tmp_path)) == 1
    reg.close()


def test_concurrent_first_uses_fetch_once(tmp_path):
    cache = AdapterCache(str(tmp_path / "cache"), 1 << 30)
    src = write_raw_adapter(str(tmp_path / "src"), CFG, seed=0, r=2, alpha=4, target_modules=["q_proj"])
    sizes = {f: os.path.getsize(os.path.join(src, f)) for f in FILES}
    started, release, copies = threading.Event(), threading.Event(), []

    def copy(fname, dest):
        copies.append(fname)
        started.set()
        release.wait(60)
        with open(os.path.join(src, fname), "rb") as a, open(dest, "wb") as b:
            b.write(a.read())

    results = []

    def use():
        results.append(cache.get("memory:///x/a", lambda: sizes, copy))

    first = threading.Thread(target=use)
    first.start()
    started.wait()  # the first get is transferring; four more arrive meanwhile
    others = [threading.Thread(target=use) for _ in range(4)]
    for t in others:
        t.start()
    with cache._changed:  # the four wait for the first's transfer (a guard against hanging, not a timing)
        assert cache._changed.wait_for(lambda: cache.waiting == 4, timeout=60)
    release.set()
    for t in [first, *others]:
        t.join()
    assert copies == list(FILES) and cache.fetches == 1
    assert len(results) == 5 and len(set(results)) == 1 and os.path.isdir(results[0])
