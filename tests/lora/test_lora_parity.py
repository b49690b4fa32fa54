"""Mixed-adapter batches through the registry pools + kernels vs HF PEFT (one adapter at a time).

Uses a transformers Llama with forward hooks that add the multi-LoRA delta from the pools (see
lora_helpers.MixedLoraHF), so the loader layout, pool rows, scalings and batch metadata are checked
end to end without the engine. The engine-level test is in test_lora_engine.py.
"""
from __future__ import annotations

import pytest
import torch

from harness.lora import (
    ADAPTERS,
    MixedLoraHF,
    holder_model,
    load_hf,
    make_tiny_llama,
    peft_generate,
    tiny_llama_config,
    write_raw_adapter,
)
from loom.engine.config import EngineConfig
from loom.lora import AdapterRegistry, LoraModelSpec, LoraPool


@pytest.fixture(scope="module")
def setup(tiny_base, adapter_set):
    return tiny_base, str(adapter_set)


def _registry(root, cfg, memory_rows=256, **kw):
    spec = LoraModelSpec.from_hf_config(cfg)
    holders = holder_model(cfg)
    row = LoraPool.row_bytes_for(spec, torch.float32, "cpu")
    conf = EngineConfig(adapter_roots=[root], lora_memory_bytes=memory_rows * row, **kw)
    return AdapterRegistry(conf, holders, "cpu", torch.float32), holders


def _acquire_ready(reg, name):
    ref = reg.acquire(name)
    while not ref.ready:
        assert ref.error is None, ref.error
        reg.wait_for_loads(5)
    assert reg.activate(ref)
    return ref


def test_mixed_batch_matches_peft(setup):
    base, root = setup
    cfg = tiny_llama_config()
    reg, holders = _registry(root, cfg)
    hf = MixedLoraHF(load_hf(base), holders)
    names = [a[0] for a in ADAPTERS]
    # batch: every adapter once, interleaved with no-adapter rows, one adapter twice
    order = [None, "a1", "a2", None, "a3", "a4", "a5", "a6", "a7", "a8", "a9", "a3", None, "a10"]
    refs = {n: _acquire_ready(reg, n) for n in names}
    assert reg.num_resident() == len(names)
    torch.manual_seed(7)
    prompts = torch.randint(3, cfg.vocab_size, (len(order), 6))
    toks, scores = hf.generate(prompts, [refs[n] if n else None for n in order], max_new_tokens=8)
    oracle = {}
    for n in set(order):
        rows = [i for i, o in enumerate(order) if o == n]
        oracle[n] = peft_generate(base, f"{root}/{n}" if n else None, prompts[rows], max_new_tokens=8), rows
    for n, ((otoks, oscores), rows) in oracle.items():
        assert torch.equal(toks[rows], otoks), f"adapter {n}: {toks[rows].tolist()} vs PEFT {otoks.tolist()}"
        torch.testing.assert_close(scores[rows], oscores, rtol=1e-4, atol=1e-4, msg=f"adapter {n}")
    # the adapters matter: every adapter row differs from the base model on the same prompt
    _, plain_scores = hf.generate(prompts, None, max_new_tokens=1)
    for i, n in enumerate(order):
        differs = not torch.allclose(scores[i, 0], plain_scores[i, 0], atol=1e-3)
        assert differs == (n is not None), f"row {i} ({n})"
    for r in refs.values():
        reg.release(r)
    reg.close()


def test_256_distinct_adapters_in_one_step(tmp_path):
    """>= 256 distinct adapters (ranks 1..4, different targets) in one step; each row equals that adapter alone."""
    cfg = tiny_llama_config()
    base = make_tiny_llama(str(tmp_path / "base"), seed=1)
    root = tmp_path / "many"
    targets = [["q_proj"], ["v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"], ["k_proj", "down_proj"]]
    n = 260
    for i in range(n):
        write_raw_adapter(str(root / f"ad{i:03d}"), cfg, seed=i, r=1 + i % 4, alpha=2 + i % 3,
                          target_modules=targets[i % 4], scale=2.0)
    reg, holders = _registry(str(root), cfg, memory_rows=sum(1 + i % 4 for i in range(n)), max_host_adapters=n)
    hf = MixedLoraHF(load_hf(base), holders)
    refs = [_acquire_ready(reg, f"ad{i:03d}") for i in range(n)]
    assert reg.num_resident() == n and reg.info()["free_rows"] == 0
    torch.manual_seed(3)
    prompts = torch.randint(3, cfg.vocab_size, (n + 4, 5))
    batch_refs = refs + [None] * 4
    meta = reg.build_lora_meta(batch_refs, [5] * (n + 4))
    assert meta.num_groups == n and meta.max_rank == 4 and meta.token_indices.numel() == 5 * n
    logits = hf.logits(prompts, batch_refs)
    # spot-check against PEFT for a few, and against single-adapter runs for all
    for i in (0, 1, 2, 3, 129, 259):
        ptoks, pscores = peft_generate(base, str(root / f"ad{i:03d}"), prompts[i:i + 1], max_new_tokens=1)
        keep = torch.arange(cfg.vocab_size) != cfg.eos_token_id  # min_new_tokens masks eos in the oracle's scores
        torch.testing.assert_close(logits[i, -1][keep], pscores[0, 0][keep], rtol=1e-4, atol=1e-4)
    singles = torch.cat([hf.logits(prompts[i:i + 1], [refs[i]]) for i in range(n)])
    torch.testing.assert_close(logits[:n], singles, rtol=1e-4, atol=1e-4)
    plain = hf.logits(prompts[n:], None)
    torch.testing.assert_close(logits[n:], plain, rtol=1e-5, atol=1e-5)
    reg.close()
