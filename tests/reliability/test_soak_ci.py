"""The short CI version of scripts/soak.py: 200 concurrent gRPC streams on the real server, half of the
streamed requests cancelled mid-stream, adapter churn and bad input mixed in; then every invariant."""
from __future__ import annotations

import time


def test_soak_200_streams_cancellation_storm_and_adapter_churn(server, offline, adapter_root, model_dir):
    from harness.soak import SoakConfig, format_report, offline_references, run_soak

    adapters = ("pirate", "robot")
    max_tokens = 8
    t0 = time.monotonic()
    refs = offline_references(model_dir, str(adapter_root), adapters, max_tokens, llm=offline)
    t_refs = time.monotonic() - t0
    # The short version: most of its time is the drain of the 200 requests in flight at the end, so short requests;
    # long enough for the churner's plan (load, reload, unload, list, info) on a loaded 2-core box. scripts/soak.py
    # is the long run.
    cfg = SoakConfig(url=server.grpc_url, metrics_url=server.metrics_url, duration_s=15, streams=200,
                     cancel_fraction=0.5, bad_fraction=0.05, adapters=adapters, churn_interval_s=0.1,
                     max_tokens=max_tokens, request_timeout_s=120, drain_timeout_s=30, seed=7)
    rep = run_soak(cfg, adapter_root, refs, server=server)
    print(f"offline references in {t_refs:.1f}s")
    print(format_report(rep))
    assert rep.ok, rep.failures
    assert rep.lost == 0 and rep.answered_twice == 0
    assert rep.kv_blocks_used_after_drain == 0 and rep.adapter_refs_outstanding == 0
    assert rep.cancelled > 0 and rep.finished_ok > 0 and rep.greedy_checked == rep.finished_ok
    assert rep.server_alive
