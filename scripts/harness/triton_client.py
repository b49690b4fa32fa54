"""tritonclient helpers shared by the soak script, the benchmarks and the e2e/reliability tests: vllm_backend-style
input tensors and a reader for loom's metrics on Triton's metrics port."""
from __future__ import annotations

import json
import urllib.request

import numpy as np


def tensor(name: str, value, dtype: str):
    import tritonclient.grpc as grpcclient

    arr = np.array(value, dtype=np.object_ if dtype == "BYTES" else None)
    if dtype == "BOOL":
        arr = arr.astype(bool)
    elif dtype == "INT32":
        arr = arr.astype(np.int32)
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def make_inputs(prompt=None, params: dict | None = None, stream: bool | None = True, input_ids=None,
                sp_raw: str | None = None, **flags) -> list:
    """vllm_backend-style input tensors (shared with the e2e tests); stream=None omits the tensor."""
    ins = []
    if prompt is not None:
        ins.append(tensor("text_input", [prompt.encode() if isinstance(prompt, str) else prompt], "BYTES"))
    if input_ids is not None:
        ins.append(tensor("input_ids", list(input_ids), "INT32"))
    if stream is not None:
        ins.append(tensor("stream", [stream], "BOOL"))
    if params is not None or sp_raw is not None:
        raw = sp_raw if sp_raw is not None else json.dumps(params)
        ins.append(tensor("sampling_parameters", [raw.encode()], "BYTES"))
    for k, v in flags.items():
        ins.append(tensor(k, [v], "BOOL"))
    return ins


def scrape(metrics_url: str) -> dict[str, float]:
    out = {}
    for line in urllib.request.urlopen(metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith("loom_"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def metric(snap: dict, name: str, **labels) -> float:
    total = 0.0
    for key, v in snap.items():
        base, _, lab = key.partition("{")
        if base == name and all(f'{k}="{val}"' in lab for k, val in labels.items()):
            total += v
    return total
