"""The two row spaces of a MoE model (dense groups, expert groups): rows only where an adapter targets, per-space
LRU eviction that leaves the other space's rows alone, and the batch metadata of a step mixing both kinds."""
from __future__ import annotations

import time

import pytest
import torch

from harness.hf_models import make_hf_model, make_peft_adapter
from loom.engine.config import EngineConfig
from loom.lora import AdapterRegistry, LoraModelSpec, LoraPool, build_lora_meta
from loom.lora.adapter_registry import DENSE, EXPERT
from loom.models.loader import load_model

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Mixtral as loom loads it, and adapters: e1/e2 (q_proj + experts, rank 2), d1/d2 (q/v, rank 2),
    x (experts only, rank 1)."""
    tmp = tmp_path_factory.mktemp("moe")
    _, path = make_hf_model("mixtral", tmp)
    root = tmp / "adapters"
    for i, (name, r, targets, params) in enumerate([("e1", 2, ["q_proj"], EXPERTS), ("e2", 2, ["q_proj"], EXPERTS),
                                                    ("d1", 2, ["q_proj", "v_proj"], None),
                                                    ("d2", 2, ["q_proj", "v_proj"], None),
                                                    ("x", 1, [], ["mlp.experts.down_proj"])]):
        kw = {"target_parameters": params} if params else {}
        make_peft_adapter(path, str(root / name), seed=40 + i, r=r, alpha=2 * r, target_modules=targets, **kw)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), 256)
    return model, root


def _registry(moe, dense_rows, expert_rows):
    model, root = moe
    spec = LoraModelSpec.from_model(model)
    dense, expert = (LoraPool.row_bytes_for(spec.space(e), torch.float32, "cpu") for e in (False, True))
    conf = EngineConfig(adapter_roots=[str(root)], lora_memory_bytes=dense_rows * dense,
                        lora_expert_memory_bytes=expert_rows * expert)
    return AdapterRegistry(conf, model, "cpu", torch.float32)


def _get(reg, name):
    ref = reg.acquire(name)
    t0 = time.time()
    while not ref.ready:
        assert ref.error is None, ref.error
        assert time.time() - t0 < 30, "load did not finish"
        reg.wait_for_loads(0.5)
    assert reg.activate(ref)
    return ref


def _rows_hold_weights(reg, ref) -> bool:
    """Each space's rows of the version equal its host weights (zeros for groups it does not target)."""
    v = ref._v
    for space, pool in enumerate(reg.pools):
        if not v.ranks[space]:
            continue
        r = v.ranks[space]
        a, b = pool.read(v.rows[space], r)
        for g in pool.spec.groups:
            want_a = v.host.a[g.name][..., :r, :] if g.name in v.host.a else torch.zeros_like(a[g.name])
            want_b = v.host.b[g.name][..., :r, :] if g.name in v.host.b else torch.zeros_like(b[g.name])
            if not (torch.equal(a[g.name], want_a) and torch.equal(b[g.name], want_b)):
                return False
    return True


def test_rows_only_in_targeted_spaces(moe):
    reg = _registry(moe, 8, 4)
    refs = {n: _get(reg, n) for n in ("e1", "d1", "x")}
    rows = {d["name"]: d["rows"] for d in reg.list()}
    assert rows == {"e1": {"dense": 2, "expert": 2}, "d1": {"dense": 2, "expert": 0}, "x": {"dense": 0, "expert": 1}}
    info = reg.info()
    assert (info["free_rows"], info["expert_free_rows"]) == (8 - 4, 4 - 3)
    assert refs["d1"].expert_row_start == -1 and refs["x"].row_start == -1
    assert all(_rows_hold_weights(reg, r) for r in refs.values())
    for r in refs.values():
        reg.release(r)
    reg.close()


def test_eviction_in_one_space_keeps_the_other_spaces_rows(moe):
    reg = _registry(moe, 4, 2)  # dense: two rank-2 adapters; experts: one
    e1 = _get(reg, "e1")
    reg.deactivate(e1)
    e2 = _get(reg, "e2")  # the expert space is full: e1 loses its expert rows only
    assert e1._v.rows[EXPERT] == -1 and e1._v.rows[DENSE] >= 0 and reg.evictions == [0, 1]
    assert e2._v.rows == [2, 0] and _rows_hold_weights(reg, e2)
    reg.deactivate(e2)
    d1 = _get(reg, "d1")  # the dense space is full: the LRU holder there (e1) goes; no expert row moves
    assert e1._v.rows[DENSE] == -1 and reg.evictions == [1, 1] and e2._v.rows == [2, 0]
    d2 = _get(reg, "d2")  # evicts e2's dense rows; its expert rows stay
    assert e2._v.rows == [-1, 0] and reg.evictions == [2, 1]
    info = reg.info()
    assert (info["holders"], info["expert_holders"], info["expert_free_rows"]) == (2, 1, 0)
    assert [d["state"] for d in reg.list() if d["name"] == "e2"] == ["host"]  # not all of its rows: not resident
    # back: e2 needs dense rows only (one eviction there), its expert rows are reused as they are
    reg.deactivate(d1)
    writes = []
    orig = reg.expert_pool.write
    reg.expert_pool.write = lambda *a: (writes.append(a), orig(*a))
    assert reg.activate(e2)
    assert writes == [] and reg.evictions == [3, 1] and e2._v.rows[EXPERT] == 0 and _rows_hold_weights(reg, e2)
    # an adapter that gets rows in one space but not in the other waits; the rows it got stay cached
    reg.release(d2)
    ref_e1 = reg.acquire("e1")
    assert not reg.activate(ref_e1)  # dense: d2's rows (evicted); experts: e2's, pinned
    assert e1._v.rows[DENSE] >= 0 and e1._v.rows[EXPERT] == -1 and reg.evictions == [4, 1]
    with pytest.raises(RuntimeError, match="not active"):
        build_lora_meta([ref_e1], [1], "cpu")
    reg.deactivate(e2)
    assert reg.activate(ref_e1) and reg.evictions == [4, 2] and _rows_hold_weights(reg, ref_e1)
    assert e2._v.rows[DENSE] >= 0 and _rows_hold_weights(reg, ref_e1)  # e2 keeps its dense rows
    for r in (e1, e2, d1, ref_e1):
        reg.release(r)
    assert reg.info()["active"] == 0
    reg.close()


def test_meta_of_a_step_mixing_expert_dense_and_no_adapter(moe):
    reg = _registry(moe, 8, 4)
    e1, d1, x = (_get(reg, n) for n in ("e1", "d1", "x"))
    refs, counts = [x, None, e1, d1, e1, None], [2, 1, 3, 1, 2, 4]
    meta = build_lora_meta(refs, counts, "cpu")
    starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
    tokens = {id(r): [] for r in (e1, d1, x)}
    for i, r in enumerate(refs):
        if r is not None:
            tokens[id(r)].extend(range(starts[i], starts[i + 1]))
    # dense rows: e1 and d1 in first-appearance order; x has none
    assert meta.num_groups == 2 and meta.row_start_cpu == [e1.row_start, d1.row_start] and meta.ranks_cpu == [2, 2]
    assert meta.token_indices.tolist() == tokens[id(e1)] + tokens[id(d1)]
    assert meta.module_groups == frozenset({"qkv_proj"})
    ex = meta.experts  # expert rows: x and e1
    assert ex.row_start_cpu == [x.expert_row_start, e1.expert_row_start] and ex.ranks_cpu == [1, 2]
    assert ex.token_indices.tolist() == tokens[id(x)] + tokens[id(e1)] and ex.seg_starts_cpu == [0, 2, 7]
    assert ex.scalings_cpu == [pytest.approx(x.scaling), pytest.approx(e1.scaling)]
    assert ex.module_groups == frozenset({"experts_gate_up", "experts_down"})
    # dense-only steps carry no expert grouping; expert-only steps an empty dense one
    assert build_lora_meta([d1, None], [2, 2], "cpu").experts is None
    only_x = build_lora_meta([None, x], [2, 2], "cpu")
    assert only_x.num_groups == 0 and only_x.token_indices.numel() == 0 and only_x.experts.num_groups == 1
    for r in (e1, d1, x):
        reg.release(r)
    reg.close()
