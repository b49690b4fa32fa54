"""scripts/tritonserver_local.py: a real tritonserver (from the nvidia-pytriton wheel) on 127.0.0.1, with a
trivial decoupled Python model that streams three echoes of its input."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import harness.tritonserver as tsl

REPO_ROOT = Path(__file__).resolve().parents[2]

ECHO_MODEL_PY = textwrap.dedent(
    '''
    import json
    import sys

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.n = int(json.loads(args["model_config"])["parameters"]["n_responses"]["string_value"])

        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                try:
                    text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
                    for i in range(self.n):
                        out = np.array([text[0] + f" #{i}".encode()], dtype=np.object_)
                        idx = np.array([i], dtype=np.int32)
                        prefix = np.array([sys.prefix.encode()], dtype=np.object_)
                        sender.send(pb_utils.InferenceResponse(output_tensors=[
                            pb_utils.Tensor("TEXT_OUT", out),
                            pb_utils.Tensor("INDEX", idx),
                            pb_utils.Tensor("PREFIX", prefix),
                        ]))
                except Exception as e:  # never raise after a send
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None

        def finalize(self):
            pass
    '''
)

ECHO_CONFIG = textwrap.dedent(
    """
    name: "echo"
    backend: "python"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] } ]
    output [
      { name: "TEXT_OUT", data_type: TYPE_STRING, dims: [ 1 ] },
      { name: "INDEX", data_type: TYPE_INT32, dims: [ 1 ] },
      { name: "PREFIX", data_type: TYPE_STRING, dims: [ 1 ] }
    ]
    parameters { key: "n_responses" value: { string_value: "3" } }
    instance_group [ { count: 1, kind: KIND_CPU } ]
    """
)


def _make_repo(root: Path) -> Path:
    repo = root / "models"
    model = repo / "echo"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(ECHO_MODEL_PY)
    (model / "config.pbtxt").write_text(ECHO_CONFIG)
    return repo


def _pids_with_parent(ppid: int) -> list[int]:
    return tsl._children(ppid)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = _make_repo(tmp_path_factory.mktemp("triton"))
    srv = tsl.LocalTritonServer()
    srv.start(repo, timeout=120)
    yield srv
    srv.cleanup()


def test_backend_dir_layout(tmp_path):
    fake_model = tmp_path / "model.py"
    fake_model.write_text("# loom backend placeholder\n")
    out = tsl.build_backend_dir(tmp_path / "backends", loom_model_py=fake_model)
    py = out / "python"
    assert (py / "libtriton_python.so").is_file()
    assert (py / "triton_python_backend_utils.py").is_file()
    stub = py / "triton_python_backend_stub"
    assert stub.is_file() and os.access(stub, os.X_OK)
    assert (out / "loom" / "model.py").read_text() == "# loom backend placeholder\n"
    # Idempotent, and picks up a changed model.py.
    fake_model.write_text("# changed\n")
    tsl.build_backend_dir(tmp_path / "backends", loom_model_py=fake_model)
    assert (out / "loom" / "model.py").read_text() == "# changed\n"


def test_server_env_library_path():
    env = tsl.server_env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    parts = env["LD_LIBRARY_PATH"].split(":")
    assert parts[0] == tsl.python_libdir()
    assert parts[1].endswith("nvidia_pytriton.libs")
    assert parts[-1] == "/opt/x"
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)


def test_urls_and_health(server):
    assert server.is_running() and server.pid > 0
    assert server.grpc_url.startswith("127.0.0.1:")
    assert server.http_url.startswith("127.0.0.1:")
    assert server.metrics_url.startswith("http://127.0.0.1:") and server.metrics_url.endswith("/metrics")
    assert len({server.grpc_port, server.http_port, server.metrics_port}) == 3
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/echo/ready", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        assert b"nv_inference_request_success" in r.read()
    assert server.log_path.is_file()


def test_decoupled_streaming_echo(server):
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()

    def callback(q, result=None, error=None):
        q.put((result, error))

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_model_ready("echo")
        client.start_stream(callback=partial(callback, results))
        for k, word in enumerate([b"hello", b"world"]):
            inp = grpcclient.InferInput("TEXT", [1], "BYTES")
            inp.set_data_from_numpy(np.array([word], dtype=np.object_))
            client.async_stream_infer("echo", [inp], request_id=f"r{k}", enable_empty_final_response=True)
            got = []
            while True:
                result, error = results.get(timeout=30)
                assert error is None, error
                resp = result.get_response()
                if resp.parameters.get("triton_final_response") and resp.parameters["triton_final_response"].bool_param:
                    if not resp.outputs:
                        break
                got.append(
                    (
                        result.as_numpy("TEXT_OUT")[0],
                        int(result.as_numpy("INDEX")[0]),
                        result.as_numpy("PREFIX")[0].decode(),
                    )
                )
            assert [g[0] for g in got] == [word + b" #0", word + b" #1", word + b" #2"]
            assert [g[1] for g in got] == [0, 1, 2]
            # The stub runs with this venv's interpreter settings (sees its site-packages).
            assert got[0][2] == sys.prefix
    finally:
        client.stop_stream()
        client.close()


def test_stop_is_clean(tmp_path):
    repo = _make_repo(tmp_path)
    # A region of "someone else" (present before start, not mapped by our server) must survive.
    sentinel = tsl.SHM_DIR / f"{tsl.SHM_PREFIX}loomtest_{os.getpid()}"
    sentinel.write_bytes(b"x")
    srv = tsl.LocalTritonServer()
    with srv:
        srv.start(repo, timeout=120)
        pid = srv.pid
        stubs = _pids_with_parent(pid)
        assert stubs, "the python model should run in a stub process"
        assert srv._shm_seen, "the server should map a python backend shm region"
        own_shm = set(srv._shm_seen)
    # __exit__ stopped it, and removed its work folder.
    assert srv.process is None and srv.exit_code == 0
    assert not srv.log_path.exists()
    for p in [pid] + stubs:
        assert not Path(f"/proc/{p}").exists() or _is_zombie(p), f"process {p} still alive"
    assert not (own_shm & tsl._shm_files())
    try:
        assert sentinel.exists(), "a shm file the server did not own was removed"
    finally:
        sentinel.unlink(missing_ok=True)


def test_stop_escalates_to_sigkill(tmp_path):
    repo = _make_repo(tmp_path)
    srv = tsl.LocalTritonServer()
    srv.start(repo, timeout=120)
    pid = srv.pid
    stubs = _pids_with_parent(pid)
    own_shm = set(srv._shm_seen)
    assert own_shm
    os.kill(pid, signal.SIGSTOP)  # a hung server: SIGTERM does nothing
    try:
        t0 = time.monotonic()
        code = srv.stop(timeout=1)
        assert time.monotonic() - t0 < 20
        assert code == -signal.SIGKILL
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for p in [pid] + stubs:
        assert not Path(f"/proc/{p}").exists() or _is_zombie(p), f"process {p} still alive"
    # The shm regions a killed server leaves behind are removed; nobody else's.
    assert not (own_shm & tsl._shm_files())
    srv.cleanup()


def test_start_failure_shows_log(tmp_path):
    repo = tmp_path / "bad"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "no_such_backend"\n')
    srv = tsl.LocalTritonServer()
    with pytest.raises(tsl.ServerStartError) as info:
        srv.start(repo, timeout=60)
    assert "broken" in str(info.value)
    assert srv.process is None
    srv.cleanup()


def test_cli_foreground_until_sigint(tmp_path):
    repo = _make_repo(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "scripts" / "tritonserver_local.py"), "--model-repository", str(repo),
         "--explicit", "--load-model", "echo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(lines)
        assert "grpc:    127.0.0.1:" in text, text
        server_pid = int(text.split("(pid ")[1].split(")")[0])
        http = text.split("http:    ")[1].split()[0]
        with urllib.request.urlopen(f"{http}/v2/models/echo/ready", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest
        assert "stopped" in rest
        assert not Path(f"/proc/{server_pid}").exists() or _is_zombie(server_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workdir_removed_at_exit_and_running_server_stopped(tmp_path):
    repo = _make_repo(tmp_path)
    script = textwrap.dedent(
        f"""
        import harness.tritonserver as tsl
        a = tsl.LocalTritonServer(); a.start({str(repo)!r}); a.stop()
        b = tsl.LocalTritonServer(); b.start({str(repo)!r})   # left running: stopped at exit
        print(a.log_path.parent, b.log_path.parent, b.pid, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "scripts")}  # as a script in scripts/ has it
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    dir_a, dir_b, pid_b = out.stdout.split()
    assert not Path(dir_a).exists() and not Path(dir_b).exists()
    assert not Path(f"/proc/{pid_b}").exists() or _is_zombie(int(pid_b))


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].startswith("Z")
