"""Row allocator and device pool layout."""
from __future__ import annotations

import random

import pytest
import torch

from harness.lora import holder_model, tiny_llama_config, write_raw_adapter
from loom.kernels import cpu_ext
from loom.lora import LoraModelSpec, LoraPool, RowAllocator, load_peft_adapter
from loom.lora.lora_pool import stored_row


def test_allocator_first_fit_and_coalescing():
    a = RowAllocator(10)
    assert a.alloc(3) == 0 and a.alloc(3) == 3 and a.alloc(3) == 6
    assert a.alloc(2) is None and a.num_free == 1
    a.free(3, 3)
    assert a.free_ranges() == [(3, 3), (9, 1)]
    assert a.alloc(2) == 3  # first fit
    a.free(0, 3)
    assert a.free_ranges() == [(0, 3), (5, 1), (9, 1)]
    a.free(3, 2)  # coalesces with both neighbours
    assert a.free_ranges() == [(0, 6), (9, 1)]
    a.free(6, 3)
    assert a.free_ranges() == [(0, 10)] and a.num_free == 10 and a.largest_free == 10
    with pytest.raises(ValueError):
        a.free(0, 1)  # double free
    with pytest.raises(ValueError):
        a.alloc(0)
    a.alloc(4)
    a.take(6, 2)  # exactly these rows (a compaction's window and destinations)
    assert a.free_ranges() == [(4, 2), (8, 2)] and a.num_free == 4
    a.take(4, 2)
    a.take(9, 1)
    assert a.free_ranges() == [(8, 1)] and a.num_free == 1
    for start, n in ((7, 1), (8, 2), (0, 1), (8, 0)):
        with pytest.raises(ValueError):
            a.take(start, n)  # not free (wholly)
    assert RowAllocator(0).alloc(1) is None


def test_allocator_random_against_model():
    rng = random.Random(0)
    cap = 97
    a = RowAllocator(cap)
    used = {}  # start -> n
    for _ in range(3000):
        if used and rng.random() < 0.45:
            s = rng.choice(list(used))
            a.free(s, used.pop(s))
        elif a.num_free and rng.random() < 0.2:  # take a random run inside a free range
            fs, fl = rng.choice(a.free_ranges())
            s, n = fs + rng.randrange(fl), 1
            n = rng.randint(1, fs + fl - s)
            a.take(s, n)
            used[s] = n
        else:
            n = rng.randint(1, 12)
            s = a.alloc(n)
            occupied = [False] * cap
            for st, ln in used.items():
                for i in range(st, st + ln):
                    occupied[i] = True
            if s is None:  # no free run of n rows exists
                assert all(any(occupied[i:i + n]) for i in range(cap - n + 1))
            else:
                assert not any(occupied[s:s + n])
                # first fit: no earlier free run of n
                assert all(any(occupied[i:i + n]) for i in range(s))
                used[s] = n
        assert a.num_free == cap - sum(used.values())
        rs = a.free_ranges()
        assert all(rs[i][0] + rs[i][1] < rs[i + 1][0] for i in range(len(rs) - 1))  # sorted, coalesced


def test_pool_attach_write_read(tmp_path):
    cfg = tiny_llama_config()
    spec = LoraModelSpec.from_hf_config(cfg)
    assert spec.bytes_per_row(torch.float32) == 2 * (3 * 64 + 128 + 64 + 64 + 2 * 64 + 256 + 128 + 64) * 4
    model = holder_model(cfg)
    assert LoraModelSpec.from_model(model) == spec
    # on the CPU a row of 128 floats (8 cache lines) is stored in 144, one of 64 in 64 (kernels/cpu_lora.py pool_row)
    stored = 2 * (3 * 64 + 144 + 64 + 64 + 2 * 64 + 272 + 144 + 64) * 4
    assert spec.bytes_per_row(torch.float32, stored_row("cpu", torch.float32)) == stored
    pool = LoraPool(spec, LoraPool.capacity_for(spec, 20 * stored + 5, torch.float32, "cpu"), "cpu", torch.float32)
    assert pool.capacity == 20 and pool.row_bytes == stored and pool.nbytes == 20 * stored
    pool.attach(model)
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.lora_a.shape == (3, 20, 64) and qkv.lora_b.shape == (20, 128)
    assert qkv.lora_a.stride() == (20 * 64, 64, 1) and qkv.lora_b.stride() == (144, 1)
    assert cpu_ext.adapter_type(qkv.lora_a, qkv.lora_b) == 0  # the C++ kernels take the padded rows
    assert qkv.lora_a.data_ptr() == pool.a["qkv_proj"][1].data_ptr()
    w1 = load_peft_adapter(write_raw_adapter(str(tmp_path / "a"), cfg, 1, 4, 8, ["q_proj", "down_proj"]),
                           "a", spec, torch.float32, 64)
    w2 = load_peft_adapter(write_raw_adapter(str(tmp_path / "b"), cfg, 2, 3, 8, ["o_proj", "v_proj"]),
                           "b", spec, torch.float32, 64)
    # fill with garbage first: untargeted groups must be written as zeros
    for t in list(pool.a.values()) + list(pool.b.values()):
        t.fill_(7.0)
    pool.write(2, w1)
    pool.write(6, w2)
    a, b = pool.read(2, 4)
    torch.testing.assert_close(a["qkv_proj"], w1.a["qkv_proj"])
    torch.testing.assert_close(b["down_proj"], w1.b["down_proj"])
    assert a["o_proj"].abs().sum() == 0 and b["gate_up_proj"].abs().sum() == 0
    a, b = pool.read(6, 3)
    torch.testing.assert_close(a["o_proj"], w2.a["o_proj"])
    # other rows untouched
    assert (pool.a["qkv_proj"][:, :, 0:2] == 7).all() and (pool.a["qkv_proj"][:, :, 9:] == 7).all()
    pool.move(6, 0, 3)
    a, b = pool.read(0, 3)
    torch.testing.assert_close(b["qkv_proj"], w2.b["qkv_proj"])
    pool.move(0, 1, 3)  # overlapping move
    a, b = pool.read(1, 3)
    torch.testing.assert_close(b["qkv_proj"], w2.b["qkv_proj"])
    # the layer's views see it
    torch.testing.assert_close(model.model.layers[0].self_attn.o_proj.lora_b[1:4], w2.b["o_proj"][0])
