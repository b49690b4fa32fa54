"""Call the vLLM peer (scripts/vllm_peer.py) from loom's venv. Stdlib only: vLLM lives in its own venv.

    from peer_vllm_client import run_vllm_peer
    res = run_vllm_peer(os.environ["LOOM_VLLM_PYTHON"], job, timeout_s=900)

The job/result protocol is described in vllm_peer.py's docstring. The benchmark scripts take the venv with
--vllm-python (or LOOM_VLLM_PYTHON) and run one job per thread setting (`run_vllm_settings`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

PEER = Path(__file__).resolve().with_name("vllm_peer.py")


def run_vllm_peer(vllm_python: str, job: dict, timeout_s: float, env: dict | None = None) -> dict:
    """Run one vLLM peer job in a subprocess and return its parsed result.json.

    env: extra environment variables (e.g. LD_PRELOAD for tcmalloc). Raises RuntimeError with the tail of
    the peer's output when it fails or runs past timeout_s.
    """
    with tempfile.TemporaryDirectory(prefix="vllm_peer_") as tmp:
        job_path, out_path, log_path = (os.path.join(tmp, n) for n in ("job.json", "result.json", "log.txt"))
        with open(job_path, "w") as f:
            json.dump(job, f)
        with open(log_path, "w") as log:
            # Own session, so a timeout can kill the engine-core process vLLM spawns too. Working folder: the
            # temporary one - vLLM inspects models in `python -m` subprocesses, which put their working folder on
            # sys.path, and from this repository's root transformers then imports our kernels/ as its optional
            # `kernels` package (vLLM 0.32 with transformers 5.19: "No module named 'loom'", every model refused).
            proc = subprocess.Popen([vllm_python, str(PEER), "--job", job_path, "--out", out_path],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp,
                                    env={**os.environ, **(env or {})})
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"timeout after {timeout_s:.0f}s"
        if rc != 0 or not os.path.exists(out_path):
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"vLLM peer failed ({rc}); last output:\n{tail}")
        with open(out_path) as f:
            return json.load(f)


# ---- what the benchmark scripts share ---------------------------------------------------------------

def add_vllm_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--vllm-python", default=os.environ.get("LOOM_VLLM_PYTHON", ""),
                    help="python of a venv with vLLM's CPU build (env LOOM_VLLM_PYTHON); empty = no vLLM peer")
    ap.add_argument("--vllm-threads", nargs="+", default=["auto", "0,1"],
                    help="VLLM_CPU_OMP_THREADS_BIND settings to try, the faster is reported as vLLM (auto: compute "
                         "on one core, its engine-core busy-polls the other; 0,1: compute on both)")
    ap.add_argument("--vllm-preload", default=os.environ.get("LOOM_VLLM_PRELOAD", ""),
                    help="LD_PRELOAD for vLLM (tcmalloc and the venv's libiomp5.so, as vLLM recommends; env "
                         "LOOM_VLLM_PRELOAD)")
    ap.add_argument("--vllm-timeout", type=float, default=2400.0, help="seconds one vLLM run may take (start incl.)")


def run_vllm_settings(args, job: dict, progress: Callable[[str], None], label: str = "vllm") -> dict[str, dict]:
    """One peer run per --vllm-threads setting: {"<label> <threads>": result or {"error": ...}}."""
    env = {"LD_PRELOAD": args.vllm_preload} if args.vllm_preload else {}
    out = {}
    for threads in args.vllm_threads:
        name = f"{label} {threads}"
        progress(f"{name}: starting (compiles its model at every start: minutes)")
        t = time.perf_counter()
        try:
            res = run_vllm_peer(args.vllm_python, {**job, "threads": threads}, args.vllm_timeout, env)
        except RuntimeError as e:
            progress(f"{name} FAILED: {e}")
            out[name] = {"error": str(e)}
            continue
        res["process_s"] = time.perf_counter() - t
        progress(f"{name}: start-up {res['startup_s']:.1f}s, {res['tokens_per_s']:.1f} tok/s")
        out[name] = res
    return out


def best(results: dict[str, dict]) -> str | None:
    """The name of the fastest successful run (tokens/s)."""
    ok = {k: v for k, v in results.items() if "error" not in v}
    return max(ok, key=lambda k: ok[k]["tokens_per_s"]) if ok else None


def compute_threads(setting: str) -> int:
    """The compute threads of a VLLM_CPU_OMP_THREADS_BIND setting: "auto" leaves one of the cores this process
    may use to vLLM's engine core (as measured here: compute on one of two cores), a list such as "0,1" or "0-3"
    computes on each CPU it names. For comparisons at equal compute."""
    if setting == "auto":
        return max(1, len(os.sched_getaffinity(0)) - 1)
    n = 0
    for part in setting.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


def setting_name(results: dict[str, dict], threads: int) -> str | None:
    """The name of the successful run ("<label> <setting>") whose setting computes on `threads` threads."""
    ok = [k for k, v in results.items() if "error" not in v]
    return next((k for k in ok if compute_threads(k.rsplit(" ", 1)[-1]) == threads), None)
