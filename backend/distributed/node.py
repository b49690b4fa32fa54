"""A node other than the engine's (node_rank >= 1): its ranks as worker processes, watched until the engine stops them.

The process (`python -m loom.engine.tp_node`) meets the engine at its rendezvous (MASTER_ADDR / MASTER_PORT), reads
the engine's configuration and model folder there (every rank runs the configuration rank 0 runs; `model` replaces
the folder where this node keeps the weights elsewhere), starts this node's ranks on its visible devices and waits.
A rank that exits with an error is reported to the engine through the store ("<rank>\\t<what happened>", read by
loom.distributed.ranks.Ranks.check), and the node's other ranks are stopped; when the engine stops its ranks they all
exit 0, and so does this process. Its workers exit with it (their pipe), and with rank 0 (a collective fails).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from multiprocessing.connection import wait

import torch

from loom.distributed import rendezvous
from loom.distributed.ranks import last_error, node_devices, spawn_context, start_worker, stop_workers
from loom.errors import ConfigError

log = logging.getLogger("loom")


def run_node(host: str, port: int, nnodes: int, node_rank: int, config_cls, runner_cls, model: str = "") -> int:
    """Serve node `node_rank`'s ranks until the engine stops them: 0, or 1 after one of them failed."""
    if not 1 <= node_rank < nnodes:
        raise ConfigError("node_rank", f"must be in [1, {nnodes - 1}] (node 0 is the engine's), got {node_rank}")
    store = rendezvous.Rendezvous(host, port, nnodes, nnodes).store()
    spec = rendezvous.read_engine(store)
    if spec["nnodes"] != nnodes:
        raise ConfigError("nnodes", f"this node says {nnodes}, the engine at {host}:{port} says {spec['nnodes']}")
    config = config_cls(**spec["config"])
    model_dir = model or spec["model_dir"]
    rdv = rendezvous.Rendezvous(host, port, spec["world_size"], nnodes, os.environ.get("CUDA_VISIBLE_DEVICES"))
    ranks = rdv.node_ranks(node_rank)
    devices = node_devices(torch.device(config.torch_device.type), len(ranks), rdv.visible_devices)
    ctx = spawn_context()
    procs, conns = [], []
    try:
        for rank, device in zip(ranks, devices):
            p, conn = start_worker(ctx, rank, rdv, replace(config, device=str(device)), model_dir, runner_cls)
            procs.append(p)
            conns.append(conn)
        log.info("node %d of %d: ranks %d..%d on %s; workers %s (rendezvous %s:%d)", node_rank, nnodes, ranks[0],
                 ranks[-1], ", ".join(map(str, devices)), [p.pid for p in procs], host, port)
        waiting = {p.sentinel: (rank, p, conn) for rank, p, conn in zip(ranks, procs, conns)}
        while waiting:
            for s in wait(list(waiting)):
                rank, p, conn = waiting.pop(s)
                p.join()
                if p.exitcode == 0:
                    continue  # stopped by the engine
                text = last_error(conn).strip()
                last = text.splitlines()[-1] if text else ""
                msg = (f"(worker pid {p.pid} on node {node_rank}, {socket.gethostname()}) exited with code "
                       f"{p.exitcode}" + (f": {last}" if last else ""))
                log.error("tensor-parallel rank %d %s", rank, msg)
                try:
                    store.set(rendezvous.failure_key(node_rank), f"{rank}\t{msg}")
                except Exception:  # noqa: BLE001 - the engine is gone too
                    pass
                return 1
        return 0
    finally:
        stop_workers(procs, conns, 0.0)
