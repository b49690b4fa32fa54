#!/usr/bin/env python3
"""Run a real tritonserver (2.51, from the nvidia-pytriton wheel) on 127.0.0.1 in the foreground, with the
`loom` backend, until Ctrl-C; prints its URLs.

    python scripts/tritonserver_local.py --model-repository model_repository [--grpc-port 8001] [--explicit]
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from harness.tritonserver import LocalTritonServer, ServerStartError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a local tritonserver (from nvidia-pytriton) on 127.0.0.1.")
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--grpc-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--http-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--metrics-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--explicit", action="store_true", help="--model-control-mode=explicit")
    parser.add_argument("--load-model", action="append", default=[], help="with --explicit: load at start-up")
    parser.add_argument("--backend-dir", default=None, help="where to build the backend directory")
    parser.add_argument("--log-path", default=None)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    args, extra = parser.parse_known_args(argv)

    server = LocalTritonServer()
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.start(
            args.model_repository,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            explicit=args.explicit,
            load_models=args.load_model,
            backend_dir=args.backend_dir,
            log_path=args.log_path,
            log_verbose=args.log_verbose,
            extra_args=extra,
            timeout=args.timeout,
        )
    except ServerStartError as e:
        print(e, file=sys.stderr)
        server.stop()
        return 1
    print(f"tritonserver ready (pid {server.pid})", flush=True)
    print(f"  grpc:    {server.grpc_url}", flush=True)
    print(f"  http:    http://{server.http_url}", flush=True)
    print(f"  metrics: {server.metrics_url}", flush=True)
    print(f"  log:     {server.log_path}", flush=True)
    print("Ctrl-C stops it.", flush=True)
    code = None
    while not stopping["flag"]:
        code = server.process.poll()
        if code is not None:
            print(f"tritonserver exited on its own with code {code}; log tail:\n{server.log_tail()}", file=sys.stderr)
            break
        time.sleep(0.2)
    final = server.stop()
    print(f"tritonserver stopped (exit code {final if code is None else code})", flush=True)
    if code in (None, 0):
        server.cleanup()  # the work folder (backend dir, and the log unless --log-path) goes
        return 0
    print(f"log kept at {server.log_path}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
