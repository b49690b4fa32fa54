"""The adapter loader process (loom.lora.load_process) through the engine: other adapters' requests get a token every
step while one adapter's fetch from a slow source stalls; a corrupt adapter fails its own request only; the weights it
hands back are exactly load_peft_adapter's; a loader that died is replaced at the next load; the process is gone after
the engine closes and after the engine's process is killed. Each test starts loader processes (a fresh interpreter
importing torch, seconds): three tests, the last two without an engine."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import fsspec
import pytest
import torch

from harness.lora import peft_greedy, tiny_llama_config, write_raw_adapter
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.lora import adapter_sources as sources_mod
from loom.lora.peft_loader import load_peft_adapter

CFG = tiny_llama_config()
GREEDY = dict(temperature=0.0, ignore_eos=True)


def gone(pid: int) -> bool:
    """The process has exited (no longer listed, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


@pytest.fixture
def mem():
    root = f"/{uuid.uuid4().hex}/adapters"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root.rsplit("/", 1)[0], recursive=True)


def test_loads_in_the_process_never_stall_other_adapters(tiny_base, adapter_set, tmp_path, mem, monkeypatch):
    local = write_raw_adapter(str(tmp_path / "src" / "remote"), CFG, seed=7, r=4, alpha=8,
                              target_modules=["q_proj", "v_proj", "down_proj"])
    fs, root = fsspec.core.url_to_fs(mem)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(local, f), "rb") as fh:
            fs.pipe(f"{root}/remote/{f}", fh.read())
    bad = tmp_path / "bad"
    write_raw_adapter(str(bad / "broken"), CFG, 0, 2, 2, ["q_proj"])
    with open(bad / "broken" / "adapter_model.safetensors", "wb") as f:
        f.write(b"\x01" * 100)
    # the slow source: every transfer from it waits for the gate
    gate, real = threading.Event(), sources_mod._transfer
    monkeypatch.setattr(sources_mod, "_transfer", lambda *a: (gate.wait(60), real(*a))[1])
    llm = LLM(tiny_base, adapter_roots=[str(adapter_set), str(bad)], adapter_sources=[mem],
              adapter_cache_dir=str(tmp_path / "cache"), lora_load_process_min_bytes=0, device="cpu",
              dtype="float32", kv_cache_memory_bytes=16 << 20, max_lora_rank=16)
    eng, reg = llm.engine, llm.engine.adapters
    prompt, n = [5, 9, 14, 3, 8], 8
    p = SamplingParams(max_tokens=n, **GREEDY)
    for rid, name in (("plain", None), ("slow", "remote"), ("broken", "broken"), ("local", "a4")):
        eng.add_request(rid, prompt, p, name)
    tokens = {rid: [] for rid in ("plain", "slow", "broken", "local")}
    errors, steps_with = {}, {rid: [] for rid in tokens}
    step = 0
    deadline = time.monotonic() + 120
    while len(tokens["plain"]) < n or len(tokens["local"]) < n:
        assert time.monotonic() < deadline, f"no progress: {tokens}, {errors}"
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
            if o.new_token_ids:
                steps_with[o.request_id].append(step)
            if o.error:
                errors[o.request_id] = o.error
        if eng.last_step_request_ids == [] and reg.has_pending_loads():
            reg.wait_for_loads(0.5)  # nothing runnable: a's load is in flight in the process
        step += 1
    # from its first token on, `local` (its adapter read in the process) got one token every step, as `plain` did,
    # while the slow source held `remote` back; the corrupt adapter failed its own request only, naming the problem
    first = steps_with["local"][0]
    assert steps_with["local"] == list(range(first, first + n))
    assert tokens["slow"] == [] and eng.has_unfinished_requests()
    assert "broken" in errors and "not a valid safetensors" in errors["broken"] and tokens["broken"] == []
    assert tokens["local"] == peft_greedy(tiny_base, str(adapter_set / "a4"), [prompt], n)[0][0]
    # what the process handed back is exactly the in-process layout (not a copy of it: a mapping of the child's file)
    pid = reg.loader_pid
    assert pid is not None and pid != os.getpid()
    # at the CPU priority load_process.NICE sets relative to the engine's (before its imports, by its boot line)
    from loom.lora.load_process import NICE

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + NICE)
    ref = reg.acquire("a4")
    want = load_peft_adapter(str(adapter_set / "a4"), "a4", reg.spec, torch.float32, 16)
    got = ref._v.host
    assert (got.rank, got.scaling, got.ranks, got.content_hash) == (want.rank, want.scaling, want.ranks,
                                                                      want.content_hash)
    assert set(got.a) == set(want.a) and all(torch.equal(got.a[g], want.a[g]) and torch.equal(got.b[g], want.b[g])
                                             for g in want.a)
    reg.release(ref)
    gate.set()
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
        if eng.last_step_request_ids == [] and reg.has_pending_loads():
            reg.wait_for_loads(0.5)
    assert tokens["slow"] == peft_greedy(tiny_base, local, [prompt], n)[0][0]
    # a loader that died between loads is replaced at the next one (that load is not failed for it)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora_names=["a1"])[0]
    assert out.error is None and len(out.token_ids) == 2
    pid2 = reg.loader_pid
    assert pid2 not in (None, pid)
    llm.close()
    assert wait_gone(pid2), "the loader process outlived the engine's close()"


def test_loader_process_exits_when_the_engine_process_is_killed(tmp_path):
    write_raw_adapter(str(tmp_path / "a"), CFG, seed=0, r=2, alpha=4, target_modules=["q_proj"])
    engine = textwrap.dedent(f"""
        import time, torch
        from harness.lora import tiny_llama_config
        from loom.lora import LoraModelSpec
        from loom.lora.load_process import LoaderProcess
        from loom.lora.peft_config import read_adapter_config
        path = {str(tmp_path / "a")!r}
        lp = LoaderProcess(LoraModelSpec.from_hf_config(tiny_llama_config()), torch.float32, 16)
        w = lp.load(path, "a", read_adapter_config(path, "a", 16))
        print(lp.pid, sorted(w.a), flush=True)
        time.sleep(120)
    """)
    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
    proc = subprocess.Popen([sys.executable, "-c", engine], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.abspath(scripts)})
    try:
        line = proc.stdout.readline().split(maxsplit=1)
        assert len(line) == 2 and line[1] != "[]", line  # its pid, and the groups it loaded
        child = int(line[0])
        assert not gone(child)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(child), "the loader process outlived the engine's process"


def test_arena_slots_are_reused_zeroed_and_freed_with_their_tensors(tmp_path):
    """The loader lays adapters out in slots of the engine's arena (loom.lora.load_arena): a slot is free again once
    the last tensor viewing it is gone, a later load written into it (q_proj only, after one on all projections) reads
    back exactly as load_peft_adapter lays it out (zeros where it targets nothing: nothing of the earlier adapter
    left), and a chunk emptied while a newer one exists is closed."""
    import gc

    import torch

    from loom.lora import LoraModelSpec
    from loom.lora.load_process import LoaderProcess
    from loom.lora.peft_config import read_adapter_config

    cfg = tiny_llama_config()
    spec = LoraModelSpec.from_hf_config(cfg)
    full = write_raw_adapter(str(tmp_path / "full"), cfg, seed=1, r=8, alpha=16,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    q_only = write_raw_adapter(str(tmp_path / "q"), cfg, seed=2, r=8, alpha=16, target_modules=["q_proj"])
    lp = LoaderProcess(spec, torch.float32, 16)
    lp.arena.chunk_bytes = 1 << 16  # small chunks: a few slots each, so that chunks fill, empty and close here
    try:
        def load(path, name):
            return lp.load(path, name, read_adapter_config(path, name, 16))

        first = load(full, "full")
        base = first.a["qkv_proj"].data_ptr()
        del first
        gc.collect()
        reused = load(q_only, "q")  # written where `full` was (its slot free with its tensors)
        assert reused.a["qkv_proj"].data_ptr() == base
        want = load_peft_adapter(q_only, "q", spec, torch.float32, 16)
        assert set(reused.a) == set(want.a)  # k / v slices zero: nothing of `full` left
        assert all(torch.equal(reused.a[g], want.a[g]) and torch.equal(reused.b[g], want.b[g]) for g in want.a)
        view = reused.a["qkv_proj"][0]
        del reused
        gc.collect()
        other = load(q_only, "q2")  # the slot is still viewed: another one
        assert other.a["qkv_proj"].data_ptr() != base
        del view
        gc.collect()
        assert load(q_only, "q3").a["qkv_proj"].data_ptr() == base  # free with its last view
        many = [load(full, f"full{i}") for i in range(6)]  # several chunks
        grown = lp.arena.bytes()
        del many
        gc.collect()
        load(q_only, "q")  # an alloc closes the emptied chunks but the newest
        assert lp.arena.bytes() < grown
    finally:
        lp.close()
