"""A sticky device fault injected into a real tritonserver's engine: the model stops being ready (vllm_backend's
ENABLE_VLLM_HEALTH_CHECK: it unloads itself under explicit model control), its requests fail with the cause,
and the other model on the server keeps serving (the fleet routes around the broken one)."""
from __future__ import annotations

import time

import tritonclient.grpc as grpcclient

from harness.triton_client import make_inputs
from tests.e2e.compat.conftest import COMPAT, FAULTY, Client, texts

PROMPT = "In this example,"
PARAMS = {"max_tokens": 6, "temperature": "0", "top_p": "1"}


def ready(admin, model: str) -> tuple[bool, bool]:
    """(is_model_ready, the repository index says READY), the two ways vllm_backend's health test asks."""
    states = [m.state for m in admin.get_model_repository_index().models if m.name == model]
    return admin.is_model_ready(model), states == ["READY"]


def test_sticky_device_fault_makes_the_model_unready(server, repo_dir):
    admin = grpcclient.InferenceServerClient(server.grpc_url)
    c = Client(server, model=FAULTY)
    try:
        for _ in range(2):  # healthy: it serves and stays ready
            assert ready(admin, FAULTY) == (True, True)
            res, err = c.run(make_inputs(PROMPT, PARAMS))
            assert err is None and "".join(t for r in res for t in texts(r)), err
        (repo_dir / FAULTY / "FAULT").write_text("sticky")
        _, err = c.run(make_inputs(PROMPT, PARAMS))
        assert err is not None and "illegal memory access" in str(err), err
        deadline = time.monotonic() + 60
        while ready(admin, FAULTY) != (False, False) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready(admin, FAULTY) == (False, False)
        _, err = c.run(make_inputs(PROMPT, PARAMS))
        assert err is not None and "unknown model" in str(err), err
        # the other model on the same server is untouched
        assert ready(admin, COMPAT) == (True, True)
        res, err = c.run(make_inputs(PROMPT, PARAMS), model=COMPAT)
        assert err is None and res
    finally:
        c.close()
        admin.close()
