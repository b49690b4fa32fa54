"""Tensor parallelism through a real tritonserver (one server for the module, explicit model control): a tiny
Llama served twice from one repository, `tensor_parallel_size` 1 (`tp1`) and 2 (`tp2`, ENABLE_VLLM_HEALTH_CHECK).

* `tp2` streams the text `tp1` streams (greedy, float32);
* unloading `tp2` stops its worker, and loading it again leaves the server's process tree as it was;
* a worker killed mid-request ends that request with an error naming its rank, the model stops being ready (it
  unloads itself) and leaves no process behind, while `tp1` keeps serving.
"""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import tritonclient.grpc as grpcclient

from harness.model_repo import copy_model
from harness.triton_client import make_inputs
from harness.tritonserver import LocalTritonServer
from tests.e2e.compat.conftest import Client, texts

TP1, TP2 = "tp1", "tp2"
PROMPT = "The quick brown fox"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
COMMON = {"adapter_roots": "", "kv_cache_memory_bytes": "8MiB", "max_num_seqs": "4", "metrics": "false",
          "cpu_threads": "1"}


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    from harness.hf_models import save_tiny_models

    root = tmp_path_factory.mktemp("tp_serving")
    model = save_tiny_models(str(root / "models"), ["llama"])["llama"]
    repo = root / "repo"
    copy_model(repo, {**COMMON, "model": model, "tensor_parallel_size": "1"}, name=TP1)
    copy_model(repo, {**COMMON, "model": model, "tensor_parallel_size": "2", "ENABLE_VLLM_HEALTH_CHECK": "true",
                      "max_failed_steps": "0"}, name=TP2)
    s = LocalTritonServer()
    try:
        s.start(repo, explicit=True, load_models=[TP1, TP2], timeout=300,
                extra_args=["--disable-auto-complete-config"])
    except Exception:
        print(s.log_tail(80))
        s.stop()
        raise
    yield s
    s.stop()
    print(s.log_tail(30))


@pytest.fixture
def admin(tp_server):
    c = grpcclient.InferenceServerClient(tp_server.grpc_url)
    yield c
    c.close()


def tree(server) -> list[psutil.Process]:
    """The server's descendants that are still running (zombies are gone, waiting to be reaped)."""
    procs = psutil.Process(server.pid).children(recursive=True)
    return [p for p in procs if _running(p)]


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stub_of(server, model: str) -> psutil.Process:
    """The Python backend stub serving `model` (its command line names the model's folder)."""
    stubs = [p for p in psutil.Process(server.pid).children()
             if _running(p) and len(p.cmdline()) > 1 and f"/{model}/" in p.cmdline()[1]]
    assert len(stubs) == 1, [p.cmdline() for p in psutil.Process(server.pid).children()]
    return stubs[0]


def workers_of(stub: psutil.Process) -> list[psutil.Process]:
    """The stub's tensor-parallel worker processes (not multiprocessing's resource tracker)."""
    return [c for c in stub.children(recursive=True) if _running(c) and "spawn_main" in " ".join(c.cmdline())]


def wait_until(cond, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (v := cond()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return v


def stream_text(client: Client, model: str) -> str:
    res, err = client.run(make_inputs(PROMPT, GREEDY), model=model)
    assert err is None, err
    assert len(res) > 1  # streamed: one response per token or a few
    return "".join(t for r in res for t in texts(r))


def test_tp2_streams_the_text_of_tp1(tp_server):
    c = Client(tp_server, model=TP1)
    try:
        want = stream_text(c, TP1)
        assert want
        assert stream_text(c, TP2) == want
    finally:
        c.close()


def test_unload_then_load_leaves_the_process_count(tp_server, admin):
    before = {p.pid for p in tree(tp_server)}
    stub = stub_of(tp_server, TP2)
    (worker,) = workers_of(stub)
    admin.unload_model(TP2)
    assert wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE)
    assert wait_until(lambda: not _running(stub))
    admin.load_model(TP2)
    assert admin.is_model_ready(TP2)
    after = tree(tp_server)
    assert len(after) == len(before), ([p.cmdline() for p in after], before)
    assert len(workers_of(stub_of(tp_server, TP2))) == 1
    c = Client(tp_server, model=TP2)
    try:
        assert stream_text(c, TP2)
    finally:
        c.close()


def test_killed_worker_ends_requests_naming_its_rank_and_unreadies_the_model(tp_server, admin):
    count = len(tree(tp_server))
    stub = stub_of(tp_server, TP2)
    (worker,) = workers_of(stub)
    own = 1 + len([p for p in stub.children(recursive=True) if _running(p)])  # the stub, its worker and helpers
    c = Client(tp_server, model=TP2)
    try:
        rid = c.send(make_inputs(PROMPT, {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}))
        result, error = c.queues[rid].get(timeout=120)  # the first tokens: the request is in flight
        assert error is None and result.get_response().outputs
        os.kill(worker.pid, signal.SIGKILL)
        _, err = c.collect(rid, timeout=120)
        assert err is not None and "tensor-parallel rank 1" in str(err), err
        assert wait_until(lambda: not admin.is_model_ready(TP2))  # it unloads itself (health check)
    finally:
        c.close()  # Triton 2.51 finishes an unload once the streams that used the model are closed
    assert wait_until(lambda: not _running(stub))  # the stub is gone, and with it everything it started
    assert wait_until(lambda: len(tree(tp_server)) == count - own), [p.cmdline() for p in tree(tp_server)]
    c = Client(tp_server, model=TP1)
    try:
        res, err = c.run(make_inputs(PROMPT, GREEDY))  # the other model serves on
        assert err is None and res
    finally:
        c.close()
