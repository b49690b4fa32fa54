"""Fused mixture-of-experts MLP (Mixtral / Qwen3-MoE experts):
y[t] = sum_k w[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t])).

Weights: w13 [E, 2I, H] (gate rows 0..I-1, then up rows I..2I-1), w2 [E, H, I]. Routing (softmax, top-k,
renormalisation) is the caller's: topk_weights [T, K] and topk_ids [T, K] come in ready.

Triton path (two grouped-GEMM launches over all experts at once):
- align (torch ops, no host sync): the T*K (token, k) "pairs" are sorted by expert and each expert's run is
  padded to a multiple of BLOCK_M, so every BLOCK_M tile of the sorted list belongs to one expert. Padding
  slots hold the sentinel pair id P (= T*K) and are masked. The buffer is sized by the static bound
  P + min(E, P) * (BLOCK_M - 1); tiles past the real end carry expert -1 and exit at once.
- gate/up: each program owns one tile of pairs x BLOCK_N intermediate columns, gathers x rows by token, and
  accumulates the gate tile and the matching up tile together, so SiLU-and-mul is its epilogue and only
  [rows, I] is written (never [rows, 2I]).
- down: each program multiplies its tile of intermediate rows by w2[e]^T, scales by the routing weight,
  and writes one row per pair; a torch sum over K per token finishes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# P (the step's token-expert pairs) is not specialised on: a new value must never mean a new compile mid-serving.
@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, bexp_ptr,
    stride_xt, stride_we, stride_wn, stride_hm,
    H, I, P, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + mb)
    if e < 0:  # tile past the last expert's padded run
        return
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tok[:, None] * stride_xt
    w_gate = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn  # [1, BN], read as W^T
    w_up = w_gate + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + kk) < H
        xt = tl.load(x_rows + (k0 + kk)[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        gt = tl.load(w_gate + (k0 + kk)[:, None], mask=wmask, other=0.0)  # [BK, BN]
        ut = tl.load(w_up + (k0 + kk)[:, None], mask=wmask, other=0.0)
        acc_g += tl.dot(xt, gt, input_precision=DOT_PREC)
        acc_u += tl.dot(xt, ut, input_precision=DOT_PREC)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["P"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ptr, bexp_ptr, tw_ptr,
    stride_hm, stride_we, stride_wn, stride_op,
    H, I, P,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + mb)
    if e < 0:
        return
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    pair = tl.where(valid, pair, 0).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    kk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm  # intermediate rows are in sorted order
    w_cols = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kmask = (k0 + kk) < I
        ht = tl.load(h_rows + (k0 + kk)[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_cols + (k0 + kk)[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc += tl.dot(ht, wt, input_precision=DOT_PREC)
    scale = tl.load(tw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(out_ptr + pair[:, None] * stride_op + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


def _dot_precision(dtype):
    # fp32 inputs would otherwise run as tf32 on GPU; half types ignore this setting
    return "ieee" if dtype == torch.float32 else "tf32"


def moe_align(topk_ids, num_experts, block_m):
    """-> (sorted_ids [num_blocks*block_m] int32: pair ids, sentinel P in padding; block_expert [num_blocks]
    int32: expert of each tile, -1 past the end). Pure torch and static-shaped: no host sync."""
    ids = topk_ids.reshape(-1).long()
    P, E, dev = ids.numel(), num_experts, ids.device
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)  # pair ids grouped by expert
    e_sorted = ids[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[e_sorted]  # position within its expert
    num_blocks = triton.cdiv(P + min(E, P) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_ids[(pad_end - padded)[e_sorted] + rank] = order.to(torch.int32)
    blocks = torch.arange(num_blocks, device=dev)
    block_expert = torch.searchsorted(pad_end // block_m, blocks, right=True)  # first expert ending after it
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _block_sizes(P, E, H, I):
    # tile rows: about the mean pairs per expert (decode: few, prefill: many), 16 minimum for tl.dot
    block_m = 16 if P <= 2 * E * 16 else (32 if P <= 2 * E * 32 else 64)
    block_n1 = 64 if I >= 64 else max(16, triton.next_power_of_2(I))
    block_n2 = 64 if H >= 64 else max(16, triton.next_power_of_2(H))
    return block_m, block_n1, block_n2


def _k_tiles(block_m, dtype):
    """(BLOCK_K, num_warps) of the gate/up and of the down kernel, chosen with scripts/kernel_resources.py for
    bf16/fp16 on sm_80 and sm_90: no spills. Decode-sized tiles (16 rows) stream the expert weights: gate/up on 8
    warps with a 32-deep K tile holds ~120 registers (2 CTAs = 16 warps per SM) where 4 warps x 64 sat at the 255
    cap. 32/64-row tiles are compute-bound: 8 warps (4 spill at 64 rows: two accumulators). float32 (ieee dot)
    takes a 32-deep K tile: 64 spills on sm_90."""
    wide = block_m >= 32
    bk = 32 if dtype == torch.float32 else 64
    return (bk if wide else 32, 8), (bk, 8 if wide else 4)


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids, out=None, block_m=None):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K] (float32), topk_ids [T, K] -> [T, H] in x.dtype."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[1]
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    P = T * K
    bm, bn1, bn2 = _block_sizes(P, E, H, I)
    bm = block_m or bm  # a power of two >= 16
    (bk1, w1), (bk2, w2_) = _k_tiles(bm, x.dtype)
    sorted_ids, block_expert = moe_align(topk_ids, E, bm)
    nb = block_expert.numel()
    inter = torch.empty((nb * bm, I), dtype=x.dtype, device=x.device)  # rows in sorted (padded) order
    prec = _dot_precision(x.dtype)
    _gate_up_kernel[(nb, triton.cdiv(I, bn1))](
        x, w13, inter, sorted_ids, block_expert,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        H, I, P, TOP_K=K, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, DOT_PREC=prec, num_warps=w1,
    )
    per_pair = torch.empty((P, H), dtype=x.dtype, device=x.device)  # every row written exactly once
    tw = topk_weights.reshape(-1).contiguous()  # indexed by pair id = t * K + k
    _down_kernel[(nb, triton.cdiv(H, bn2))](
        inter, w2, per_pair, sorted_ids, block_expert, tw,
        inter.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        H, I, P, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, DOT_PREC=prec, num_warps=w2_,
    )
    return torch.sum(per_pair.view(T, K, H), dim=1, out=out)


def _expert_pairs(topk_ids: torch.Tensor, E: int):
    """(expert, pair ids, token ids) for each expert that received tokens; pair id = token * K + k."""
    K = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    start = 0
    for e, n in enumerate(torch.bincount(ids, minlength=E).tolist()):
        if n:
            pairs = order[start:start + n]
            start += n
            yield e, pairs, pairs // K


def _silu_mul(gu: torch.Tensor, I: int) -> torch.Tensor:
    """SiLU(gate) * up, computed in float32 for half inputs."""
    if gu.dtype == torch.float32:
        return F.silu(gu[:, :I]) * gu[:, I:]
    return (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(gu.dtype)


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, out=None):
    """Loop over the experts that received tokens: gather, two matmuls, silu-and-mul, scale, scatter-add."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)  # sums over K in float32
    tw = topk_weights.reshape(-1).float()
    for e, pairs, tok in _expert_pairs(topk_ids, E):
        h = _silu_mul(x.index_select(0, tok) @ w13[e].t(), two_i // 2)
        acc.index_add_(0, tok, (h @ w2[e].t()).float() * tw[pairs, None])
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)


def _token_groups(meta, T: int, device) -> list[tuple[int, torch.Tensor]]:
    """[(group, bool mask over the T tokens)] for the adapter groups of a LoraBatchMeta (host copies)."""
    out = []
    idx = meta.token_indices
    for g, (a, b) in enumerate(zip(meta.seg_starts_cpu[:-1], meta.seg_starts_cpu[1:])):
        if b > a:
            mask = torch.zeros(T, dtype=torch.bool, device=device)
            mask[idx[a:b]] = True
            out.append((g, mask))
    return out


def fused_moe_lora_ref(x, w13, w2, topk_weights, topk_ids, lora, meta, out=None):
    """fused_moe_ref with per-expert LoRA on gate/up and down, for tokens grouped by adapter as in `lora_shrink`.

    lora = (a13 [E, 2, R, H], b13 [E, R, 2I], a2 [E, 1, R, I], b2 [E, R, H]): the pools of one layer; group g owns
    rank rows [row_start[g], row_start[g] + ranks[g]) and its delta is scalings[g] * (x a^T) b, slice by slice (pools
    of a narrower type widened to x's).
    No Triton version: steps with expert LoRA run this on every device.
    """
    a13, b13, a2, b2 = lora
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    groups = _token_groups(meta, T, x.device) if T else []
    tw = topk_weights.reshape(-1).float()
    for e, pairs, tok in _expert_pairs(topk_ids, E):
        xe = x.index_select(0, tok)
        gu = xe @ w13[e].t()  # [n, 2I]
        sel = [(g, m[tok].nonzero().squeeze(1)) for g, m in groups]
        sel = [(g, rows) for g, rows in sel if rows.numel()]
        for g, rows in sel:
            r0, rk, s = meta.row_start_cpu[g], meta.ranks_cpu[g], meta.scalings_cpu[g]
            xs = xe[rows]
            for si in range(2):
                d = (xs @ a13[e, si, r0:r0 + rk].to(x.dtype).t()) @ b13[e, r0:r0 + rk, si * I:(si + 1) * I].to(x.dtype)
                gu[rows, si * I:(si + 1) * I] += s * d
        h = _silu_mul(gu, I)
        y = h @ w2[e].t()
        for g, rows in sel:
            r0, rk, s = meta.row_start_cpu[g], meta.ranks_cpu[g], meta.scalings_cpu[g]
            y[rows] += s * ((h[rows] @ a2[e, 0, r0:r0 + rk].to(x.dtype).t()) @ b2[e, r0:r0 + rk].to(x.dtype))
        acc.index_add_(0, tok, y.float() * tw[pairs, None])
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
