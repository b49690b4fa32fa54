"""Batch metadata for the LoRA layers: which tokens of a step use which adapter rows (a LoraBatchMeta per row space).

Built once per step, after the step's AdapterRegistry.activate() calls (compaction moves rows), from each
sequence's active AdapterRef and token count: per row space, the tokens grouped by adapter version, with each
group's first row, rank and scaling, copied to the device. The dataclass itself is loom.layers.forward_context's
(what the layers read); this module only fills it, so that the registry's bookkeeping and the step's tensors can be
read apart.
"""
from __future__ import annotations

from typing import Sequence

import torch

from loom.layers.forward_context import LoraBatchMeta
from loom.lora.adapter_version import DENSE, EXPERT, AdapterRef, AdapterVersion
from loom.lora.model_spec import EXPERT_PROJS, GROUP_LAYOUT, PROJ_TO_GROUP


def build_lora_meta(refs: Sequence[AdapterRef | None], num_tokens: Sequence[int], device) -> LoraBatchMeta | None:
    """LoraBatchMeta for a flattened batch: sequence i has num_tokens[i] consecutive tokens, in order.

    refs[i] is the sequence's active AdapterRef or None. The returned meta groups the tokens of adapters with dense
    rows (no group if none has any); its `experts` groups the tokens of adapters with expert rows, by their expert
    rows (None if none has any). Returns None if no token uses an adapter.
    """
    if len(refs) != len(num_tokens):
        raise ValueError(f"{len(refs)} refs but {len(num_tokens)} token counts")
    seq_versions: list[AdapterVersion | None] = []
    for ref in refs:
        if ref is not None and (not ref.active or not ref._v.resident):
            raise RuntimeError(f"adapter {ref.name!r} is not active: call activate() before building the batch")
        seq_versions.append(None if ref is None else ref._v)
    if all(v is None for v in seq_versions):
        return None
    counts = torch.tensor(list(num_tokens), dtype=torch.int64)
    device = torch.device(device)
    meta = _space_meta(seq_versions, counts, DENSE, device) or _empty_meta(device)
    meta.experts = _space_meta(seq_versions, counts, EXPERT, device)
    return meta


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    nb = device.type == "cuda"
    return (t.pin_memory() if nb else t).to(device, non_blocking=nb)


def _space_meta(seq_versions: list[AdapterVersion | None], counts: torch.Tensor, space: int,
                device: torch.device) -> LoraBatchMeta | None:
    """The grouping of one row space: tokens per adapter version with rows there (a stable argsort; one loop over
    sequences, none over tokens); None if no sequence's adapter has rows in the space."""
    group_of: dict[int, int] = {}
    seq_group = [-1] * len(seq_versions)
    targeted: set[str] = set()
    row_start: list[int] = []
    ranks: list[int] = []
    scalings: list[float] = []
    versions: list[int] = []
    for i, v in enumerate(seq_versions):
        if v is None or not v.ranks[space]:
            continue
        g = group_of.get(id(v))
        if g is None:
            g = group_of[id(v)] = len(row_start)
            row_start.append(v.rows[space])
            ranks.append(v.ranks[space])
            scalings.append(float(v.scaling))
            versions.append(v.version)
            targeted.update(GROUP_LAYOUT[PROJ_TO_GROUP[p][0]][0] for p in v.targets
                            if (p in EXPERT_PROJS) == (space == EXPERT))
        seq_group[i] = g
    if not row_start:
        return None
    tok_group = torch.repeat_interleave(torch.tensor(seq_group, dtype=torch.int64), counts)
    order = torch.argsort(tok_group, stable=True)
    num_none = int((tok_group < 0).sum())
    token_indices = order[num_none:]
    seg_counts = torch.bincount(tok_group[tok_group >= 0], minlength=len(row_start))
    seg_starts = torch.zeros(len(row_start) + 1, dtype=torch.int64)
    torch.cumsum(seg_counts, 0, out=seg_starts[1:])
    return LoraBatchMeta(
        token_indices=_to_device(token_indices.contiguous(), device),
        seg_starts=_to_device(seg_starts.to(torch.int32), device),
        row_start=_to_device(torch.tensor(row_start, dtype=torch.int32), device),
        ranks=_to_device(torch.tensor(ranks, dtype=torch.int32), device),
        scalings=_to_device(torch.tensor(scalings, dtype=torch.float32), device),
        max_rank=max(ranks),
        max_seg_len=int(seg_counts.max()),
        seg_starts_cpu=seg_starts.tolist(),
        row_start_cpu=row_start,
        ranks_cpu=ranks,
        scalings_cpu=scalings,
        versions_cpu=versions,
        module_groups=frozenset(targeted) if targeted else None,
    )


def _empty_meta(device: torch.device) -> LoraBatchMeta:
    """No token has dense rows (every adapter of the step targets experts only): the linear layers skip LoRA."""
    return LoraBatchMeta(
        token_indices=torch.zeros(0, dtype=torch.int64, device=device),
        seg_starts=torch.zeros(1, dtype=torch.int32, device=device),
        row_start=torch.zeros(0, dtype=torch.int32, device=device),
        ranks=torch.zeros(0, dtype=torch.int32, device=device),
        scalings=torch.zeros(0, dtype=torch.float32, device=device),
        max_rank=0, max_seg_len=0, seg_starts_cpu=[0], row_start_cpu=[], ranks_cpu=[], scalings_cpu=[], versions_cpu=[],
        module_groups=frozenset(),
    )
