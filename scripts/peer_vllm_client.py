"""Call the vLLM peer (scripts/vllm_peer.py) from loom's venv. Stdlib only: vLLM lives in its own venv.

    from peer_vllm_client import run_vllm_peer
    res = run_vllm_peer("/work/peers/vllm-venv/bin/python", job, timeout_s=900)

The job/result protocol is described in vllm_peer.py's docstring.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

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
            # Own session, so a timeout can kill the engine-core process vLLM spawns too.
            proc = subprocess.Popen([vllm_python, str(PEER), "--job", job_path, "--out", out_path],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
