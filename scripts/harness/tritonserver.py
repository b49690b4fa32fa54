"""A local Triton Inference Server (2.51, CPU) from the `nvidia-pytriton` wheel, without Docker.

The CLI is scripts/tritonserver_local.py (the server in the foreground until Ctrl-C). As a library:

    from harness.tritonserver import LocalTritonServer
    with LocalTritonServer() as server:
        server.start("model_repository")
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)

What it does (tritonserver 2.51 from the nvidia-pytriton wheel, run without Docker):
* builds a backend directory: `python/` = the wheel's Python backend plus the stub for the running Python's
  minor version beside `libtriton_python.so`, and `loom/model.py` = a copy of `backend/model.py` (the loom
  backend is a Python-based backend: models whose config says `backend: "loom"` run it);
* puts the interpreter's own LIBDIR first on LD_LIBRARY_PATH (else the stub links the system's older
  libpython), then `nvidia_pytriton.libs`; runs with the current venv's environment so the stub sees its
  site-packages;
* binds gRPC, HTTP and metrics to 127.0.0.1 on free ports, waits for /v2/health/ready;
* stops with SIGTERM to its own PID, SIGKILL after a timeout, and removes only the
  `/dev/shm/triton_python_backend_shm_region_*` files and stub processes that its own server left behind;
* keeps its work folder (backend dir, log) in /tmp until `cleanup()`, the end of a `with` block, or the
  interpreter's exit (a server that did not stop cleanly keeps its log there for a look).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOM_MODEL_PY = REPO_ROOT / "backend" / "model.py"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------------------------------
# Locating the server in the nvidia-pytriton wheel
# --------------------------------------------------------------------------------------------------

def _site_dir_of(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{package!r} is not installed: `pip install nvidia-pytriton==0.7.0` brings a tritonserver binary"
        )
    return Path(list(spec.submodule_search_locations)[0])


def tritonserver_dist_dir() -> Path:
    """`.../site-packages/pytriton/tritonserver` (bin/, backends/, python_backend_stubs/, caches/)."""
    path = _site_dir_of("pytriton") / "tritonserver"
    if not (path / "bin" / "tritonserver").is_file():
        raise RuntimeError(f"no tritonserver binary under {path}")
    return path


def tritonserver_binary() -> Path:
    return tritonserver_dist_dir() / "bin" / "tritonserver"


def tritonserver_libs_dir() -> Path:
    """`.../site-packages/nvidia_pytriton.libs` (the server's bundled shared libraries)."""
    path = _site_dir_of("pytriton").parent / "nvidia_pytriton.libs"
    if not path.is_dir():
        raise RuntimeError(f"{path} is missing")
    return path


def python_libdir() -> str:
    """The running interpreter's own lib/ folder (where its libpython lives)."""
    return sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")


def server_env(base: dict | None = None) -> dict:
    """Environment for tritonserver: the current venv's, with LD_LIBRARY_PATH = LIBDIR : pytriton libs : old."""
    env = dict(os.environ if base is None else base)
    parts = [python_libdir(), str(tritonserver_libs_dir())]
    old = env.get("LD_LIBRARY_PATH", "")
    parts += [p for p in old.split(":") if p and p not in parts]
    env["LD_LIBRARY_PATH"] = ":".join(parts)
    # The venv's bin/ first on PATH, VIRTUAL_ENV set: the stub then runs with the venv's site-packages.
    venv_bin = str(Path(sys.executable).parent)
    path_parts = [p for p in env.get("PATH", "").split(":") if p and p != venv_bin]
    env["PATH"] = ":".join([venv_bin] + path_parts)
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env.pop("PYTHONHOME", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --------------------------------------------------------------------------------------------------
# Backend directory
# --------------------------------------------------------------------------------------------------

def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.is_file():
        s, d = src.stat(), dst.stat()
        if s.st_size == d.st_size and src.read_bytes() == dst.read_bytes():
            return
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def build_backend_dir(dest: str | os.PathLike, loom_model_py: str | os.PathLike | None = None) -> Path:
    """Create (or refresh) a Triton backend directory at `dest` and return it:

    * `dest/python/`: `libtriton_python.so`, `triton_python_backend_utils.py` and the
      `triton_python_backend_stub` for this Python's minor version, beside each other;
    * `dest/loom/model.py`: a copy of `backend/model.py` as it is now (skipped, with a warning, if that
      file does not exist yet).
    """
    dest = Path(dest)
    dist = tritonserver_dist_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    py_dir = dest / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    src_py = dist / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy_if_changed(src_py / name, py_dir / name)
    _copy_if_changed(stub, py_dir / "triton_python_backend_stub")
    os.chmod(py_dir / "triton_python_backend_stub", 0o755)

    src_model = Path(loom_model_py) if loom_model_py is not None else LOOM_MODEL_PY
    if src_model.is_file():
        loom_dir = dest / "loom"
        loom_dir.mkdir(parents=True, exist_ok=True)
        _copy_if_changed(src_model, loom_dir / "model.py")
    else:
        print(f"[tritonserver_local] warning: {src_model} does not exist; no 'loom' backend", file=sys.stderr)
    return dest


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------

def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _shm_files() -> set[str]:
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def _children(pid: int) -> list[int]:
    """All descendants of `pid` (read from /proc)."""
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        try:
            by_parent.setdefault(int(fields[1]), []).append(int(entry.name))
        except (IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _mapped_shm_files(pids: list[int]) -> set[str]:
    """Names of the Python backend's shm regions that these processes map (or hold open)."""
    names: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        for line in maps.splitlines():
            idx = line.find(str(SHM_DIR / SHM_PREFIX))
            if idx >= 0:
                names.add(Path(line[idx:].split()[0]).name)
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith(str(SHM_DIR / SHM_PREFIX)):
                    names.add(Path(target.split()[0]).name)
        except OSError:
            pass
    return names


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class ServerStartError(RuntimeError):
    pass


# Servers still running at interpreter exit are stopped; work folders of servers that stopped cleanly
# (exit code 0) are removed then (kept until exit so that their logs can still be read after stop()).
_RUNNING: "weakref.WeakSet[LocalTritonServer]" = weakref.WeakSet()
_CLEAN_AT_EXIT: set[Path] = set()


@atexit.register
def _at_exit() -> None:
    for server in list(_RUNNING):
        try:
            server.stop(timeout=10)
        except Exception:
            pass
    for path in list(_CLEAN_AT_EXIT):
        shutil.rmtree(path, ignore_errors=True)
    _CLEAN_AT_EXIT.clear()


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------

class LocalTritonServer:
    """A tritonserver process bound to 127.0.0.1.

    Attributes once started: `grpc_url` and `http_url` ("127.0.0.1:PORT", the form tritonclient takes),
    `metrics_url` ("http://127.0.0.1:PORT/metrics"), `grpc_port`, `http_port`, `metrics_port`, `pid`,
    `log_path`, `backend_dir`, `model_repository`.
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.grpc_port = self.http_port = self.metrics_port = None
        self.log_path: Path | None = None
        self.backend_dir: Path | None = None
        self.model_repository: Path | None = None
        self._workdir: Path | None = None
        self._log_fh = None
        self._shm_before: set[str] = set()
        self._shm_seen: set[str] = set()
        self._own_workdir = False
        self.exit_code: int | None = None

    # ---- properties ----
    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{LOOPBACK}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # ---- start ----
    def start(
        self,
        model_repository: str | os.PathLike,
        *,
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        explicit: bool = False,
        load_models: list[str] | tuple[str, ...] = (),
        backend_dir: str | os.PathLike | None = None,
        log_path: str | os.PathLike | None = None,
        log_verbose: int = 0,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict | None = None,
        timeout: float = 120.0,
        kill_on_parent_exit: bool = True,
    ) -> "LocalTritonServer":
        """Start tritonserver and wait until /v2/health/ready answers 200 (all models at start-up loaded).

        `explicit=True` uses --model-control-mode=explicit (nothing loads until load_model; `load_models`
        are loaded at start-up). `backend_dir` defaults to a fresh one built in this server's work folder.
        Ports that are not given are picked free on 127.0.0.1 (and picked again, up to 3 tries, if one was
        taken meanwhile). Raises ServerStartError with the log's tail if the server exits or times out.
        """
        if self.is_running():
            raise RuntimeError("this server is already running")
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise FileNotFoundError(f"model repository {self.model_repository} does not exist")
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="loom-tritonserver-"))
            self._own_workdir = True
        self.backend_dir = build_backend_dir(backend_dir if backend_dir is not None else self._workdir / "backends")
        self.log_path = Path(log_path) if log_path is not None else self._workdir / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

        auto_ports = grpc_port is None or http_port is None or metrics_port is None
        attempts = 3 if auto_ports else 1
        last_error: ServerStartError | None = None
        for attempt in range(attempts):
            picked = iter(_free_ports(3))
            self.grpc_port = grpc_port or next(picked)
            self.http_port = http_port or next(picked)
            self.metrics_port = metrics_port or next(picked)
            cmd = [
                str(tritonserver_binary()),
                f"--model-repository={self.model_repository}",
                f"--backend-directory={self.backend_dir}",
                f"--cache-directory={tritonserver_dist_dir() / 'caches'}",
                f"--grpc-address={LOOPBACK}",
                f"--http-address={LOOPBACK}",
                f"--metrics-address={LOOPBACK}",
                f"--grpc-port={self.grpc_port}",
                f"--http-port={self.http_port}",
                f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true",
                "--allow-gpu-metrics=false",
                "--allow-cpu-metrics=false",
                f"--log-verbose={int(log_verbose)}",
            ]
            if explicit:
                cmd.append("--model-control-mode=explicit")
                cmd += [f"--load-model={m}" for m in load_models]
            cmd += list(extra_args)
            self._shm_before = _shm_files()
            self._shm_seen = set()
            self._log_fh = open(self.log_path, "ab")
            self._log_fh.write(f"# {' '.join(cmd)}\n".encode())
            self._log_fh.flush()
            self._log_start = self._log_fh.tell()
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_fh,
                stderr=subprocess.STDOUT,
                env=server_env(env),
                cwd=str(self._workdir),
                start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop the server in order
                preexec_fn=_set_pdeathsig if kill_on_parent_exit else None,
            )
            _RUNNING.add(self)
            try:
                self._wait_ready(timeout)
                return self
            except ServerStartError as e:
                last_error = e
                log = self.log_text()[self._log_start:] if self.log_path else ""
                self.stop(timeout=10)
                port_clash = "ddress already in use" in log or "failed to bind" in log.lower()
                if not (auto_ports and port_clash and attempt + 1 < attempts):
                    raise
        assert last_error is not None
        raise last_error

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{LOOPBACK}:{self.http_port}/v2/health/ready"
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"tritonserver exited with code {code} during start-up; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        self._remember_shm()
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"tritonserver not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def is_ready(self) -> bool:
        if not self.is_running():
            return False
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.http_port}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def _remember_shm(self) -> None:
        """Note the shm regions the server and its stubs use now (new since start), for cleanup."""
        if self.is_running():
            pids = [self.process.pid] + _children(self.process.pid)
            self._shm_seen |= _mapped_shm_files(pids) - self._shm_before

    # ---- stop ----
    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the server, wait up to `timeout` s, then SIGKILL (and kill its leftover stubs).
        Removes the shm region files that this server's processes used. Returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        code = proc.poll()
        stubs: list[int] = []
        if code is None:
            stubs = _children(proc.pid)
            self._remember_shm()
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stubs = sorted(set(stubs) | set(_children(proc.pid)))
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
                code = proc.wait(timeout=30)
        # Stubs normally exit with the server; kill only those of ours that did not.
        for pid in stubs:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in stubs:
            _reap_wait(pid, 5.0)
        for name in self._shm_seen:
            try:
                (SHM_DIR / name).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                pass
        self._shm_seen = set()
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        self.process = None
        self.exit_code = code
        _RUNNING.discard(self)
        if self._own_workdir and self._workdir is not None:
            if code == 0:
                _CLEAN_AT_EXIT.add(self._workdir)
            else:
                _CLEAN_AT_EXIT.discard(self._workdir)  # keep the log of a failed or killed server
        return code

    def cleanup(self) -> None:
        """Stop, and delete the work folder this object created (its log included)."""
        self.stop()
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            _CLEAN_AT_EXIT.discard(self._workdir)
            self._workdir = None

    # ---- context manager ----
    def __enter__(self) -> "LocalTritonServer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Keep the work folder (and its log) when the block failed, for a look at the log.
        if exc_type is None:
            self.cleanup()
        else:
            self.stop()

    def __del__(self):
        try:
            if self.is_running():
                self.stop(timeout=10)
        except Exception:
            pass


def _reap_wait(pid: int, timeout: float) -> None:
    """Wait until a (non-child) process is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat[stat.rfind(")") + 2:].startswith("Z"):
                return  # a zombie: gone, waiting for its parent to reap it
        except OSError:
            return
        time.sleep(0.05)
