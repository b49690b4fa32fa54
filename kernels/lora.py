"""Multi-LoRA shrink/expand (Punica / S-LoRA style) over tokens gathered per adapter by index.

Group g owns tokens token_indices[seg_starts[g]:seg_starts[g+1]] and rank rows
[row_start[g], row_start[g] + ranks[g]) of every pool. The grid covers (group, token tile, ...);
programs past their group's tokens or rank exit at once, and the expand's reduction loop stops at the
group's own rank, so no compute is spent on padding to the largest rank. Tokens without an adapter
are in no group and cost nothing. All output slices (q/k/v or gate/up) are done in one launch.

shrink: buf[s, i, r] = x[token_indices[i]] . lora_a[s, row_start[g] + r]          (r < ranks[g])
expand: y[token_indices[i], off_s:off_{s+1}] += scalings[g] * buf[s, i, :rank] @ lora_b[rows, off_s:off_{s+1}]
buf is float32 (it is tiny, and keeps the rank-space product exact across the two launches).
Pools of a narrower float type than the activations (lora_dtype bfloat16 under a float32 model) are widened to the
activations' type where they are read: the result is the one a pool of the activations' type holding the same
values gives.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# Integers that vary with the step (the split, the rank tiles, the buffer's strides, which follow the step's LoRA
# tokens and largest rank) are not specialised on, nor is the alignment of the token list (the adapter registry's
# is a slice at the number of tokens without adapter): a new value must never mean a new compile while serving.
@triton.jit(do_not_specialize=["stride_bs", "stride_bt", "k_per_split", "r_tiles", "split_k"],
            do_not_specialize_on_alignment=["tok_ptr"])
def _shrink_kernel(
    x_ptr, a_ptr, buf_ptr, tok_ptr, seg_ptr, row_ptr, rank_ptr,
    stride_xt, stride_as, stride_ar, stride_bs, stride_bt,
    K, k_per_split, r_tiles, split_k,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    g = tl.program_id(0)
    mt = tl.program_id(1)
    pid2 = tl.program_id(2)  # (slice, rank tile, k split) flattened
    ks = pid2 % split_k
    rt = (pid2 // split_k) % r_tiles
    sl = pid2 // (split_k * r_tiles)
    seg0 = tl.load(seg_ptr + g)
    n_tok = tl.load(seg_ptr + g + 1) - seg0
    rank = tl.load(rank_ptr + g)
    if (mt * BLOCK_M >= n_tok) | (rt * BLOCK_R >= rank):
        return
    row0 = tl.load(row_ptr + g)
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < n_tok
    tok = tl.load(tok_ptr + seg0 + i, mask=imask, other=0).to(tl.int64)
    r = rt * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rank
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + sl.to(tl.int64) * stride_as + (row0 + r).to(tl.int64)[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    k_lo = ks * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = (k0 + kk) < k_hi
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + kk)[None, :], mask=imask[:, None] & kmask[None, :],
                     other=0.0)
        at = tl.load(a_rows + (k0 + kk)[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)  # [BK, BR]
        acc += tl.dot(xt, at.to(xt.dtype), input_precision=DOT_PREC)
    dst = buf_ptr + sl.to(tl.int64) * stride_bs + (seg0 + i).to(tl.int64)[:, None] * stride_bt + r[None, :]
    omask = imask[:, None] & rmask[None, :]
    if ATOMIC:  # split K: partial sums meet in the zeroed buffer
        tl.atomic_add(dst, acc, mask=omask)
    else:
        tl.store(dst, acc, mask=omask)


@triton.jit(do_not_specialize=["stride_bs", "stride_bt", "n_tiles"], do_not_specialize_on_alignment=["tok_ptr"])
def _expand_kernel(
    buf_ptr, b_ptr, y_ptr, tok_ptr, seg_ptr, row_ptr, rank_ptr, scal_ptr,
    stride_bs, stride_bt, stride_br, stride_yt,
    OFF0, OFF1, OFF2, OFF3, OFF4,  # slice column offsets (up to 4 slices), scalars: no H2D copy per call
    n_tiles, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    g = tl.program_id(0)
    mt = tl.program_id(1)
    pid2 = tl.program_id(2)  # (slice, column tile)
    nt = pid2 % n_tiles
    sl = pid2 // n_tiles
    seg0 = tl.load(seg_ptr + g)
    n_tok = tl.load(seg_ptr + g + 1) - seg0
    if mt * BLOCK_M >= n_tok:
        return
    c0 = tl.where(sl == 0, OFF0, tl.where(sl == 1, OFF1, tl.where(sl == 2, OFF2, OFF3)))
    c1 = tl.where(sl == 0, OFF1, tl.where(sl == 1, OFF2, tl.where(sl == 2, OFF3, OFF4)))
    if c0 + nt * BLOCK_N >= c1:  # this slice is narrower than the widest one
        return
    rank = tl.load(rank_ptr + g)
    row0 = tl.load(row_ptr + g)
    scaling = tl.load(scal_ptr + g)
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < n_tok
    tok = tl.load(tok_ptr + seg0 + i, mask=imask, other=0).to(tl.int64)
    cols = c0 + nt * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < c1
    rr = tl.arange(0, BLOCK_R)
    c_dtype = y_ptr.dtype.element_ty  # B widened to the activations' type (a 16-bit pool under float32)
    buf_rows = buf_ptr + sl.to(tl.int64) * stride_bs + (seg0 + i).to(tl.int64)[:, None] * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # stops at this adapter's own rank
        rmask = (r0 + rr) < rank
        bt = tl.load(buf_rows + (r0 + rr)[None, :], mask=imask[:, None] & rmask[None, :], other=0.0)
        wt = tl.load(b_ptr + (row0 + r0 + rr).to(tl.int64)[:, None] * stride_br + cols[None, :],
                     mask=rmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(bt.to(c_dtype), wt.to(c_dtype), input_precision=DOT_PREC)
    yp = y_ptr + tok[:, None] * stride_yt + cols[None, :]
    ymask = imask[:, None] & cmask[None, :]
    y = tl.load(yp, mask=ymask, other=0.0).to(tl.float32)
    tl.store(yp, (y + scaling * acc).to(y_ptr.dtype.element_ty), mask=ymask)


# One launch instead of three (a zeroed buffer, shrink, expand) where a step has few tokens per adapter (decode): each
# program computes its tokens' rank-space product x @ A^T itself, a rank tile at a time, and goes on to that tile's
# share of the expand; the shrink is computed again by every column tile (A is read once per tile, from L2), which
# is small next to the launches it saves while the tokens fit one tile. Same tiles and loop order as the two-kernel
# path without split K, so the same results.
@triton.jit(do_not_specialize=["n_tiles"], do_not_specialize_on_alignment=["tok_ptr"])
def _shrink_expand_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, tok_ptr, seg_ptr, row_ptr, rank_ptr, scal_ptr,
    stride_xt, stride_as, stride_ar, stride_br, stride_yt,
    OFF0, OFF1, OFF2, OFF3, OFF4, K,
    n_tiles, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    g = tl.program_id(0)
    mt = tl.program_id(1)
    pid2 = tl.program_id(2)  # (slice, column tile)
    nt = pid2 % n_tiles
    sl = pid2 // n_tiles
    seg0 = tl.load(seg_ptr + g)
    n_tok = tl.load(seg_ptr + g + 1) - seg0
    if mt * BLOCK_M >= n_tok:
        return
    c0 = tl.where(sl == 0, OFF0, tl.where(sl == 1, OFF1, tl.where(sl == 2, OFF2, OFF3)))
    c1 = tl.where(sl == 0, OFF1, tl.where(sl == 1, OFF2, tl.where(sl == 2, OFF3, OFF4)))
    if c0 + nt * BLOCK_N >= c1:  # this slice is narrower than the widest one
        return
    rank = tl.load(rank_ptr + g)
    row0 = tl.load(row_ptr + g)
    scaling = tl.load(scal_ptr + g)
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < n_tok
    tok = tl.load(tok_ptr + seg0 + i, mask=imask, other=0).to(tl.int64)
    cols = c0 + nt * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < c1
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    c_dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # stops at this adapter's own rank
        rmask = (r0 + rr) < rank
        a_rows = a_ptr + sl.to(tl.int64) * stride_as + (row0 + r0 + rr).to(tl.int64)[None, :] * stride_ar
        s = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + kk) < K
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + (k0 + kk)[None, :], mask=imask[:, None] & kmask[None, :],
                         other=0.0)
            at = tl.load(a_rows + (k0 + kk)[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)  # [BK, BR]
            s += tl.dot(xt, at.to(xt.dtype), input_precision=DOT_PREC)
        wt = tl.load(b_ptr + (row0 + r0 + rr).to(tl.int64)[:, None] * stride_br + cols[None, :],
                     mask=rmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.dot(s.to(c_dtype), wt.to(c_dtype), input_precision=DOT_PREC)
    yp = y_ptr + tok[:, None] * stride_yt + cols[None, :]
    ymask = imask[:, None] & cmask[None, :]
    y = tl.load(yp, mask=ymask, other=0.0).to(tl.float32)
    tl.store(yp, (y + scaling * acc).to(y_ptr.dtype.element_ty), mask=ymask)


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def block_m_for(max_seg_len: int) -> int:
    """Token tile of the shrink/expand launches: the step's largest group, in three classes."""
    return 16 if max_seg_len <= 16 else (32 if max_seg_len <= 32 else 64)


def block_r_for(max_rank: int) -> int:
    """Rank tile: the step's largest rank, in three classes (16, 32, 64; larger ranks take several tiles)."""
    return min(64, max(16, triton.next_power_of_2(max(1, max_rank))))


def shrink_split_k(groups: int, m_tiles: int, slices: int, r_tiles: int, K: int) -> int:
    """Few tokens and a long input dim: split K so the grid fills the GPU (atomics into float32)."""
    programs = groups * m_tiles * slices * r_tiles
    return max(1, min(16, 256 // max(programs, 1), K // 512))


def lora_shrink_triton(x, lora_a, meta, out=None, split_k=None):
    """out (optional) [S, T_lora, max_rank] float32; only r < rank of each token's group is written."""
    S, _, K = lora_a.shape
    T_lora = meta.token_indices.shape[0]
    if out is None:
        out = torch.zeros((S, T_lora, meta.max_rank), dtype=torch.float32, device=x.device)
    G = meta.num_groups
    if T_lora == 0 or G == 0:
        return out
    assert x.stride(-1) == 1 and lora_a.stride(-1) == 1 and out.stride(-1) == 1
    block_m = block_m_for(meta.max_seg_len)
    block_r = block_r_for(meta.max_rank)
    block_k = 64 if block_m * block_r <= 32 * 32 else 32
    r_tiles = triton.cdiv(meta.max_rank, block_r)
    m_tiles = triton.cdiv(meta.max_seg_len, block_m)
    if split_k is None:
        split_k = shrink_split_k(G, m_tiles, S, r_tiles, K)
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    if split_k > 1:
        out.zero_()
    _shrink_kernel[(G, m_tiles, S * r_tiles * split_k)](
        x, lora_a, out, meta.token_indices, meta.seg_starts, meta.row_start, meta.ranks,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1),
        K, k_per_split, r_tiles, split_k,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split_k > 1,
        DOT_PREC=_dot_precision(x.dtype),
    )
    return out


def lora_expand_triton(buf, lora_b, slice_offsets, meta, y):
    S = len(slice_offsets) - 1
    assert 1 <= S <= 4, "up to 4 output slices per launch"
    G = meta.num_groups
    T_lora = meta.token_indices.shape[0]
    if T_lora == 0 or G == 0:
        return y
    assert lora_b.stride(-1) == 1 and y.stride(-1) == 1 and buf.stride(-1) == 1
    offs = [int(o) for o in slice_offsets] + [int(slice_offsets[-1])] * (5 - len(slice_offsets))
    widest = max(offs[s + 1] - offs[s] for s in range(S))
    block_m = block_m_for(meta.max_seg_len)
    block_r = block_r_for(meta.max_rank)
    block_n = 64 if widest >= 64 else max(16, triton.next_power_of_2(widest))
    n_tiles = triton.cdiv(widest, block_n)
    _expand_kernel[(G, triton.cdiv(meta.max_seg_len, block_m), S * n_tiles)](
        buf, lora_b, y, meta.token_indices, meta.seg_starts, meta.row_start, meta.ranks, meta.scalings,
        buf.stride(0), buf.stride(1), lora_b.stride(0), y.stride(0), *offs,
        n_tiles, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
        DOT_PREC=_dot_precision(y.dtype),
    )
    return y


FUSED_MAX_TOKENS = 16  # tokens per adapter up to which lora_apply_triton takes the fused kernel (one token tile)


def lora_apply_triton(x, y, lora_a, lora_b, slice_offsets, meta):
    """y += the LoRA deltas of meta's groups: the fused kernel while every group's tokens fit one tile (decode), else
    shrink then expand."""
    if meta.max_seg_len > FUSED_MAX_TOKENS:
        return lora_expand_triton(lora_shrink_triton(x, lora_a, meta), lora_b, slice_offsets, meta, y)
    S = len(slice_offsets) - 1
    assert 1 <= S <= 4 and lora_a.shape[0] == S, "up to 4 output slices per launch, one A pool per slice"
    G = meta.num_groups
    if meta.token_indices.shape[0] == 0 or G == 0:
        return y
    assert x.stride(-1) == 1 and lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1 and y.stride(-1) == 1
    offs = [int(o) for o in slice_offsets] + [int(slice_offsets[-1])] * (5 - len(slice_offsets))
    widest = max(offs[s + 1] - offs[s] for s in range(S))
    block_m = block_m_for(meta.max_seg_len)
    block_r = block_r_for(meta.max_rank)
    block_n = 64 if widest >= 64 else max(16, triton.next_power_of_2(widest))
    n_tiles = triton.cdiv(widest, block_n)
    _shrink_expand_kernel[(G, 1, S * n_tiles)](
        x, lora_a, lora_b, y, meta.token_indices, meta.seg_starts, meta.row_start, meta.ranks, meta.scalings,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), y.stride(0), *offs, lora_a.shape[2],
        n_tiles, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64 if block_m * block_r <= 32 * 32 else 32,
        BLOCK_N=block_n, DOT_PREC=_dot_precision(y.dtype),
    )
    return y


# ----------------------------------------------------------------------------------------------
# Reference (a loop over adapter groups; every group is one batched matmul)


def groups(meta, min_tokens: int = 1):
    """(first, end, row_start, rank, scaling) of every group with at least min_tokens tokens and a rank."""
    seg = meta.seg_starts_cpu if meta.seg_starts_cpu is not None else meta.seg_starts.tolist()
    rows = meta.row_start_cpu if meta.row_start_cpu is not None else meta.row_start.tolist()
    ranks = meta.ranks_cpu if meta.ranks_cpu is not None else meta.ranks.tolist()
    scal = meta.scalings_cpu if meta.scalings_cpu is not None else meta.scalings.tolist()
    for g in range(len(rows)):
        if seg[g + 1] - seg[g] >= max(1, min_tokens) and ranks[g] > 0:
            yield seg[g], seg[g + 1], rows[g], ranks[g], scal[g]


# With many small adapter groups (decode: one token per request, each on its own adapter) a Python loop
# over groups costs ~10 tiny ops per group per module. Instead, multiply the step's LoRA tokens by every
# rank row in the span the step's adapters occupy (one dense GEMM) and keep each token's own rows. The
# extra FLOPs grow with tokens x span, so this path is taken only while that product is small.
_DENSE_MAX_TOKEN_ROWS = 32768


def _tokens(meta):
    """The step's LoRA token indices: a static meta (CUDA graphs) pads token_indices past the last group's end."""
    n = meta.seg_starts_cpu[-1] if meta.seg_starts_cpu is not None else int(meta.seg_starts[-1])
    return meta.token_indices[:n]


def _dense_span(meta):
    """(lo, hi, rows [T, r] relative to lo, valid [T, r], scaling [T]) or None when the loop is cheaper."""
    if meta.num_groups < 2:
        return None
    rs = meta.row_start_cpu if meta.row_start_cpu is not None else meta.row_start.tolist()
    rk = meta.ranks_cpu if meta.ranks_cpu is not None else meta.ranks.tolist()
    used = [(r, k) for r, k in zip(rs, rk) if k > 0]  # a static meta's padding groups have rank 0
    if not used:
        return None
    lo, hi = min(r for r, _ in used), max(r + k for r, k in used)
    tok = _tokens(meta)
    if tok.numel() * (hi - lo) > _DENSE_MAX_TOKEN_ROWS:
        return None
    dev = meta.token_indices.device
    seg = meta.seg_starts.long()
    group = torch.repeat_interleave(torch.arange(seg.numel() - 1, device=dev), seg[1:] - seg[:-1],
                                    output_size=tok.numel())
    r = torch.arange(meta.max_rank, device=dev)
    valid = r[None, :] < meta.ranks.long()[group][:, None]
    rows = torch.where(valid, meta.row_start.long()[group][:, None] - lo + r[None, :], 0)
    return lo, hi, rows, valid, meta.scalings.float()[group]


def _shrink_dense(x, lora_a, meta, out, span):
    lo, hi, rows, valid, _ = span
    tok = _tokens(meta)
    xs = x[tok]  # [T, in]
    full = torch.matmul(xs, lora_a[:, lo:hi].to(xs.dtype).transpose(1, 2)).float()  # [S, T, span]
    own = torch.gather(full, 2, rows[None].expand(full.shape[0], -1, -1))  # [S, T, r]
    out[:, :tok.numel()].copy_(own.masked_fill_(~valid[None], 0))
    return out


def _expand_dense(buf, lora_b, offs, meta, y, span):
    lo, hi, rows, valid, scaling = span
    S, T = len(offs) - 1, rows.shape[0]
    coef = buf[:S, :T, :meta.max_rank].float().masked_fill(~valid[None], 0) * scaling[None, :, None]
    dense = torch.zeros((S, T, hi - lo), dtype=torch.float32, device=y.device)
    dense.scatter_add_(2, rows[None].expand(S, -1, -1), coef)  # invalid slots add 0 at row 0
    b = lora_b[lo:hi].to(y.dtype)
    delta = torch.empty((T, offs[-1]), dtype=torch.float32, device=y.device)
    for s in range(S):  # a loop over output slices (q/k/v), not over tokens or adapters
        delta[:, offs[s]:offs[s + 1]] = (dense[s].to(b.dtype) @ b[:, offs[s]:offs[s + 1]]).float()
    y.index_add_(0, _tokens(meta), delta.to(y.dtype))
    return y


def lora_shrink_ref(x, lora_a, meta, out=None, split_k=None):
    S = lora_a.shape[0]
    T_lora = meta.token_indices.shape[0]
    if out is None:
        out = torch.zeros((S, T_lora, meta.max_rank), dtype=torch.float32, device=x.device)
    span = _dense_span(meta)
    if span is not None:
        return _shrink_dense(x, lora_a, meta, out, span)
    for a, b, row, rank, _ in groups(meta):
        xs = x[meta.token_indices[a:b]]  # [n, in]
        out[:, a:b, :rank] = torch.matmul(xs, lora_a[:, row:row + rank].to(xs.dtype).transpose(1, 2)).float()
    return out


def lora_expand_ref(buf, lora_b, slice_offsets, meta, y):
    offs = [int(o) for o in slice_offsets]
    span = _dense_span(meta)
    if span is not None:
        return _expand_dense(buf, lora_b, offs, meta, y, span)
    for a, b, row, rank, scaling in groups(meta):
        w = lora_b[row:row + rank].to(y.dtype)  # [r, sum_out]
        delta = torch.empty((b - a, offs[-1]), dtype=w.dtype, device=y.device)
        for s in range(len(offs) - 1):
            c0, c1 = offs[s], offs[s + 1]
            delta[:, c0:c1] = buf[s, a:b, :rank].to(w.dtype) @ w[:, c0:c1]
        # one scatter-add per group (not a gather + scatter per slice)
        y.index_add_(0, meta.token_indices[a:b], delta.to(y.dtype), alpha=scaling)
    return y
