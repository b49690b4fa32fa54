"""One tensor-parallel group: this process's rank, the world, and the collectives the model's layers call.

torch.distributed is the transport: gloo on CPU, NCCL for the model's tensors on CUDA (with a gloo group beside it
for the step headers, which are host data). The group is made once per process by `init_group` (the engine's
process is rank 0, its workers ranks 1..N-1, loom.distributed.ranks) and passed to the model's layers at
construction: no layer reads a global. `collective_s` adds up the host time spent in collectives on this rank
(on CUDA: the launch, the kernels run on the stream), for the benchmark (scripts/bench_tp.py).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

# Steps wait on the header broadcast for as long as the engine idles (hours); the model's collectives get a bound.
IDLE_TIMEOUT = timedelta(days=3650)
COLLECTIVE_TIMEOUT = timedelta(seconds=600)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot compute any more (it names the rank)."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"tensor-parallel rank {rank} {message}")
        self.rank = rank


@dataclass
class ParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    device_group: object  # ProcessGroup for tensors on `device` (NCCL on CUDA, gloo on CPU)
    cpu_group: object  # gloo ProcessGroup for host data (step headers), no collective timeout
    # rank 0: raises RankFailure if a worker process is gone (set by loom.distributed.ranks.Ranks)
    check_peers: Callable[..., None] | None = None
    collective_s: float = 0.0
    num_collectives: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @contextmanager
    def _timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.collective_s += time.perf_counter() - t0
            self.num_collectives += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place; returns it."""
        x = x.contiguous()
        with self._timed():
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Rank 0: the ranks' [rows, cols] blocks side by side, cut to `total` columns (the vocab-parallel logits);
        other ranks: x itself (their share sent to rank 0)."""
        x = x.contiguous()
        with self._timed():
            if self.rank == 0:
                parts = [torch.empty_like(x) for _ in range(self.world_size)]
                dist.gather(x, parts, dst=0, group=self.device_group)
            else:
                dist.gather(x, None, dst=0, group=self.device_group)
                return x
        return torch.cat(parts, dim=-1)[:, :total]

    def min_int(self, value: int) -> int:
        """The minimum of an integer over the ranks (the KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        with self._timed():
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (small, picklable: start-up checks), on every rank, over the host group."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast(self, t: torch.Tensor, host: bool = False) -> torch.Tensor:
        """From rank 0 to every rank, in place: the host group for headers, else the device group."""
        with self._timed():
            dist.broadcast(t, src=0, group=self.cpu_group if host else self.device_group)
        return t

    @contextmanager
    def step_guard(self):
        """Rank 0 around a step's broadcast and forward: a dead worker fails the step with an error naming its rank,
        before the first collective or in place of the transport's error. Any other failure inside is rank 0's and
        fatal too: the other ranks wait in a collective rank 0 left, out of step for good."""
        if self.check_peers is not None:
            self.check_peers()
        try:
            yield
        except RankFailure:
            raise
        except Exception as e:
            if self.check_peers is not None:
                self.check_peers(grace_s=1.0)  # a worker dying now is the likely cause: name it
            raise RankFailure(0, f"failed inside a step ({type(e).__name__}: {e}); the ranks are out of step") from e

def init_group(rank: int, world_size: int, store: dist.Store, device: torch.device) -> ParallelGroup:
    """Join the process group of `world_size` ranks meeting at `store`. One group per process (torch.distributed's
    default group): the engine refuses a second tensor-parallel engine in a process that has one."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    cpu_group = dist.group.WORLD
    if device.type == "cuda":
        device_group = dist.new_group(backend="nccl", timeout=COLLECTIVE_TIMEOUT)
    else:
        device_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return ParallelGroup(rank, world_size, device, device_group, cpu_group)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
