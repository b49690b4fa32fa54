"""AdapterRegistry: paths, resolve-on-first-use, background loads, LRU eviction, host cache, reload/unload
semantics, pinning, compaction, batch metadata."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import loom.lora.adapter_registry as registry_mod
from harness.lora import holder_model, tiny_llama_config, write_raw_adapter
from loom.engine.config import EngineConfig
from loom.errors import RequestError
from loom.lora import AdapterRegistry, LoraModelSpec, LoraPool, build_lora_meta

CFG = tiny_llama_config()
SPEC = LoraModelSpec.from_hf_config(CFG)
ROW = LoraPool.row_bytes_for(SPEC, torch.float32, "cpu")


def make_reg(roots, rows=64, **kw):
    conf = EngineConfig(adapter_roots=[str(r) for r in roots], lora_memory_bytes=rows * ROW, **kw)
    model = holder_model(CFG)
    reg = AdapterRegistry(conf, model, "cpu", torch.float32)
    reg._model = model
    return reg


def ad(root, name, seed=0, r=2, targets=("q_proj", "v_proj"), **kw):
    return write_raw_adapter(str(root / name), CFG, seed=seed, r=r, alpha=2 * r, target_modules=list(targets), **kw)


def ready(reg, ref, timeout=10.0):
    t0 = time.time()
    while not ref.ready:
        assert ref.error is None, ref.error
        assert time.time() - t0 < timeout, "load did not finish"
        reg.wait_for_loads(0.5)
    return ref


def get(reg, name):
    ref = ready(reg, reg.acquire(name))
    assert reg.activate(ref)
    return ref


def rows_equal_host(reg, ref):
    w = ref._v.host
    a, b = reg.pool.read(ref.row_start, ref.rank)
    for g in SPEC.groups:
        if g.name in w.a:
            if not (torch.equal(a[g.name], w.a[g.name]) and torch.equal(b[g.name], w.b[g.name])):
                return False
        elif a[g.name].abs().sum() != 0 or b[g.name].abs().sum() != 0:
            return False
    return True


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    return r


# ------------------------------------------------------------------------------------------ paths & names


def test_paths_confined_to_roots(tmp_path, root):
    outside = tmp_path / "outside"
    outside.mkdir()
    ad(outside, "evil")
    ad(root, "good")
    reg = make_reg([root])
    for path, frag in [
        (str(outside / "evil"), "outside the configured adapter roots"),
        ("../outside/evil", "may not contain '..'"),
        (str(root / ".." / "outside" / "evil"), "may not contain '..'"),
        ("missing", "does not exist"),
    ]:
        with pytest.raises(RequestError) as ei:
            reg.load("x", path)
        assert ei.value.field == "lora_path" and frag in str(ei.value), str(ei.value)
    # symlinked directory escaping the root
    os.symlink(outside / "evil", root / "link")
    with pytest.raises(RequestError, match="outside the configured adapter roots"):
        reg.load("x", "link")
    with pytest.raises(RequestError, match="outside the configured adapter roots"):
        reg.load("x", str(root / "link"))
    # a symlinked weights file escaping the root
    d = root / "filelink"
    d.mkdir()
    os.link(root / "good" / "adapter_config.json", d / "adapter_config.json")
    os.symlink(outside / "evil" / "adapter_model.safetensors", d / "adapter_model.safetensors")
    with pytest.raises(RequestError, match="links outside the adapter roots"):
        reg.load("x", "filelink")
    # first use of a symlink escaping the root is refused too
    with pytest.raises(RequestError) as ei:
        reg.acquire("link")
    assert ei.value.field == "lora_name"
    # fine: relative and absolute inside the root
    info = reg.load("g1", "good")
    assert info["name"] == "g1" and info["path"] == os.path.realpath(root / "good")
    reg.load("g2", str(root / "good"))
    assert [d["name"] for d in reg.list()] == ["g1", "g2"]
    reg.close()


def test_no_roots_and_bad_names(tmp_path, root):
    ad(root, "good")
    reg = make_reg([])
    with pytest.raises(RequestError, match="no adapter_roots"):
        reg.load("x", str(root / "good"))
    with pytest.raises(RequestError, match="unknown adapter"):
        reg.acquire("good")
    for bad in ["", "../x", "/abs", "a/../b", ".hidden", "a b", "x" * 300]:
        with pytest.raises(RequestError) as ei:
            reg.acquire(bad)
        assert ei.value.field == "lora_name"
    reg.close()


# ------------------------------------------------------------------------------------------ loading


def test_resolve_on_first_use_in_background(root, monkeypatch):
    ad(root, "lazy")
    reg = make_reg([root])
    gate = threading.Event()
    real = registry_mod.load_peft_adapter

    def slow(*a, **k):
        assert threading.current_thread() is not threading.main_thread()
        gate.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(registry_mod, "load_peft_adapter", slow)
    t0 = time.time()
    ref = reg.acquire("lazy")
    ref2 = reg.acquire("lazy")  # shares the pending version
    assert time.time() - t0 < 1.0
    assert not ref.ready and ref.error is None and not reg.activate(ref)
    assert reg.list()[0]["state"] == "loading"
    assert ref.version == ref2.version
    gate.set()
    ready(reg, ref)
    assert ref2.ready and reg.activate(ref) and reg.activate(ref2)
    assert reg.list()[0]["state"] == "device" and reg.list()[0]["active"] == 2
    assert rows_equal_host(reg, ref)
    reg.close()


def test_unknown_and_bad_adapters_on_first_use(root):
    reg = make_reg([root], max_lora_rank=8)
    with pytest.raises(RequestError) as ei:
        reg.acquire("nope")
    assert ei.value.field == "lora_name" and "unknown adapter 'nope'" in str(ei.value)
    ad(root, "dora", extra_config={"use_dora": True})
    with pytest.raises(RequestError, match="DoRA"):
        reg.acquire("dora")
    ad(root, "big", r=16)
    with pytest.raises(RequestError, match="exceeds max_lora_rank=8"):
        reg.acquire("big")
    # a weights problem is found by the background loader: the ref reports it, the name is not kept
    d = ad(root, "broken")
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x00" * 64)
    ref = reg.acquire("broken")
    while ref.error is None:
        reg.wait_for_loads(1)
    assert "not a valid safetensors file" in ref.error and not ref.ready
    with pytest.raises(RequestError, match="not a valid safetensors"):
        reg.activate(ref)
    assert "broken" not in [d["name"] for d in reg.list()]
    reg.release(ref)
    ad(root, "broken", seed=3)  # fixed on disk: next use loads it
    ref = get(reg, "broken")
    reg.release(ref)
    reg.close()


def test_load_errors_and_future(root):
    ad(root, "a")
    d = ad(root, "nan")
    from safetensors.torch import load_file, save_file

    p = os.path.join(d, "adapter_model.safetensors")
    sd = load_file(p)
    next(iter(sd.values()))[0, 0] = float("inf")
    save_file(sd, p)
    reg = make_reg([root])
    with pytest.raises(RequestError, match="NaN or Inf") as ei:
        reg.load("n", "nan")
    assert ei.value.field == "lora_path" and "n" not in [d["name"] for d in reg.list()]
    fut = reg.load("a", "a", wait=False)
    info = fut.result(10)
    assert info["state"] == "host" and info["rank"] == 2 and info["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(RequestError, match="already loaded"):
        reg.load("a", "a")
    with pytest.raises(RequestError, match="not loaded"):
        reg.reload("zz")
    with pytest.raises(RequestError, match="not loaded"):
        reg.unload("zz")
    reg.close()


def test_rank_larger_than_pool_and_disabled(root):
    ad(root, "r8", r=8)
    reg = make_reg([root], rows=4)
    with pytest.raises(RequestError, match="does not fit the device LoRA pool"):
        reg.acquire("r8")
    reg.close()
    conf = EngineConfig(adapter_roots=[str(root)], lora_memory_bytes=ROW - 1)
    reg = AdapterRegistry(conf, holder_model(CFG), "cpu", torch.float32)
    assert not reg.enabled
    assert reg.pool.a == {} and holder_model(CFG).model.layers[0].mlp.down_proj.lora_a is None
    with pytest.raises(RequestError, match="disabled"):
        reg.acquire("r8")
    reg.close()


# ------------------------------------------------------------------------------------------ residency


def test_lru_eviction_pinning_and_identical_reload(root):
    for i, n in enumerate("abcd"):
        ad(root, n, seed=i, r=3)
    reg = make_reg([root], rows=9)  # room for three rank-3 adapters
    ra, rb, rc = get(reg, "a"), get(reg, "b"), get(reg, "c")
    key_a = ra.version
    snap_a = reg.pool.read(ra.row_start, 3)
    ref_d = ready(reg, reg.acquire("d"))
    assert not reg.activate(ref_d)  # everything pinned by active refs
    reg.deactivate(rb)
    reg.deactivate(ra)  # a is now least recently used among inactive ones... b was deactivated first
    assert reg.activate(ref_d)
    states = {d["name"]: d["state"] for d in reg.list()}
    assert states == {"a": "device", "b": "host", "c": "device", "d": "device"}  # b evicted (LRU)
    assert rows_equal_host(reg, ref_d) and rows_equal_host(reg, rc)
    # re-activating a resident one needs no copy; re-activating b evicts the LRU inactive one (a)
    reg.deactivate(rc)
    reg.deactivate(ref_d)
    assert reg.activate(rb)
    assert {d["name"]: d["state"] for d in reg.list()}["a"] == "host"
    assert reg.activate(ra)  # back: evicts c (LRU); identical rows, identical cache key
    assert ra.version == key_a
    a2, b2 = reg.pool.read(ra.row_start, 3)
    for g in snap_a[0]:
        assert torch.equal(a2[g], snap_a[0][g]) and torch.equal(b2[g], snap_a[1][g])
    assert reg.num_evictions >= 3
    for r in (ra, rb, rc, ref_d):
        reg.release(r)
    assert all(d["refs"] == 0 and d["active"] == 0 for d in reg.list())
    reg.close()


def test_host_cache_limit_and_reread_from_disk(root):
    for i, n in enumerate("abc"):
        ad(root, n, seed=i, r=4)
    reg = make_reg([root], rows=4, max_host_adapters=1)
    loads0 = reg.num_disk_loads
    ra = get(reg, "a")
    key_a = ra.version
    snap = reg.pool.read(ra.row_start, 4)
    reg.release(ra)
    rb = get(reg, "b")  # evicts a to host
    reg.release(rb)
    rc = get(reg, "c")  # evicts b to host: two on host > 1 -> a (LRU) dropped to disk
    states = {d["name"]: d["state"] for d in reg.list()}
    assert states == {"a": "disk", "b": "host", "c": "device"}
    reg.release(rc)
    ra = reg.acquire("a")
    assert not ra.ready or reg.num_disk_loads > loads0 + 3
    ready(reg, ra)
    assert reg.activate(ra) and ra.version == key_a
    a2, b2 = reg.pool.read(ra.row_start, 4)
    assert all(torch.equal(a2[g], snap[0][g]) and torch.equal(b2[g], snap[1][g]) for g in a2)
    reg.release(ra)
    # files changed on disk without reload: refused when read again (reload picks it up)
    rb = get(reg, "b")
    reg.release(rb)
    rc = get(reg, "c")
    reg.release(rc)
    assert {d["name"]: d["state"] for d in reg.list()}["a"] == "disk"
    ad(root, "a", seed=99, r=4)
    ra = reg.acquire("a")
    while ra.error is None and not ra.ready:
        reg.wait_for_loads(1)
    assert ra.error and "changed on disk" in ra.error and "reload" in ra.error
    reg.release(ra)
    reg.reload("a")
    ra = get(reg, "a")
    assert ra.version != key_a
    reg.release(ra)
    reg.close()


def test_reload_keeps_in_flight_version(root):
    ad(root, "x", seed=1, r=2)
    reg = make_reg([root])
    reg.load("x", "x")
    old = get(reg, "x")
    waiting_old = ready(reg, reg.acquire("x"))  # admitted before the reload, not yet running
    old_rows = reg.pool.read(old.row_start, 2)
    ad(root, "x2", seed=2, r=3, targets=("o_proj",))
    info = reg.reload("x", "x2")
    assert info["version"] != old.version and info["rank"] == 3
    new = get(reg, "x")
    assert new.version == info["version"] and new.version != old.version
    assert old.row_start != new.row_start and rows_equal_host(reg, new) and rows_equal_host(reg, old)
    a, b = reg.pool.read(old.row_start, 2)
    assert all(torch.equal(a[g], old_rows[0][g]) for g in a)
    # the waiting request still gets the old weights
    assert reg.activate(waiting_old) and waiting_old.version == old.version and waiting_old.row_start == old.row_start
    assert reg.info()["versions"] == 2
    reg.release(old)
    assert reg.info()["versions"] == 2
    reg.release(waiting_old)  # last ref of the old version: freed (rows and host)
    assert reg.info()["versions"] == 1
    assert reg.info()["free_rows"] == 64 - 3
    # reload with the same path also gives a new version (new prefix-cache key)
    k = new.version
    reg.release(new)
    assert reg.reload("x")["version"] != k
    reg.close()


def test_reload_in_background_switches_on_completion(root, monkeypatch):
    ad(root, "x", seed=1)
    reg = make_reg([root])
    reg.load("x", "x")
    gate = threading.Event()
    real = registry_mod.load_peft_adapter
    monkeypatch.setattr(registry_mod, "load_peft_adapter", lambda *a, **k: (gate.wait(10), real(*a, **k))[1])
    fut = reg.reload("x", wait=False)
    r1 = reg.acquire("x")  # reload not finished: still the current version
    assert r1.ready and r1.version == reg.list()[0]["version"] and reg.list()[0]["reloading"]
    with pytest.raises(RequestError, match="still loading"):
        reg.reload("x")
    gate.set()
    info = fut.result(10)
    r2 = reg.acquire("x")
    assert r2.version == info["version"] != r1.version
    reg.release(r1)
    reg.release(r2)
    reg.close()


def test_unload_with_running_request(root):
    ad(root, "u", seed=1)
    reg = make_reg([root])
    reg.load("u", "u")
    ref = get(reg, "u")
    reg.unload("u")
    assert reg.list() == []
    assert ref.ready and ref.active and rows_equal_host(reg, ref)  # undisturbed
    m = reg.build_lora_meta([ref], [3])
    assert m.row_start_cpu == [ref.row_start]
    # the directory is still under a root: a new request resolves it again, as a new version
    ref2 = ready(reg, reg.acquire("u"))
    assert ref2.version != ref.version
    reg.release(ref)
    reg.release(ref2)
    assert reg.info()["versions"] == 1
    reg.unload("u")
    assert reg.info()["versions"] == 0 and reg.info()["free_rows"] == 64
    reg.close()


def test_compaction_moves_rows_consistently(root):
    for i, n in enumerate("abcde"):
        ad(root, n, seed=i, r=2)
    ad(root, "big", seed=9, r=4)
    reg = make_reg([root], rows=8)
    ra, rb, rc, rd = (get(reg, n) for n in "abcd")
    assert [r.row_start for r in (ra, rb, rc, rd)] == [0, 2, 4, 6]
    reg.release(ra)
    reg.release(rc)  # free: nothing yet (cached); inactive: a, c
    big = ready(reg, reg.acquire("big"))
    assert reg.activate(big)  # evicts a and c -> 4 free rows, not contiguous -> compaction
    assert reg.num_compactions == 1
    # bounded: b (2 rows) moves out of the window [0, 4) into c's old rows; d stays
    assert (big.row_start, rb.row_start, rd.row_start) == (0, 4, 6) and reg.residency.moved_rows[0] == 2
    for r in (rb, rd, big):
        assert rows_equal_host(reg, r)
    meta = reg.build_lora_meta([rd, None, big, rb], [1, 2, 3, 1])
    assert meta.row_start_cpu == [rd.row_start, big.row_start, rb.row_start]
    reg.close()


def test_compaction_under_churn_moves_one_windows_holders(root):
    """Adapters of ranks 1-8 come and go in a pool of 40 rows: whenever rows are fragmented a compaction moves only
    the holders of one window of the rows asked for (fewer than they + the largest rank), the allocator's free rows
    and the holders' rows tile the pool exactly, and every holder's rows stay its host weights."""
    import random

    names = [f"c{i}" for i in range(24)]
    for i, n in enumerate(names):
        ad(root, n, seed=i, r=1 + i % 8)
    reg = make_reg([root], rows=40, max_host_adapters=64)
    res, rng = reg.residency, random.Random(0)
    held: dict[str, object] = {}
    compactions = 0
    for _ in range(300):
        name = rng.choice(names)
        if name in held and rng.random() < 0.6:
            reg.release(held.pop(name))
            continue
        if name in held:
            continue
        ref = ready(reg, reg.acquire(name))
        moved0, rank = res.moved_rows[0], ref._v.ranks[0]
        if reg.activate(ref):
            held[name] = ref
            if reg.num_compactions > compactions:
                compactions = reg.num_compactions
                assert res.moved_rows[0] - moved0 < rank + 8
        else:
            reg.release(ref)
        spans = sorted((v.rows[0], v.ranks[0]) for v in res.versions if v.rows[0] >= 0)
        spans += res.pools[0].allocator.free_ranges()
        pos = 0
        for start, n in sorted(spans):
            assert start == pos, sorted(spans)
            pos += n
        assert pos == 40
        assert all(rows_equal_host(reg, r) for r in held.values())
    assert compactions >= 5, compactions
    for r in held.values():
        reg.release(r)
    reg.close()


# ------------------------------------------------------------------------------------------ batch metadata


def test_build_lora_meta_grouping(root):
    names = [f"m{i}" for i in range(6)]
    for i, n in enumerate(names):
        ad(root, n, seed=i, r=1 + i % 3)
    reg = make_reg([root])
    refs = {n: get(reg, n) for n in names}
    extra = get(reg, "m2")  # a second request on the same version: same group
    g = torch.Generator().manual_seed(0)
    seqs = [None, "m0", "m2", None, "m5", "m2", "m1", "m0", None, "m3", "m4"]
    seq_refs = [refs[n] if n else None for n in seqs]
    seq_refs[5] = extra
    counts = torch.randint(1, 6, (len(seqs),), generator=g).tolist()
    meta = build_lora_meta(seq_refs, counts, "cpu")
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    expected = {}
    for s, n in enumerate(seqs):
        if n:
            expected.setdefault(n, []).extend(range(starts[s], starts[s + 1]))
    order = list(dict.fromkeys(n for n in seqs if n))  # groups in first-appearance order
    assert meta.num_groups == len(order) == 6
    for gi, n in enumerate(order):
        a, b = meta.seg_starts_cpu[gi], meta.seg_starts_cpu[gi + 1]
        assert meta.token_indices[a:b].tolist() == expected[n]  # stable: ascending token order
        assert meta.row_start_cpu[gi] == refs[n].row_start and meta.ranks_cpu[gi] == refs[n].rank
        assert meta.scalings_cpu[gi] == pytest.approx(refs[n].scaling)
    assert meta.token_indices.dtype == torch.int64 and meta.seg_starts.dtype == torch.int32
    assert meta.row_start.dtype == torch.int32 and meta.ranks.dtype == torch.int32
    assert meta.scalings.dtype == torch.float32
    assert meta.max_rank == 3 and meta.max_seg_len == max(len(v) for v in expected.values())
    assert build_lora_meta([None, None], [3, 1], "cpu") is None
    reg.deactivate(extra)
    with pytest.raises(RuntimeError, match="not active"):
        build_lora_meta([extra], [1], "cpu")
    reg.close()


def test_adapter_loads_open_no_second_openmp_team(tmp_path):
    """The loader thread's CPU ops run serially: loading an adapter (large enough for torch to parallelise its
    checks and copies) starts no OpenMP worker threads beside the engine's team. Those would make libgomp cut every
    team's spin-waits, so the compute threads sleep and wake at every parallel region of every later step."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)  # what threads created from now on start with
    try:
        cfg = tiny_llama_config(hidden=128, inter=2048, layers=1)
        write_raw_adapter(str(tmp_path / "big"), cfg, seed=0, r=64, alpha=64, target_modules=["down_proj"])
        spec = LoraModelSpec.from_hf_config(cfg)
        conf = EngineConfig(adapter_roots=[str(tmp_path)], max_lora_rank=64,
                            lora_memory_bytes=128 * LoraPool.row_bytes_for(spec, torch.float32, "cpu"))
        reg = AdapterRegistry(conf, None, "cpu", torch.float32, spec=spec)
        reg._executor.submit(lambda: None).result()  # the loader thread itself
        before = len(os.listdir("/proc/self/task"))
        reg.load("big")
        assert reg.info()["resident"] + reg.info()["host"] >= 1
        assert len(os.listdir("/proc/self/task")) == before
        reg.close()
    finally:
        torch.set_num_threads(prev)
