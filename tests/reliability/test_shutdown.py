"""Server shutdown with a stream open (a server of its own: this test stops it).

Triton 2.51 (the nvidia-pytriton wheel) does not unload a model while a client keeps a gRPC stream open:
after SIGTERM it waits `--exit-timeout-secs`, logs "Exit timeout expired. Exiting immediately." and then
hangs (measured: still running 60 s later, once with "malloc(): unaligned fastbin chunk detected").
The backend cannot see that shutdown has begun (finalize() comes only after the unload), so this test
stops the server while a request streams, and the client goes away shortly after (as clients of a
stopping server do): the server must then exit cleanly within the exit timeout, finalize() must run, and
the model must unload. The engine-level part (requests open at finalize() are failed, the engine is
released, within shutdown_timeout_s) is in test_engine_faults.py.
"""
from __future__ import annotations

import signal
import threading
import time

from tests.reliability.conftest import MODEL, write_model

EXIT_TIMEOUT_S = 20


def test_sigterm_with_a_stream_open_exits_within_the_timeout_once_the_client_goes(tmp_path_factory):
    import tritonclient.grpc as grpcclient

    from harness.triton_client import make_inputs
    from harness.tritonserver import LocalTritonServer

    repo = tmp_path_factory.mktemp("shutdown_repo")
    write_model(repo, MODEL, {"adapter_roots": "", "kv_cache_memory_bytes": "64MiB", "lora_memory_bytes": "16MiB",
                              "shutdown_timeout_s": "5"})
    s = LocalTritonServer()
    # the config is complete: no auto-completion (a stub process less); the shared server covers auto_complete_config
    s.start(repo, timeout=300, extra_args=[f"--exit-timeout-secs={EXIT_TIMEOUT_S}", "--disable-auto-complete-config"])
    client = None
    try:
        got = []
        first = threading.Event()

        def cb(result=None, error=None):
            got.append((result, error))
            first.set()
        client = grpcclient.InferenceServerClient(s.grpc_url)
        client.start_stream(callback=cb)
        client.async_stream_infer(MODEL, make_inputs("Tell me a long story.", {"max_tokens": 4000, "ignore_eos": True,
                                                                             "temperature": 0}),
                                  request_id="long", enable_empty_final_response=True)
        assert first.wait(60), "no token streamed"
        t0 = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert s.process.poll() is None  # still serving the open stream
        client.stop_stream(cancel_requests=True)  # the client goes away mid-stream
        client.close()
        client = None
        code = s.process.wait(timeout=EXIT_TIMEOUT_S + 10)
        elapsed = time.monotonic() - t0
        log = s.log_text()
        print(f"exited with {code} {elapsed:.1f}s after SIGTERM")
        assert code == 0, s.log_tail(40)
        assert elapsed < EXIT_TIMEOUT_S, s.log_tail(40)
        assert "finalize: stopping the engine loop" in log
        assert f"successfully unloaded '{MODEL}'" in log
        assert "Exit timeout expired" not in log
        assert all(e is None for _, e in got[:-1])  # tokens streamed normally until the cancel
    finally:
        if client is not None:
            client.stop_stream(cancel_requests=True)
            client.close()
        s.stop(timeout=10)
