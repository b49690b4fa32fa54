"""A tensor-parallel node beside the engine's: `python -m loom.engine.tp_node --node-rank K` on each other host.

The engine (node 0: the Triton model instance or `LLM(...)`) is configured with tensor_parallel_size, nnodes,
master_addr and master_port; every other node runs this with its node rank and the same rendezvous (flags, or the
environment's MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK as torchrun exports them). It takes the engine's
configuration from the rendezvous and starts its tensor_parallel_size / nnodes ranks (loom.distributed.node).

    python -m loom.engine.tp_node --master-addr 10.0.0.1 --master-port 29500 --nnodes 2 --node-rank 1
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master-addr", default=env.get("MASTER_ADDR", ""), help="the engine's host ($MASTER_ADDR)")
    ap.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT", 0) or 0),
                    help="the engine's master_port ($MASTER_PORT)")
    ap.add_argument("--nnodes", type=int, default=int(env.get("NNODES", 0) or 0), help="nodes in all ($NNODES)")
    ap.add_argument("--node-rank", type=int, default=int(env.get("NODE_RANK", -1) or -1),
                    help="this node, 1..nnodes-1 ($NODE_RANK)")
    ap.add_argument("--model", default="", help="the model folder on this node (default: the engine's path)")
    args = ap.parse_args(argv)
    for name in ("master_addr", "master_port", "nnodes"):
        if not getattr(args, name):
            ap.error(f"--{name.replace('_', '-')} is required (or ${name.upper()})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from loom.distributed.node import run_node
    from loom.engine.config import EngineConfig
    from loom.engine.worker.cpu import tune_mkl_for_amd
    from loom.engine.worker.model_runner import ModelRunner

    tune_mkl_for_amd()  # as the engine does before it starts its ranks (the workers inherit it)
    return run_node(args.master_addr, args.master_port, args.nnodes, args.node_rank, EngineConfig, ModelRunner,
                    args.model)


if __name__ == "__main__":
    sys.exit(main())
