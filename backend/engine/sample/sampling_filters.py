"""The sampler's logits filters: penalties, top-k / top-p and min-p, each batched over rows of a [R, V] tensor.

Each works on a float32 [R, V] tensor and per-row parameters [R] and returns a new tensor (the input is not
modified); the batch sampler (loom.engine.sample.sampler) picks the rows each applies to and the order (penalties on the
raw logits, then temperature, top-k, top-p, min-p).  The request processors (allowed_token_ids, bad_words,
logit_bias, the grammar mask) are loom.engine.sample.logits_processors'.

Repetition penalty (HF style, over prompt + output tokens): positive logits are divided by it, negative ones
multiplied; then presence / frequency penalties (OpenAI style, output tokens only:
``logit -= presence * (count > 0) + frequency * count``).

Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are all kept, as in
vLLM / HF).  Top-p keeps, in decreasing probability order, the tokens whose preceding mass is < top_p,
i.e. the smallest prefix whose mass is >= top_p (always at least one token); it is first resolved among a row's
top-256 logits, and only rows where those do not suffice are sorted.  Min-p drops tokens whose
probability is < min_p * the largest probability (after top-k / top-p, on the tempered distribution).
"""
from __future__ import annotations

import torch
from torch import Tensor


def token_counts(ids: Tensor, vocab_size: int) -> Tensor:
    """float32 [N, V] counts of each token id in the padded [N, L] ``ids`` (pad id = vocab_size)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
    return counts[:, :vocab_size]


def _gather_ids(ids: Tensor, pad: int) -> Tensor:
    """Padded ids usable for gather/scatter on [N, V]: each pad becomes the row's first real id (a harmless
    duplicate), or 0 for a row without ids (callers make that a no-op)."""
    first = ids.gather(1, (ids != pad).to(torch.int32).argmax(dim=1, keepdim=True))  # first non-pad id
    first = torch.where(first == pad, torch.zeros_like(first), first)
    return torch.where(ids == pad, first, ids)


def apply_penalties(
    logits: Tensor,
    prompt_ids: Tensor | None,
    output_ids: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """Return penalised logits (a new tensor; the input is not modified).

    logits [N, V] float32; prompt_ids [N, Lp] / output_ids [N, Lo] int64 padded with V (prompt_ids may be
    None when no row has a repetition penalty); penalties [N] float32.
    Repetition penalty (HF): for tokens in prompt or output, ``l / r`` if ``l > 0`` else ``l * r``.
    Then presence / frequency (OpenAI, output tokens only): ``l -= presence * (c > 0) + frequency * c``
    with ``c`` the token's count in the output.  Only the listed ids are touched (gather / scatter), the
    counts come from one ``scatter_add`` over the padded output ids.
    """
    V = logits.shape[1]
    out = logits.clone()
    if prompt_ids is not None:
        ids = torch.cat([prompt_ids, output_ids], dim=1)
        has_ids = (ids != V).any(dim=1, keepdim=True)
        ids = _gather_ids(ids, V)
        v = out.gather(1, ids)
        r = repetition_penalty[:, None]
        new = torch.where(v > 0, v / r, v * r)
        out.scatter_(1, ids, torch.where(has_ids, new, v))
    counts = token_counts(output_ids, V)
    ids = _gather_ids(output_ids, V)
    c = counts.gather(1, ids)  # 0 for rows without output (their fake id 0 has count 0)
    delta = presence_penalty[:, None] * (c > 0) + frequency_penalty[:, None] * c
    out.scatter_(1, ids, out.gather(1, ids) - delta)
    return out


TOP_P_CANDIDATES = 256  # top-p is first resolved among the top-256 logits of a row; full sort only if needed


def _normalize_top_k(top_k: Tensor, vocab_size: int) -> Tensor:
    return torch.where((top_k <= 0) | (top_k > vocab_size), torch.full_like(top_k, vocab_size), top_k)


def _exclusive_cumsum(probs: Tensor) -> Tensor:
    """Mass strictly before each position (monotone, unlike cumsum - probs)."""
    return torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))


def _thresholds_by_sort(x: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """[R, 1] logit thresholds for top-k then top-p with one full sort per row (k normalised, p > 1 = off)."""
    sorted_x = x.sort(dim=-1, descending=True).values
    thr_k = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x.masked_fill_(sorted_x < thr_k, float("-inf"))
    keep = _exclusive_cumsum(sorted_x.softmax(dim=-1)) < p[:, None]
    n_keep = keep.sum(dim=-1).clamp_(min=1)
    thr_p = sorted_x.gather(1, (n_keep - 1)[:, None])
    return torch.maximum(thr_k, thr_p)


def _thresholds_by_candidates(x: Tensor, k: Tensor, p: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """Like :func:`_thresholds_by_sort` but from ``topk(kc)`` only; also returns a [R] bool "exact" flag.

    A row is exact when its whole top-k set lies among the candidates (k <= kc, no tie across the
    candidate boundary), or when top-k is off and the candidates already hold >= top_p of the mass.
    """
    neg_inf = float("-inf")
    V = x.shape[1]
    vals = x.topk(kc, dim=-1).values  # sorted, decreasing
    k_in = k <= kc
    thr_k = vals.gather(1, (k.clamp(max=kc) - 1)[:, None])
    thr_k = torch.where(k_in[:, None], thr_k, torch.full_like(thr_k, neg_inf))
    masked = vals.masked_fill(vals < thr_k, neg_inf)
    # log-mass of the top-k set: inside the candidates when k <= kc, else (top-k off) the whole row
    log_total = torch.where(k_in, masked.logsumexp(dim=-1), x.logsumexp(dim=-1))
    probs = (masked - log_total[:, None]).exp_()
    before = _exclusive_cumsum(probs)
    n_keep = (before < p[:, None]).sum(dim=-1).clamp_(min=1)
    thr_p = masked.gather(1, (n_keep - 1)[:, None])
    exact = (k_in & (thr_k[:, 0] > vals[:, -1])) | ((k >= V) & (before[:, -1] + probs[:, -1] >= p))
    return torch.maximum(thr_k, thr_p), exact


def apply_top_k_top_p(
    logits: Tensor,
    top_k: Tensor,
    top_p: Tensor | None,
    top_k_max: int | None = None,
    max_candidates: int = TOP_P_CANDIDATES,
) -> Tensor:
    """Mask (to -inf) tokens outside top-k, then outside top-p (on the renormalised top-k set); new tensor.

    top_k [R] int64, 0 = off (values >= V also mean off); top_p [R] float32 (1 = off), or None when no row
    uses top-p: then only a ``topk(top_k_max)`` is done.  With top-p, the thresholds come from
    ``topk(max_candidates)`` for the rows where that is exact, and from one full sort for the others
    (which rows take which path depends only on each row's own logits and parameters).
    Ties at a threshold are all kept.
    """
    neg_inf = float("-inf")
    V = logits.shape[1]
    k = _normalize_top_k(top_k, V)
    if top_p is None:
        kmax = V if top_k_max is None else max(1, min(int(top_k_max), V))
        vals = logits.topk(kmax, dim=-1).values
        thr = vals.gather(1, (k.clamp(max=kmax) - 1)[:, None])
        thr = torch.where((k >= V)[:, None], torch.full_like(thr, neg_inf), thr)
        return logits.masked_fill(logits < thr, neg_inf)
    p = torch.where(top_p >= 1.0, torch.full_like(top_p, 2.0), top_p)  # p = 1: never drop (cumsum rounding)
    kc = min(int(max_candidates), V)
    if kc >= V:
        thr = _thresholds_by_sort(logits, k, p)
    else:
        thr, exact = _thresholds_by_candidates(logits, k, p, kc)
        redo = torch.nonzero(~exact).flatten()
        if redo.numel():
            thr = thr.index_copy(0, redo, _thresholds_by_sort(logits.index_select(0, redo), k[redo], p[redo]))
    return logits.masked_fill(logits < thr, neg_inf)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens with prob < min_p * max prob (computed in log space: l < l_max + log(min_p))."""
    thr = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < thr, float("-inf"))
