"""Reliability fixtures: a real tritonserver serving two models from one repository, an offline reference
engine, adapters (the shipped demo ones, copied) with hostile neighbours, and a tiny engine for unit tests.

Models in the server:
* `loom_smollm2` (the shipped config): adapter root = `adapter_root` below;
* `loom_limits`: the same weights with tight request bounds and a 2-block (32-token) KV cache.
"""
from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from pathlib import Path

import pytest

from harness.model_repo import copy_model

REPO = Path(__file__).resolve().parents[2]
MODEL = "loom_smollm2"
LIMITS_MODEL = "loom_limits"
DEMO_ADAPTERS = REPO / "model_repository" / MODEL / "adapters"
# SmolLM2-135M: 30 layers * 2 (K, V) * 16 tokens * 3 KV heads * 64 dims * 4 bytes = 737280 bytes per block
KV_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4

LIMITS = {  # config.pbtxt parameters of loom_limits
    "kv_cache_memory_bytes": str(2 * KV_BLOCK_BYTES),  # 2 blocks of 16 tokens
    "max_num_seqs": "4",
    "lora_memory_bytes": "16MiB",
    "max_prompt_tokens": "40",
    "max_prompt_chars": "300",
    "max_tokens_limit": "8",
    "max_logprobs": "2",
    "max_stop_items": "2",
    "max_stop_chars": "8",
    "max_parameters_bytes": "512",
    "max_request_timeout_s": "5",
}




# ------------------------------------------------------------------ adapters and repository

@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.fixture(scope="session")
def model_dir() -> str:
    from harness.default_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def outside_dir(tmp_path_factory) -> Path:
    """A valid adapter that lies OUTSIDE the adapter root (symlinks into the root point here)."""
    out = tmp_path_factory.mktemp("outside")
    shutil.copytree(DEMO_ADAPTERS / "pirate", out / "stolen")
    return out


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory, outside_dir) -> Path:
    """pirate and robot (the demo adapters), plus hostile entries:
    evil -> a symlink to an adapter folder outside the root; linkfile/ holds a symlinked weights file from
    outside; binonly/ has only a pickle adapter_model.bin."""
    root = tmp_path_factory.mktemp("adapters")
    for name in ("pirate", "robot"):
        shutil.copytree(DEMO_ADAPTERS / name, root / name, ignore=shutil.ignore_patterns("README.md"))
    (root / "evil").symlink_to(outside_dir / "stolen", target_is_directory=True)
    (root / "linkfile").mkdir()
    shutil.copy(DEMO_ADAPTERS / "pirate" / "adapter_config.json", root / "linkfile")
    (root / "linkfile" / "adapter_model.safetensors").symlink_to(outside_dir / "stolen" / "adapter_model.safetensors")
    (root / "binonly").mkdir()
    shutil.copy(DEMO_ADAPTERS / "pirate" / "adapter_config.json", root / "binonly")
    (root / "binonly" / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle; must never be loaded
    return root


def write_model(repo: Path, name: str, params: dict[str, str]) -> Path:
    """A copy of the shipped loom_smollm2 model folder as `name`, with `params` set in its config.pbtxt."""
    return copy_model(repo, params, name=name)


@pytest.fixture(scope="session")
def repo_dir(tmp_path_factory, adapter_root) -> Path:
    repo = tmp_path_factory.mktemp("model_repository")
    write_model(repo, MODEL, {"adapter_roots": str(adapter_root), "max_queue_size": "512"})
    write_model(repo, LIMITS_MODEL, {"adapter_roots": "", **LIMITS})
    return repo


@pytest.fixture(scope="package")  # stopped (memory freed) when the package's tests are done
def server(repo_dir):
    from harness.tritonserver import LocalTritonServer

    s = LocalTritonServer()
    try:
        s.start(repo_dir, timeout=300)
    except Exception:
        print(s.log_tail(80))
        s.stop()
        raise
    yield s
    code = s.stop(timeout=60)
    print(s.log_tail(10))
    assert code == 0, f"tritonserver exit code {code}"


@pytest.fixture(scope="package")  # stopped (memory freed) when the package's tests are done
def offline(model_dir, adapter_root):
    from loom.engine.llm import LLM
    return LLM(model_dir, adapter_roots=[str(adapter_root)], kv_cache_memory_bytes=256 << 20)


# ------------------------------------------------------------------ client helpers

class Stream:
    """One gRPC stream, one request in flight at a time (an error carries no request id)."""

    def __init__(self, server, model: str = MODEL):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result=None, error=None: self.q.put((result, error)))
        self.n = 0

    def send(self, inputs, parameters=None, model: str | None = None) -> str:
        self.n += 1
        rid = f"r{self.n}"
        self.client.async_stream_infer(model or self.model, inputs, request_id=rid, parameters=parameters,
                                       enable_empty_final_response=True)
        return rid

    def collect(self, timeout: float = 120.0):
        """(text, error message or None, responses) of the request in flight."""
        text, n = "", 0
        while True:
            result, error = self.q.get(timeout=timeout)
            if error is not None:
                return text, str(error), n
            resp = result.get_response()
            if resp.outputs:
                n += 1
                text += result.as_numpy("text_output")[0].decode()
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return text, None, n

    def request(self, inputs, parameters=None, timeout: float = 120.0, model: str | None = None):
        self.send(inputs, parameters, model)
        return self.collect(timeout)

    def adapter_op(self, op: str, name: str | None = None, path: str | None = None, model: str | None = None):
        params = {"adapter_op": op}
        if name is not None:
            params["lora_name"] = name
        if path is not None:
            params["lora_path"] = path
        text, err, _ = self.request(_text_only(""), params, model=model)
        return (json.loads(text) if err is None else None), err

    def close(self, cancel: bool = False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _text_only(prompt: str):
    from harness.triton_client import tensor
    return [tensor("text_input", [prompt.encode()], "BYTES")]


@pytest.fixture
def stream(server):
    s = Stream(server)
    yield s
    s.close()


def wait_for(cond, timeout=20.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    return cond()


# ------------------------------------------------------------------ a tiny engine (unit tests)

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, model_dir) -> str:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer (fast, and text in/out works)."""
    from harness.hf_models import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    make_tiny_llama(str(path), seed=0, vocab=49152, max_position_embeddings=512, pad_token_id=2)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / f).is_file():
            shutil.copy(Path(model_dir) / f, path / f)
    return str(path)


class Collector:
    """on_output for AsyncEngine: every delta of one request."""

    def __init__(self):
        self.deltas = []
        self.done = threading.Event()
        self.finals = 0

    def __call__(self, d):
        self.deltas.append(d)
        if d.finished:
            self.finals += 1
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def last(self):
        return self.deltas[-1]
