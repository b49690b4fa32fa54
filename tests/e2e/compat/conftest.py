"""One real tritonserver (explicit model control) for the vllm_backend-compatibility, gateway-metrics and health
tests, started once per session:

* `loom_compat`: the shipped config with vllm_backend's REPORT_CUSTOM_METRICS = true (vllm:* and the gateway's
  gauges next to loom_*), the test adapters (alpha, beta, gamma), max_num_seqs 4 so that requests wait;
* `loom_faulty`: the same weights served by a backend that wraps loom's model.py and fails every engine step with
  a sticky CUDA error once the file FAULT exists in its model folder; ENABLE_VLLM_HEALTH_CHECK = true, no vllm:*
  metrics (REPORT_CUSTOM_METRICS unset).
"""
from __future__ import annotations

import queue
import re
import shutil
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from harness.tritonserver import LocalTritonServer, build_backend_dir

REPO = Path(__file__).resolve().parents[3]
COMPAT, FAULTY = "loom_compat", "loom_faulty"
MAX_NUM_SEQS = 4

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


def _with_params(text: str, params: dict[str, str]) -> str:
    for key, value in params.items():
        pat = rf'(\{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
        if re.search(pat, text):
            text = re.sub(pat, rf'\1"{value}"', text)
        else:
            text = text.replace("parameters [\n", f'parameters [\n  {{ key: "{key}", value: {{ string_value: '
                                                  f'"{value}" }} }},\n', 1)
        assert f'"{key}", value: {{ string_value: "{value}"' in text, key
    return text


def _model(repo: Path, name: str, backend: str, params: dict[str, str]) -> Path:
    src = REPO / "model_repository" / "loom_smollm2"
    shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("adapters"))
    cfg = repo / name / "config.pbtxt"
    text = cfg.read_text().replace('name: "loom_smollm2"', f'name: "{name}"')
    text = text.replace('backend: "loom"', f'backend: "{backend}"')
    cfg.write_text(_with_params(text, params))
    return repo / name


@pytest.fixture(scope="session")
def compat_repo(tmp_path_factory, adapter_root) -> Path:
    repo = tmp_path_factory.mktemp("compat_repository")
    _model(repo, COMPAT, "loom", {"adapter_roots": str(adapter_root), "max_num_seqs": str(MAX_NUM_SEQS),
                                  "kv_cache_memory_bytes": "64MiB", "REPORT_CUSTOM_METRICS": "true"})
    _model(repo, FAULTY, "loom_faulty", {"adapter_roots": "", "kv_cache_memory_bytes": "16MiB", "metrics": "false",
                                         "ENABLE_VLLM_HEALTH_CHECK": "true", "max_failed_steps": "0"})
    return repo


@pytest.fixture(scope="session")
def compat_server(compat_repo, tmp_path_factory):
    backends = build_backend_dir(tmp_path_factory.mktemp("backends"))
    (backends / "loom_faulty").mkdir()
    (backends / "loom_faulty" / "model.py").write_text(FAULTY_MODEL_PY)
    s = LocalTritonServer()
    try:
        s.start(compat_repo, explicit=True, load_models=[COMPAT, FAULTY], backend_dir=backends, timeout=300)
    except Exception:
        print(s.log_tail(80))
        s.stop()
        raise
    yield s
    s.stop()
    print(s.log_tail(30))


class Client:
    """One gRPC stream to the compat server; results per request id."""

    def __init__(self, server, model: str = COMPAT):
        self.model = model
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.queues: dict[str, queue.Queue] = {}
        self._n = 0
        self._last = ""
        self.client.start_stream(callback=self._cb)

    def _cb(self, result=None, error=None):
        rid = result.get_response().id if result is not None else self._last
        self.queues[rid].put((result, error))

    def send(self, inputs, parameters=None, model: str | None = None) -> str:
        self._n += 1
        rid = f"c-{self._n}"
        self.queues[rid] = queue.Queue()
        self._last = rid
        self.client.async_stream_infer(model or self.model, inputs, request_id=rid, parameters=parameters,
                                       enable_empty_final_response=True)
        return rid

    def collect(self, rid: str, timeout: float = 300.0):
        """(responses with outputs, error or None) once the final response (or an error) arrived."""
        out, q = [], self.queues[rid]
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                return out, error
            resp = result.get_response()
            if resp.outputs:
                out.append(result)
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return out, None

    def run(self, inputs, parameters=None, model: str | None = None, timeout: float = 300.0):
        return self.collect(self.send(inputs, parameters, model), timeout)

    def close(self):
        self.client.stop_stream()
        self.client.close()


def texts(result) -> list[str]:
    return [t.decode() for t in result.as_numpy("text_output")]


def streamed_texts(results) -> list[str]:
    """Per completion, the concatenated deltas of a streamed request."""
    n = len(results[0].as_numpy("text_output"))
    return ["".join(texts(r)[i] for r in results) for i in range(n)]
