"""One real tritonserver (nvidia-pytriton wheel, explicit model control) for every test under tests/e2e (compat/
included), started once and stopped when they are done, plus the offline engine in this process as the reference,
and three small random LoRA adapters.

Models in its repository (copies of model_repository/loom_smollm2):
* `loom_smollm2`: the shipped config, adapter root = the test adapters (alpha, beta, gamma);
* `loom_compat`: the same with vllm_backend's REPORT_CUSTOM_METRICS = true (vllm:* and the gateway's gauges next to
  loom_*), max_num_seqs 4 so that requests wait (tests/e2e/compat);
* `loom_faulty`: the same weights served by a backend that wraps loom's model.py and fails every engine step with
  a sticky CUDA error once the file FAULT exists in its model folder; ENABLE_VLLM_HEALTH_CHECK = true, no vllm:*
  metrics (REPORT_CUSTOM_METRICS unset) (tests/e2e/compat/test_health.py).

The configs are complete, so the server skips auto-completion (one stub process less per model); the reliability
server (tests/reliability) still loads the shipped config through auto_complete_config.
"""
from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from harness import triton_client
from harness.model_repo import copy_model
from harness.triton_client import make_inputs, metric  # noqa: F401  (re-exported to the tests)
from harness.tritonserver import LocalTritonServer, build_backend_dir

MODEL = "loom_smollm2"
COMPAT, FAULTY = "loom_compat", "loom_faulty"
MAX_NUM_SEQS = 4  # loom_compat

# The faulty backend: loom's model with an injectable sticky device fault (test-only; nothing like it ships).
FAULTY_MODEL_PY = '''
import os

from loom.model import TritonPythonModel as _Loom


class TritonPythonModel(_Loom):
    def initialize(self, args):
        super().initialize(args)
        trigger = os.path.join(args["model_repository"], "FAULT")
        run = self.engine.runner.run

        def run_or_fail(*a, **kw):
            if os.path.exists(trigger):
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            return run(*a, **kw)

        self.engine.runner.run = run_or_fail
'''


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


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


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
    repo = tmp_path_factory.mktemp("model_repository")
    # copies of the shipped model folder, without its demo adapters
    copy_model(repo, {"adapter_roots": str(adapter_root)}, name=MODEL)
    copy_model(repo, {"adapter_roots": str(adapter_root), "max_num_seqs": str(MAX_NUM_SEQS),
                      "kv_cache_memory_bytes": "64MiB", "REPORT_CUSTOM_METRICS": "true"}, name=COMPAT)
    copy_model(repo, {"adapter_roots": "", "kv_cache_memory_bytes": "16MiB", "metrics": "false",
                      "ENABLE_VLLM_HEALTH_CHECK": "true", "max_failed_steps": "0"}, name=FAULTY, backend="loom_faulty")
    return repo


@pytest.fixture(scope="package")  # stopped (memory freed) when the package's tests are done
def server(repo_dir, tmp_path_factory):
    backends = build_backend_dir(tmp_path_factory.mktemp("backends"))
    (backends / "loom_faulty").mkdir()
    (backends / "loom_faulty" / "model.py").write_text(FAULTY_MODEL_PY)
    s = LocalTritonServer()
    try:
        s.start(repo_dir, explicit=True, load_models=[MODEL, COMPAT, FAULTY], backend_dir=backends, timeout=300,
                extra_args=["--disable-auto-complete-config"])
    except Exception:
        print(s.log_tail(80))
        s.stop()
        raise
    yield s
    s.stop()
    print(s.log_tail(30))


@pytest.fixture(scope="package")  # stopped (memory freed) when the package's tests are done
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


def scrape(server, model: str = MODEL) -> dict[str, float]:
    """`name{labels}` -> value for one model's loom_* series (the other models share the endpoint)."""
    return {k: v for k, v in triton_client.scrape(server.metrics_url).items() if f'model="{model}"' in k}


def wait_for(cond, timeout=20.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    return cond()
