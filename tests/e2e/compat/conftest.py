"""Client helpers for the vllm_backend-compatibility, gateway-metrics and health tests. Their models (`loom_compat`,
`loom_faulty`) are served by the session's one tritonserver (tests/e2e/conftest.py: `server`, `repo_dir`)."""
from __future__ import annotations

import queue

import tritonclient.grpc as grpcclient

from tests.e2e.conftest import COMPAT, FAULTY, MAX_NUM_SEQS  # noqa: F401  (re-exported to the tests)


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
