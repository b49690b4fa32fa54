#!/usr/bin/env python3
"""A bounded soak of the loom backend on a real tritonserver (loopback only; stops by itself).

    python scripts/soak.py --duration 60 --streams 200 --cancel-fraction 0.5 --adapters pirate,robot

What it does, for `--duration` seconds (then it lets in-flight requests finish, drains and checks):
* starts tritonserver (scripts/tritonserver_local.py) on 127.0.0.1 with a copy of
  model_repository/loom_smollm2 whose adapter root is `--adapter-root` (default: the shipped demo adapters);
* `--streams` workers, each with its own gRPC client and stream, send greedy requests (ignore_eos, fixed
  length) one after another on the default model, with no adapter, one of `--adapters`, or the churned
  adapter `churn`; `--cancel-fraction` of them are cancelled at a random token in the first half of the
  generation (never near the last token: Triton 2.51 can crash when a cancel meets the final response),
  half of those by `stop_stream(cancel_requests=True)`, half by closing the whole client;
* a few percent of the requests are bad input (unknown parameter, bad JSON, max_tokens -1, lora_name
  "../x", unknown adapter, too many logprobs, an oversized JSON, ...), each expected to be refused with an
  error naming its field;
* one more client churns adapters through `adapter_op` requests while the others stream: `churn` is
  loaded from the first adapter's folder, reloaded from the second's and back, unloaded (requests naming
  it are then refused) and loaded again; the first adapter is reloaded in place and the second unloaded
  (requests naming it load it again on first use);
* afterwards: the counts (sent, ok, errored by message, cancelled, lost, answered twice), the server's
  own counts (`info` adapter op and the loom_* metrics): requests still active, KV blocks used, adapter
  refs outstanding, and whether the server is alive; every greedy output that was not cancelled must equal
  an offline engine run of the same prompt and adapter (for `churn`: one of its two versions, whole), and
  every cancelled one must be a prefix of it.
Exit status 0 only if every invariant holds. `--json FILE` writes the report.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from harness.model_repo import copy_model
from harness.soak import MODEL, SoakConfig, format_report, offline_references, run_soak

REPO = Path(__file__).resolve().parents[1]


def prepare_repository(dest: Path, adapter_root: Path, max_queue_size: int) -> Path:
    """A copy of model_repository/loom_smollm2 (without its demo adapters) with its adapter root pointed at
    `adapter_root`."""
    copy_model(dest, {"adapter_roots": str(adapter_root), "max_queue_size": str(max_queue_size)}, model=MODEL)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (then drain and check)")
    ap.add_argument("--streams", type=int, default=200, help="concurrent gRPC streams")
    ap.add_argument("--cancel-fraction", type=float, default=0.5)
    ap.add_argument("--bad-fraction", type=float, default=0.05, help="fraction of requests that are bad input")
    ap.add_argument("--adapters", default="pirate,robot",
                    help="comma-separated adapter folder names under --adapter-root (empty: no adapters, no churn)")
    ap.add_argument("--adapter-root", default=str(REPO / "model_repository" / MODEL / "adapters"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-churn", action="store_true")
    ap.add_argument("--no-greedy-check", action="store_true", help="skip the offline reference run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from harness.tritonserver import LocalTritonServer

    adapters = tuple(a for a in args.adapters.split(",") if a)
    root = Path(args.adapter_root).resolve()
    for a in adapters:
        if not (root / a / "adapter_config.json").is_file():
            print(f"no adapter {a!r} under {root}", file=sys.stderr)
            return 2
    from harness.default_model import ensure_default_model
    model_dir = str(ensure_default_model())
    refs = None
    if not args.no_greedy_check:
        t = time.monotonic()
        refs = offline_references(model_dir, str(root), adapters, args.max_tokens)
        print(f"[soak] offline references: {len(refs)} in {time.monotonic() - t:.1f}s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="loom-soak-"))
    server = LocalTritonServer()
    try:
        repo = prepare_repository(work / "repo", root, max(256, 2 * args.streams))
        t = time.monotonic()
        server.start(repo, timeout=300)
        print(f"[soak] server ready in {time.monotonic() - t:.1f}s at {server.grpc_url}", flush=True)
        cfg = SoakConfig(url=server.grpc_url, metrics_url=server.metrics_url, duration_s=args.duration,
                         streams=args.streams, cancel_fraction=args.cancel_fraction, bad_fraction=args.bad_fraction,
                         adapters=adapters, churn=not args.no_churn, max_tokens=args.max_tokens, seed=args.seed)
        rep = run_soak(cfg, root, refs, server=server, log=lambda m: print(m, flush=True))
        print(format_report(rep), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(asdict(rep), indent=1))
        return 0 if rep.ok else 1
    finally:
        code = server.stop(timeout=60)
        print(f"[soak] server stopped (exit code {code})", flush=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
