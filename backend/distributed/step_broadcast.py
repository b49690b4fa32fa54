"""A step's inputs from rank 0 to the other ranks: a fixed header of sizes on the host group, then one int64
payload on the device group.

Rank 0 prepares the step as without tensor parallelism (loom.engine.worker.model_runner) and sends what its forward
context holds - input ids, positions, slot mapping, logits rows, the decode and prefill attention metadata - and
the KV block copies queued since the last step (n > 1 forks copy a partly filled block: every rank copies its own
heads). On CUDA the payload is built and sent on the device (NCCL), after the input ids are complete there (async
scheduling fills them on the device), so sending needs no host sync.
"""
from __future__ import annotations

import torch

from loom.distributed.parallel_state import ParallelGroup
from loom.layers.forward_context import AttentionMeta, ForwardContext

HEADER_LEN = 12
STEP, STOP = 0, 1
# header fields
_OP, _T, _ROWS, _DEC, _PRE, _WIDTH, _DEC_Q, _DEC_K, _PRE_Q, _PRE_K, _COPIES, _LEN = range(HEADER_LEN)


def _meta_parts(meta: AttentionMeta | None) -> list[torch.Tensor]:
    if meta is None:
        return []
    return [meta.cu_seqlens_q, meta.seq_lens, meta.block_tables.reshape(-1)]


def send_step(group: ParallelGroup, ids: torch.Tensor, ctx: ForwardContext,
              copies: list[tuple[int, int]]) -> None:
    """Rank 0: the step (its forward context and input ids) to every other rank."""
    dec, pre = ctx.decode, ctx.prefill
    t, rows = ids.shape[0], ctx.logits_indices.shape[0]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h = [STEP, t, rows, ctx.num_decode_seqs, 0, 0, 0, 0, 0, 0, len(copies), 0]
    if dec is not None:
        h[_WIDTH], h[_DEC_Q], h[_DEC_K] = dec.block_tables.shape[1], dec.max_seqlen_q, dec.max_seqlen_k
    if pre is not None:
        h[_PRE] = pre.seq_lens.shape[0]
        h[_WIDTH], h[_PRE_Q], h[_PRE_K] = pre.block_tables.shape[1], pre.max_seqlen_q, pre.max_seqlen_k
    parts = [ids, ctx.positions, ctx.slot_mapping, ctx.logits_indices, *_meta_parts(dec), *_meta_parts(pre)]
    if copies:
        parts.append(torch.tensor(copies, dtype=torch.int64, device=ids.device).t().reshape(-1))
    payload = torch.cat([p.to(torch.int64) for p in parts])
    h[_LEN] = payload.shape[0]
    header[:] = torch.tensor(h)
    group.broadcast(header, host=True)
    group.broadcast(payload)


def send_stop(group: ParallelGroup) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[_OP] = STOP
    group.broadcast(header, host=True)


def recv_step(group: ParallelGroup) -> tuple[torch.Tensor, ForwardContext, list[tuple[int, int]]] | None:
    """Ranks 1..N-1: the next step as (input ids, forward context, block copies), or None when rank 0 stops."""
    header = group.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), host=True).tolist()
    if header[_OP] == STOP:
        return None
    payload = group.broadcast(torch.empty(header[_LEN], dtype=torch.int64, device=group.device))
    t, rows, d, p, width = header[_T], header[_ROWS], header[_DEC], header[_PRE], header[_WIDTH]
    sizes = [t, t, t, rows]
    if d:
        sizes += [d + 1, d, d * width]
    if p:
        sizes += [p + 1, p, p * width]
    n = header[_COPIES]
    sizes.append(2 * n)
    ids, positions, slots, logits_idx, *rest = payload.split(sizes)

    def meta(q: int, max_q: int, max_k: int) -> AttentionMeta:
        cu, lens, tables = (rest.pop(0).to(torch.int32) for _ in range(3))
        return AttentionMeta(cu, lens, tables.view(q, width), max_q, max_k)

    decode = meta(d, header[_DEC_Q], header[_DEC_K]) if d else None
    prefill = meta(p, header[_PRE_Q], header[_PRE_K]) if p else None
    copies = rest[0].view(2, n).t().tolist() if n else []
    ctx = ForwardContext(positions=positions, slot_mapping=slots, num_decode_seqs=d, decode=decode, prefill=prefill,
                         logits_indices=logits_idx)
    return ids, ctx, [(a, b) for a, b in copies]
