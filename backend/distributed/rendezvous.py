"""Where the ranks meet, on one node or several: torch.distributed's env rendezvous (MASTER_ADDR / MASTER_PORT).

The engine's process is rank 0 and node 0; its TCPStore is the rendezvous. On one node it listens on loopback on a
free port. With `nnodes` > 1 it listens on `master_port` (config, else $MASTER_PORT) and the other nodes reach it at
`master_addr` (config, else $MASTER_ADDR): each runs `python -m loom.engine.tp_node --node-rank K` (loom.distributed.
node), which reads the engine's configuration from the store (so every rank runs the same one) and starts that node's
ranks. The ranks are laid out node after node: node k holds ranks k*L .. k*L + L - 1 with L = tensor_parallel_size /
nnodes, local rank r % L on the node's visible device r % L (loom.distributed.placement).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from loom.errors import ConfigError

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=600)  # how long a rank or node waits for the store (and for the engine's spec)
ENGINE_KEY = "loom/engine"  # rank 0's configuration, model folder and layout, JSON


def failure_key(node: int) -> str:
    """Where node `node`'s process reports its first dead rank: "<rank>\\t<what happened>"."""
    return f"loom/failed/node{node}"


@dataclass(frozen=True)
class Rendezvous:
    host: str  # the store's address (MASTER_ADDR)
    port: int  # its port (MASTER_PORT; 0 on one node until rank 0 has bound a free one)
    world_size: int  # tensor_parallel_size: the ranks of every node
    nnodes: int = 1
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the process that placed the node's ranks

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def store(self, master: bool = False) -> dist.TCPStore:
        """Rank 0's store (master: listening on `port`, a free one if 0) or a client of it."""
        return dist.TCPStore(self.host, self.port, self.world_size, is_master=master, timeout=STORE_TIMEOUT,
                             wait_for_workers=False)


def resolve(config, environ=None) -> Rendezvous:
    """The engine's rendezvous from its config (tensor_parallel_size, nnodes, master_addr, master_port), the
    environment's MASTER_ADDR / MASTER_PORT filling what the config leaves empty; on one node always loopback."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    n = config.nnodes
    if n == 1:
        return Rendezvous(LOOPBACK, 0, config.tensor_parallel_size, 1, visible)
    host = config.master_addr or environ.get("MASTER_ADDR", "")
    if not host:
        raise ConfigError("master_addr", f"nnodes {n} needs the address the other nodes reach this one at: set "
                          "master_addr or MASTER_ADDR")
    raw = config.master_port or environ.get("MASTER_PORT", "") or "0"
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError("master_port", f"MASTER_PORT must be a port number, got {raw!r}") from None
    if not 1 <= port <= 65535:
        raise ConfigError("master_port", f"nnodes {n} needs a fixed port for the rendezvous (1..65535): set "
                          f"master_port or MASTER_PORT, got {raw!r}")
    return Rendezvous(host, port, config.tensor_parallel_size, n, visible)


def publish_engine(store, config, model_dir: str) -> None:
    """Rank 0: what the other nodes need to start their ranks as rank 0's (read by loom.distributed.node)."""
    spec = {"config": asdict(config), "model_dir": model_dir, "nnodes": config.nnodes,
            "world_size": config.tensor_parallel_size}
    store.set(ENGINE_KEY, json.dumps(spec))


def read_engine(store) -> dict:
    return json.loads(store.get(ENGINE_KEY).decode())
