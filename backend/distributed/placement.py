"""Which device each rank of a node computes on: the one decision, pure (tested on CPU with fake device counts).

On CUDA the ranks of a node take the GPUs visible to the process that places them (CUDA_VISIBLE_DEVICES, which
Triton sets per server and a deployment per container), local rank l on visible device base + l: base is the
engine's own device index (0 unless `device: cuda:N` or a Triton KIND_GPU instance says otherwise), so ranks never
pile up on device 0 and a second instance placed N GPUs further does not share any. Fewer visible GPUs than ranks is
a ConfigError naming tensor_parallel_size. Workers are given CUDA_VISIBLE_DEVICES as the placing process saw it and
select their device before anything initialises CUDA in them (loom.distributed.worker).
"""
from __future__ import annotations

import torch

from loom.errors import ConfigError


def rank_devices(device: torch.device, local_ranks: int, device_count: int,
                 visible: str | None = None) -> list[torch.device]:
    """The devices of a node's `local_ranks` ranks, local rank l first: all `device` on CPU; on CUDA visible device
    (device.index or 0) + l, of `device_count` visible ones (`visible`: CUDA_VISIBLE_DEVICES, for the message)."""
    if device.type != "cuda":
        return [device] * local_ranks
    base = device.index or 0
    if base + local_ranks > device_count:
        shown = "unset: every GPU" if visible is None else repr(visible)
        raise ConfigError("tensor_parallel_size", f"{local_ranks} ranks need {local_ranks} GPUs from cuda:{base}; "
                          f"{device_count} visible on this node (CUDA_VISIBLE_DEVICES {shown}): make more GPUs "
                          "visible to the instance or lower tensor_parallel_size")
    return [torch.device("cuda", base + r) for r in range(local_ranks)]


def check_instance_groups(instance_groups: list[dict], local_ranks: int, device_type: str) -> None:
    """Triton's instance_group against the ranks an instance places (CUDA only): each KIND_GPU instance takes its GPU
    and the next local_ranks - 1, and every KIND_MODEL instance GPUs 0..local_ranks - 1, so instances must not
    overlap. Raises ConfigError naming tensor_parallel_size with what to write instead."""
    if device_type != "cuda" or local_ranks <= 1:
        return
    starts: list[int] = []
    model_instances = 0
    for g in instance_groups or []:
        count = int(g.get("count", 1))
        if g.get("kind", "KIND_MODEL") in ("KIND_GPU", "KIND_AUTO") and g.get("gpus"):
            starts += [int(d) for d in g["gpus"] for _ in range(count)]
        else:
            model_instances += count
    if model_instances and (model_instances > 1 or starts):
        raise ConfigError("tensor_parallel_size", f"{model_instances} KIND_MODEL instance(s) beside "
                          f"{len(starts)} KIND_GPU ones would share GPUs 0..{local_ranks - 1}: serve one KIND_MODEL "
                          f"instance, or KIND_GPU instances on GPUs {local_ranks} apart (gpus: [0, {local_ranks}])")
    starts.sort()
    for a, b in zip(starts, starts[1:]):
        if b - a < local_ranks:
            raise ConfigError("tensor_parallel_size", f"instances on GPUs {a} and {b} would share GPUs: each takes "
                              f"{local_ranks} GPUs from its own, so list GPUs {local_ranks} apart (gpus: "
                              f"[0, {local_ranks}]) or serve one KIND_MODEL instance")
