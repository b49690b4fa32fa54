"""Tensor parallelism across "nodes" on loopback (gloo): the engine is node 0 with rank 0, a second process
(`python -m loom.engine.tp_node --node-rank 1`, as on another host) meets it at MASTER_ADDR / MASTER_PORT, takes the
engine's configuration from the rendezvous and runs rank 1. Greedy tokens are TP=1's; a rank that dies on the other
node is named by the engine's idle health check (the serving loop's, which makes the model not ready) and its node
process exits 1; an orderly close lets the node process exit 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
import torch.distributed as dist

from harness.hf_models import make_hf_model, random_prompts
from harness.tritonserver import free_port
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import ConfigError
from loom.serving.async_engine import AsyncEngine
from tests.models.parity import GREEDY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


def start_node(port: int, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loom.engine.tp_node", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--nnodes", "2", "--node-rank", "1"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def node_workers(node: subprocess.Popen) -> list[psutil.Process]:
    return [c for c in psutil.Process(node.pid).children() if "spawn_main" in " ".join(c.cmdline())]


def test_two_nodes_on_loopback_match_tp1_and_report_a_dead_rank(tmp_path):
    model, path = make_hf_model("qwen2", tmp_path / "qwen2")
    prompts = random_prompts([5, 19, 40], model.config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=10, **GREEDY)
    kw = dict(block_size=16, kv_cache_memory_bytes=1 << 20, cpu_threads=1, max_num_batched_tokens=16)
    ref = LLM(path, **kw)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    port = free_port()
    node = start_node(port)
    llm = None
    try:
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port, **kw)
        assert llm.engine.ranks.processes == []  # rank 1 lives on the other node
        (worker,) = node_workers(node)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        # the serving loop, idle, hears of the other node's dead rank
        unhealthy = threading.Event()
        reasons: list[str] = []
        ae = AsyncEngine(llm.engine, on_unhealthy=lambda r: (reasons.append(r), unhealthy.set()))
        try:
            os.kill(worker.pid, signal.SIGKILL)
            assert node.wait(60) == 1
            assert unhealthy.wait(30), "the dead rank was not noticed"
            assert "tensor-parallel rank 1" in reasons[0] and "exited with code -9" in reasons[0], reasons
            assert ae.health() == reasons[0]
        finally:
            ae.shutdown(timeout=10)
    finally:
        if llm is not None:
            llm.engine.close()
        if node.poll() is None:
            node.kill()
        out = node.communicate(timeout=30)[0]
    assert "node 1 of 2: ranks 1..1 on cpu" in out, out[-3000:]
    assert not dist.is_initialized()


def test_an_orderly_close_ends_the_other_node(tmp_path):
    _, path = make_hf_model("llama", tmp_path / "llama")
    port = free_port()
    node = start_node(port)
    try:
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
                  kv_cache_memory_bytes=1 << 20, cpu_threads=1)
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY))[0].error is None
        llm.engine.close()
        assert node.wait(60) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_rendezvous_refusals(tmp_path):
    from loom.distributed.rendezvous import resolve
    from loom.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="nnodes: must be >= 1 and divide tensor_parallel_size 4"):
        EngineConfig(tensor_parallel_size=4, nnodes=3)
    with pytest.raises(ConfigError, match="master_port"):
        EngineConfig(master_port=70000)
    cfg = EngineConfig(tensor_parallel_size=4, nnodes=2)
    with pytest.raises(ConfigError, match="master_addr: nnodes 2 needs the address"):
        resolve(cfg, {})
    with pytest.raises(ConfigError, match="master_port: nnodes 2 needs a fixed port"):
        resolve(cfg, {"MASTER_ADDR": "10.0.0.1"})
    rdv = resolve(cfg, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert (rdv.host, rdv.port, rdv.ranks_per_node, list(rdv.node_ranks(1)), rdv.visible_devices) == \
        ("10.0.0.1", 29500, 2, [2, 3], "2,3")
    # the config wins over the environment; one node ignores both (loopback, a free port)
    both = EngineConfig(tensor_parallel_size=4, nnodes=2, master_addr="h", master_port=1234)
    assert (resolve(both, {"MASTER_ADDR": "x", "MASTER_PORT": "1"}).host, resolve(both, {}).port) == ("h", 1234)
    one = resolve(EngineConfig(tensor_parallel_size=2), {"MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert (one.host, one.port, one.nnodes) == ("127.0.0.1", 0, 1)
    # the port is taken: refused naming master_port, before anything is started
    import socket

    from loom.engine.llm_engine import LLMEngine

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                           master_port=taken.getsockname()[1])
        with pytest.raises(ConfigError, match="master_port: the rendezvous cannot listen on port"):
            LLMEngine(cfg, load_tokenizer=False)
    assert not dist.is_initialized()
