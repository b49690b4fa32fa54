"""Where the ranks of a node compute (loom.distributed.placement), decided on CPU with fake device counts: local
rank r on visible GPU base + r, never all on device 0; too few GPUs and overlapping Triton instances refused naming
tensor_parallel_size; a worker gets the placing process's CUDA_VISIBLE_DEVICES before CUDA starts in it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loom.distributed.placement import check_instance_groups, rank_devices
from loom.errors import ConfigError


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


def test_rank_r_takes_visible_gpu_base_plus_r():
    assert rank_devices(torch.device("cpu"), 3, 0) == [torch.device("cpu")] * 3
    assert rank_devices(torch.device("cuda"), 2, 2) == [cuda(0), cuda(1)]
    assert rank_devices(cuda(0), 4, 8) == [cuda(0), cuda(1), cuda(2), cuda(3)]
    assert rank_devices(cuda(2), 2, 4, "4,5,6,7") == [cuda(2), cuda(3)]  # a KIND_GPU instance on GPU 2


@pytest.mark.parametrize("device, ranks, count, visible, text", [
    (torch.device("cuda"), 2, 1, "0", "2 ranks need 2 GPUs from cuda:0; 1 visible on this node "
                                      "(CUDA_VISIBLE_DEVICES '0')"),
    (cuda(3), 2, 4, None, "2 ranks need 2 GPUs from cuda:3; 4 visible on this node (CUDA_VISIBLE_DEVICES unset"),
    (torch.device("cuda"), 8, 0, "", "8 ranks need 8 GPUs from cuda:0; 0 visible"),
])
def test_fewer_visible_gpus_than_ranks_is_refused(device, ranks, count, visible, text):
    with pytest.raises(ConfigError, match="tensor_parallel_size: ") as e:
        rank_devices(device, ranks, count, visible)
    assert text in str(e.value) and "make more GPUs visible" in str(e.value)


def gpu_group(*gpus: int, count: int = 1) -> dict:
    return {"kind": "KIND_GPU", "count": count, "gpus": list(gpus)}


def test_triton_instances_must_not_share_gpus():
    model = {"kind": "KIND_MODEL", "count": 1}
    for groups in ([model], [gpu_group(0, 2)], [gpu_group(0), gpu_group(4)], []):
        check_instance_groups(groups, 2, "cuda")
    check_instance_groups([gpu_group(0, 1, count=2)], 2, "cpu")  # no GPUs to share
    check_instance_groups([gpu_group(0, 1)], 1, "cuda")  # one rank an instance
    for groups, text in (([gpu_group(0, 1)], "instances on GPUs 0 and 1 would share GPUs"),
                         ([gpu_group(2, count=2)], "instances on GPUs 2 and 2 would share GPUs"),
                         ([{"kind": "KIND_MODEL", "count": 2}], "2 KIND_MODEL instance(s) beside 0 KIND_GPU"),
                         ([model, gpu_group(2)], "1 KIND_MODEL instance(s) beside 1 KIND_GPU")):
        with pytest.raises(ConfigError, match="tensor_parallel_size: ") as e:
            check_instance_groups(groups, 2, "cuda")
        assert text in str(e.value), str(e.value)


_WORKER = """
import os, sys, torch
from multiprocessing import Pipe
from loom.distributed.rendezvous import Rendezvous
from loom.distributed.worker import worker_main
from loom.engine.config import EngineConfig

def set_device(d):
    print("visible", os.environ.get("CUDA_VISIBLE_DEVICES"), "device", d, "initialized", torch.cuda.is_initialized(),
          flush=True)
    raise SystemExit("stop here")

torch.cuda.set_device = set_device
parent, child = Pipe()
os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the worker must not keep what it inherited
worker_main(1, Rendezvous("127.0.0.1", 1, 2, 1, "3,1"), EngineConfig(device="cuda:1"), "", None, child)
"""


def test_worker_takes_the_placing_process_gpus_before_cuda_starts():
    run = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "visible 3,1 device cuda:1 initialized False" in run.stdout, run.stdout + run.stderr[-2000:]
