"""A step's inputs from rank 0 to the other ranks: a fixed header of sizes on the host group, then one int64
payload on the device group.

Rank 0 prepares the step as without tensor parallelism (loom.engine.worker.model_runner) and sends what its forward
context holds - input ids, positions, slot mapping, logits rows, the decode and prefill attention metadata - and
the KV block copies queued since the last step (n > 1 forks copy a partly filled block: every rank copies its own
heads). On CUDA the payload is built and sent on the device (NCCL), after the input ids are complete there (async
scheduling fills them on the device), so sending needs no host sync.

A step with LoRA adds a host message after the header: the adapter grouping of both row spaces (LoraBatchMeta: its
groups' first rows, ranks, scalings, targeted module groups; its token indices travel in the payload) and the pool
rows rank 0 wrote or moved since the last step (loom.lora.tp_pools), whose weights follow the payload as bytes on the
device group. A worker repeats those writes before the step's forward, so the rows the step reads hold on every rank
the adapter versions they hold on rank 0.

A decode step rank 0 serves from a CUDA graph (loom.engine.worker.cuda_graphs) names in the header the graph's bucket
and LoRA key, and its payload is the bucket's padded rows: every worker replays its graph of the same bucket and key
(the collectives captured inside pair with rank 0's). CAPTURE (CPU tests) tells the workers to set up the graph path
as rank 0 does, in the same order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from loom.distributed.parallel_state import ParallelGroup
from loom.layers.forward_context import AttentionMeta, ForwardContext, LoraBatchMeta
from loom.lora.model_spec import GROUP_LAYOUT

HEADER_LEN = 16
STEP, STOP, CAPTURE = 0, 1, 2
# header fields
(_OP, _T, _ROWS, _DEC, _PRE, _WIDTH, _DEC_Q, _DEC_K, _PRE_Q, _PRE_K, _COPIES, _LEN, _LORA, _LORA_BYTES, _GRAPH,
 _GRAPH_KEY) = range(HEADER_LEN)
_GROUPS = tuple(name for name, *_ in GROUP_LAYOUT)  # LoraBatchMeta.module_groups as a bit mask

# a decode graph: (its batch-size bucket, its LoRA key: the module groups it applies LoRA to, None = no LoRA)
GraphKey = tuple[int, frozenset | None]

# (pool rows written / moved as integers, their weights as bytes or None): loom.lora.tp_pools
LoraUpdates = tuple[list[int], torch.Tensor | None]


def _meta_parts(meta: AttentionMeta | None) -> list[torch.Tensor]:
    if meta is None:
        return []
    return [meta.cu_seqlens_q, meta.seq_lens, meta.block_tables.reshape(-1)]


def _lora_ints(meta: LoraBatchMeta | None) -> list[int]:
    """One row space's grouping as host integers (scalings as their float64 bits; versions 0 where unknown)."""
    if meta is None:
        return [0]
    g = meta.num_groups
    mask = -1 if meta.module_groups is None else _mask(meta.module_groups)
    bits = torch.tensor(meta.scalings_cpu, dtype=torch.float64).view(torch.int64).tolist()
    return [1, g, meta.token_indices.shape[0], meta.max_rank, meta.max_seg_len, mask, *meta.seg_starts_cpu,
            *meta.row_start_cpu, *meta.ranks_cpu, *bits, *(meta.versions_cpu or [0] * g)]


def _mask(groups) -> int:
    return sum(1 << i for i, n in enumerate(_GROUPS) if n in groups)


def _groups(mask: int) -> frozenset:
    return frozenset(n for i, n in enumerate(_GROUPS) if mask >> i & 1)


def _lora_meta(ints: list[int], tokens: list[torch.Tensor], device: torch.device) -> LoraBatchMeta | None:
    """_lora_ints read back (consumed from the front of `ints`; the token indices from the front of `tokens`)."""
    if not ints.pop(0):
        return None
    g, _, max_rank, max_seg, mask = (ints.pop(0) for _ in range(5))
    seg, rows, ranks, bits, versions = (ints[:g + 1], *(ints[k * g + 1:(k + 1) * g + 1] for k in range(1, 5)))
    del ints[:5 * g + 1]
    scalings = torch.tensor(bits, dtype=torch.int64).view(torch.float64).tolist()
    i32 = dict(dtype=torch.int32, device=device)
    return LoraBatchMeta(
        token_indices=tokens.pop(0), seg_starts=torch.tensor(seg, **i32), row_start=torch.tensor(rows, **i32),
        ranks=torch.tensor(ranks, **i32), scalings=torch.tensor(scalings, dtype=torch.float32, device=device),
        max_rank=max_rank, max_seg_len=max_seg, seg_starts_cpu=seg, row_start_cpu=rows, ranks_cpu=ranks,
        scalings_cpu=scalings, versions_cpu=versions,
        module_groups=None if mask < 0 else _groups(mask))


def send_step(group: ParallelGroup, ids: torch.Tensor, ctx: ForwardContext,
              copies: list[tuple[int, int]], lora_updates: LoraUpdates | None = None,
              graph: GraphKey | None = None) -> None:
    """Rank 0: the step (its forward context and input ids) to every other rank, with the LoRA pool rows written or
    moved since the last step. graph: the decode graph rank 0 replays for it (ctx: the bucket's padded rows, its
    LoRA grouping the step's own), None = eager."""
    dec, pre = ctx.decode, ctx.prefill
    t, rows = ids.shape[0], ctx.logits_indices.shape[0]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h = [STEP, t, rows, ctx.num_decode_seqs, 0, 0, 0, 0, 0, 0, len(copies), 0, 0, 0, 0, 0]
    if graph is not None:  # the bucket (>= 1), the LoRA key's groups as a mask (0: none; a key is never empty)
        h[_GRAPH], h[_GRAPH_KEY] = graph[0], 0 if graph[1] is None else _mask(graph[1])
    if dec is not None:
        h[_WIDTH], h[_DEC_Q], h[_DEC_K] = dec.block_tables.shape[1], dec.max_seqlen_q, dec.max_seqlen_k
    if pre is not None:
        h[_PRE] = pre.seq_lens.shape[0]
        h[_WIDTH], h[_PRE_Q], h[_PRE_K] = pre.block_tables.shape[1], pre.max_seqlen_q, pre.max_seqlen_k
    parts = [ids, ctx.positions, ctx.slot_mapping, ctx.logits_indices, *_meta_parts(dec), *_meta_parts(pre)]
    if copies:
        parts.append(torch.tensor(copies, dtype=torch.int64, device=ids.device).t().reshape(-1))
    lora, weights = None, None
    if ctx.lora is not None or lora_updates is not None:
        desc, weights = lora_updates if lora_updates is not None else ([], None)
        spaces = [ctx.lora, ctx.lora.experts] if ctx.lora is not None else []
        lora = torch.tensor([len(desc), *desc, *(x for m in spaces for x in _lora_ints(m))], dtype=torch.int64)
        parts += [m.token_indices for m in spaces if m is not None]
        h[_LORA] = lora.shape[0]
        h[_LORA_BYTES] = weights.shape[0] if weights is not None else 0
    payload = torch.cat([p.to(torch.int64) for p in parts])
    h[_LEN] = payload.shape[0]
    header[:] = torch.tensor(h)
    group.broadcast(header, host=True)
    if lora is not None:
        group.broadcast(lora, host=True)
    group.broadcast(payload)
    if weights is not None:
        group.broadcast(weights.to(group.device))


def _send_op(group: ParallelGroup, op: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[_OP] = op
    group.broadcast(header, host=True)


def send_stop(group: ParallelGroup) -> None:
    _send_op(group, STOP)


def send_capture(group: ParallelGroup) -> None:
    """Rank 0, between steps: every worker sets up its decode graph path now (CPU tests: emulated), as rank 0 does
    next."""
    _send_op(group, CAPTURE)


class Step(NamedTuple):
    ids: torch.Tensor
    ctx: ForwardContext
    copies: list[tuple[int, int]]  # KV block copies to make before the forward
    lora_updates: LoraUpdates | None
    graph: GraphKey | None  # the decode graph rank 0 replays (ctx holds its bucket's rows), None = eager


def recv_step(group: ParallelGroup) -> Step | int:
    """Ranks 1..N-1: the next step, or the op rank 0 sent instead (STOP, CAPTURE)."""
    header = group.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), host=True).tolist()
    if header[_OP] != STEP:
        return header[_OP]
    lora = group.broadcast(torch.empty(header[_LORA], dtype=torch.int64), host=True).tolist() \
        if header[_LORA] else []
    payload = group.broadcast(torch.empty(header[_LEN], dtype=torch.int64, device=group.device))
    weights = group.broadcast(torch.empty(header[_LORA_BYTES], dtype=torch.uint8, device=group.device)) \
        if header[_LORA_BYTES] else None
    t, rows, d, p, width = header[_T], header[_ROWS], header[_DEC], header[_PRE], header[_WIDTH]
    sizes = [t, t, t, rows]
    if d:
        sizes += [d + 1, d, d * width]
    if p:
        sizes += [p + 1, p, p * width]
    n = header[_COPIES]
    sizes.append(2 * n)
    updates, spaces = None, []
    if lora:
        k = lora.pop(0)
        updates, lora = (lora[:k], weights), lora[k:]
        spaces = _token_counts(lora)
    ids, positions, slots, logits_idx, *rest = payload.split(sizes + spaces)

    def meta(q: int, max_q: int, max_k: int) -> AttentionMeta:
        cu, lens, tables = (rest.pop(0).to(torch.int32) for _ in range(3))
        return AttentionMeta(cu, lens, tables.view(q, width), max_q, max_k)

    decode = meta(d, header[_DEC_Q], header[_DEC_K]) if d else None
    prefill = meta(p, header[_PRE_Q], header[_PRE_K]) if p else None
    copies = rest.pop(0).view(2, n).t().tolist()
    lora_meta = _lora_meta(lora, rest, group.device) if lora else None
    if lora_meta is not None:
        lora_meta.experts = _lora_meta(lora, rest, group.device)
    ctx = ForwardContext(positions=positions, slot_mapping=slots, num_decode_seqs=d, decode=decode, prefill=prefill,
                         logits_indices=logits_idx, lora=lora_meta)
    graph = (header[_GRAPH], _groups(header[_GRAPH_KEY]) if header[_GRAPH_KEY] else None) if header[_GRAPH] else None
    return Step(ids, ctx, [(a, b) for a, b in copies], updates, graph)


def _token_counts(ints: list[int]) -> list[int]:
    """The token-index counts of the row spaces _lora_ints wrote into `ints` (read without consuming)."""
    out, i = [], 0
    while i < len(ints) and ints[i]:
        g = ints[i + 1]
        out.append(ints[i + 2])
        i += 6 + 5 * g + 1
    return out
