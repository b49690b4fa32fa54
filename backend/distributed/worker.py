"""A tensor-parallel worker process (ranks 1..N-1): its model runner over its shard, one forward per step rank 0
broadcasts, until rank 0 says stop - or dies.

Started by loom.distributed.ranks (torch.multiprocessing, spawn). The runner class arrives as an argument (the
engine's ModelRunner, pickled by reference), so this package does not import the engine. The worker leaves when
its parent goes: a thread blocks on the pipe whose other end only the parent holds, and exits the process at
end-of-file (a parent killed with SIGKILL included); a collective with a dead rank 0 fails too.
"""
from __future__ import annotations

import logging
import os
import threading
import traceback

import torch

from loom.distributed.parallel_state import destroy_group, init_group
from loom.distributed.step_broadcast import CAPTURE, STOP, recv_step
from loom.layers.forward_context import forward_context
from loom.lora.tp_pools import PeerPools

log = logging.getLogger("loom")


def _exit_with_parent(conn) -> None:
    def watch():
        try:
            while True:
                conn.recv()  # the parent never sends: this returns only at end-of-file
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="loom-tp-parent-watch", daemon=True).start()


def worker_main(rank: int, rdv, config, model_dir: str, runner_cls, conn) -> None:
    """The process's entry point. `rdv`: the rendezvous (loom.distributed.rendezvous.Rendezvous); `config`: the
    engine's EngineConfig with this rank's device."""
    _exit_with_parent(conn)
    try:
        device = torch.device(config.device)
        if device.type == "cuda":  # before anything initialises CUDA here: the GPUs the placing process saw
            if rdv.visible_devices is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = rdv.visible_devices
            torch.cuda.set_device(device)
        group = init_group(rank, rdv.world_size, rdv.store(), device)
        runner = runner_cls(config, model_dir, tp=group)
        # this rank's LoRA pools, before the warm-up as rank 0's (its adapter registry's) are
        pools = PeerPools(config, runner.model, runner.device, config.resolve_lora_dtype(runner.dtype), group.min_int)
        runner.warm_up()
        serve(runner, group, pools)
    except BaseException:  # told to rank 0 through the pipe: its error names this rank and carries this text
        try:
            conn.send(traceback.format_exc())
        except OSError:
            pass
        os._exit(1)
    finally:
        destroy_group()


@torch.inference_mode()
def serve(runner, group, pools: PeerPools) -> None:
    """Each step: receive it, make this rank's KV block copies and LoRA row writes, check the LoRA rows it reads, run
    the forward - or replay the decode graph rank 0 named (its collectives pair with rank 0's; the logits go to rank
    0, which samples)."""
    while True:
        step = recv_step(group)
        if step == STOP:
            return
        if step == CAPTURE:  # CPU tests: the emulated graph path, set up as rank 0 does
            runner.enable_graph_emulation()
            continue
        runner.copy_blocks(step.copies)
        if step.lora_updates is not None:
            pools.apply(*step.lora_updates)
        pools.check(step.ctx.lora)  # the rows the step reads hold rank 0's adapter versions
        if step.graph is not None:
            if runner.graphs is None:
                raise RuntimeError(f"rank 0 replays the decode graph {step.graph} but rank {group.rank} has no "
                                   "decode graphs (cuda_graphs differs between the ranks?)")
            runner.graphs.run_sent(step.graph, step.ids, step.ctx)
            continue
        with forward_context(step.ctx):
            runner.forward(step.ids, step.ctx.positions, step.ctx.logits_indices)
