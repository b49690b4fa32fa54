#!/usr/bin/env bash
# The main job (README): from a fresh machine, set up, start a real tritonserver serving the default model
# with the loom backend on loopback, stream one answer without and with a LoRA adapter, then stop.
#   bash scripts/main_job.sh ["prompt"]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PROMPT="${1:-Tell me about the sea.}"
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
PYTHONPATH=scripts python - "$PROMPT" <<'PY'
import subprocess, sys
from harness.tritonserver import LocalTritonServer

prompt = sys.argv[1]
with LocalTritonServer() as server:
    print("[main job] starting tritonserver on loopback with model_repository/", flush=True)
    server.start("model_repository", timeout=300)
    print(f"[main job] tritonserver ready: gRPC {server.grpc_url}, HTTP {server.http_url}, metrics {server.metrics_url}", flush=True)
    for adapter in (None, "pirate", "robot"):
        print(f"\n[main job] streaming with adapter={adapter or '(none)'}:", flush=True)
        cmd = [sys.executable, "scripts/client.py", "--chat", prompt, "--url", server.grpc_url, "--max-tokens", "64", "--stats"]
        if adapter:
            cmd += ["--adapter", adapter]
        subprocess.run(cmd, check=True)
    print("\n[main job] stopping the server", flush=True)
PY
