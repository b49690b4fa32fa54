"""A real tritonserver (nvidia-pytriton wheel) serving model_repository/loom_smollm2 with the `loom` backend,
plus the offline engine in this process as the reference, and two small random LoRA adapters."""
from __future__ import annotations

import queue
import re
import shutil
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from harness import triton_client
from harness.triton_client import make_inputs, metric  # noqa: F401  (re-exported to the tests)
from harness.tritonserver import LocalTritonServer

REPO = Path(__file__).resolve().parents[2]
MODEL = "loom_smollm2"


def make_lora(model_dir: str, out_dir: Path, seed: int, r: int = 8) -> None:
    """A random (not zero-initialised) PEFT LoRA adapter, so it visibly changes greedy output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)
    peft_model.save_pretrained(str(out_dir))


@pytest.fixture(scope="session")
def model_dir() -> str:
    from harness.default_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory, model_dir) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("alpha", "beta", "gamma")):
        make_lora(model_dir, root / name, seed=100 + i)
    return root


@pytest.fixture(scope="session")
def repo_dir(tmp_path_factory, adapter_root) -> Path:
    """A copy of the shipped model repository whose adapter root points at the test adapters."""
    repo = tmp_path_factory.mktemp("model_repository")
    shutil.copytree(REPO / "model_repository" / MODEL, repo / MODEL)
    cfg = repo / MODEL / "config.pbtxt"
    text = re.sub(r'(key: "adapter_roots", value: \{ string_value: )"[^"]*"', rf'\1"{adapter_root}"', cfg.read_text())
    assert str(adapter_root) in text
    cfg.write_text(text)
    return repo


@pytest.fixture(scope="session")
def server(repo_dir):
    s = LocalTritonServer()
    try:
        s.start(repo_dir, timeout=300)
    except Exception:
        print(s.log_tail(80))
        s.stop()
        raise
    yield s
    s.stop()
    print(s.log_tail(20))


@pytest.fixture(scope="session")
def offline(model_dir, adapter_root):
    from loom.engine.llm import LLM
    return LLM(model_dir, adapter_roots=[str(adapter_root)])


# ------------------------------------------------------------------ client helpers

class Stream:
    """One gRPC stream; results are routed per request id."""

    def __init__(self, server):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.queues: dict[str, queue.Queue] = {}
        self.client.start_stream(callback=self._cb)
        self._n = 0

    def _cb(self, result=None, error=None):
        # errors carry no request id: tests wait for a request's error before sending the next request
        rid = result.get_response().id if result is not None else self._last
        self.queues[rid].put((result, error))

    def send(self, inputs, parameters=None) -> str:
        self._n += 1
        rid = f"req-{self._n}"
        self.queues[rid] = queue.Queue()
        self._last = rid
        self.client.async_stream_infer(MODEL, inputs, request_id=rid, parameters=parameters,
                                       enable_empty_final_response=True)
        return rid

    def responses(self, rid: str, timeout: float = 120.0):
        """Yields (result, error) until the final response (or an error)."""
        q = self.queues[rid]
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                yield None, error
                return
            final = result.get_response().parameters.get("triton_final_response")
            is_final = final is not None and final.bool_param
            if result.get_response().outputs:
                yield result, None
            if is_final:
                return

    def collect(self, rid: str, timeout: float = 120.0):
        results, error = [], None
        for r, e in self.responses(rid, timeout):
            if e is not None:
                error = e
            else:
                results.append(r)
        return results, error

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def text_of(results) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in results)


def scrape(server) -> dict[str, float]:
    """`name{labels}` -> value for the loom_* series."""
    return triton_client.scrape(server.metrics_url)


def wait_for(cond, timeout=20.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    return cond()
