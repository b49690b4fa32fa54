"""Verification of proposed tokens against the target's distributions, one row per position (device work).

A sequence with proposals d_1..d_k has k + 1 rows: row j holds the target's logits after the sequence's tokens
and d_1..d_j. Row j < k tests d_{j+1}; row k only supplies the bonus token. Every row's distribution is the one
the sampler would draw from at that position (loom.engine.sample.sampler.Sampler.filtered: processors, min_tokens,
temperature, top-k / top-p / min-p), so:

* greedy rows accept d_{j+1} iff it is the argmax; the argmax is the token when it is not (identical to the
  non-speculative engine's tokens);
* random rows: Leviathan et al.'s rule accepts d with probability min(1, p(d) / q(d)), q the distribution d was
  drawn from, and on rejection draws from the residual max(p - q, 0) normalised. A prompt-lookup proposal is a
  point mass q = 1{d}: acceptance with probability p(d), the residual is p with d removed. A draft model's q is its
  own filtered distribution at that position (loom.engine.spec_decode.draft_model). The first rejected row's draw
  (or, all accepted, the bonus row's draw from p) ends the run: each emitted token is distributed exactly as the
  target's at its position.

Draws use the sampler's counter uniform of (seed, output index), the same stream the plain path uses; acceptance
uses a separate stream of the same key, so the two are independent.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loom.engine.sample.sampler import Sampler, SamplingBatch, raw_logprobs
from loom.engine.sample.sampling_rng import counter_uniform, mix64, sample_from_logits
from loom.kernels import argmax

ACCEPT_STREAM = 0x5DEECE66D  # xor'ed into the mixed seed: the acceptance uniforms' own stream


@dataclass
class RowVerdicts:
    """Per row, on the host: was its proposal accepted, the token it yields otherwise (residual or bonus draw), and
    (when asked) the raw logprobs of both and the row's top-k."""
    accepted: np.ndarray  # [R] bool (False on rows without a proposal)
    fallback: np.ndarray  # [R] int64
    proposal_logprob: np.ndarray | None = None  # [R]
    fallback_logprob: np.ndarray | None = None  # [R]
    top_ids: np.ndarray | None = None  # [R, K]
    top_logprobs: np.ndarray | None = None  # [R, K]


def verify_rows(sampler: Sampler, logits: Tensor, b: SamplingBatch, proposals: Tensor, top_k: int,
                q: Tensor | None = None) -> RowVerdicts:
    """logits [R, V] (float32), b the rows' SamplingBatch (steps = output index of each row), proposals [R] int64
    (-1: no proposal, the bonus row). q [R, V]: the probabilities each random row's proposal was drawn from (None:
    point masses, prompt lookup; read only on random rows with a proposal). top_k < 0: no logprobs; otherwise the
    proposal's and fallback's logprobs and the top_k best of each row. One device-to-host copy."""
    R = logits.shape[0]
    logits, x, xr = sampler.filtered(logits, b)
    has = proposals >= 0
    d = proposals.clamp(min=0)
    accepted = torch.zeros(R, dtype=torch.bool, device=logits.device)
    fallback = torch.empty(R, dtype=torch.int64, device=logits.device)
    greedy = None if b.all_random else (
        torch.arange(R, device=logits.device) if b.all_greedy else b.greedy_rows)
    if greedy is not None:
        target = argmax(x.index_select(0, greedy))
        fallback.index_copy_(0, greedy, target)
        accepted.index_copy_(0, greedy, has.index_select(0, greedy) & (d.index_select(0, greedy) == target))
    if xr is not None:
        rows = torch.arange(R, device=logits.device) if b.random_rows is None else b.random_rows
        dr, hr = d.index_select(0, rows), has.index_select(0, rows)
        seeds, steps = b.random_part(b.seeds), b.random_part(b.steps)
        u_acc = counter_uniform(mix64(seeds) ^ ACCEPT_STREAM, steps)
        if q is None:
            p_d = (xr.gather(1, dr[:, None]).squeeze(1) - torch.logsumexp(xr, dim=-1)).exp()
            accepted.index_copy_(0, rows, hr & (u_acc < p_d))
            # the residual: p without the proposal (rows without one draw from p itself)
            residual = xr.clone()
            hit = torch.nonzero(hr).flatten()
            residual[hit, dr[hit]] = float("-inf")
        else:
            p = torch.softmax(xr.double(), dim=-1)
            qr = torch.where(hr[:, None], q.index_select(0, rows).double(), 0.0)
            p_d, q_d = p.gather(1, dr[:, None]).squeeze(1), qr.gather(1, dr[:, None]).squeeze(1)
            accepted.index_copy_(0, rows, hr & (u_acc * q_d < p_d))  # u < p(d) / q(d), no division by a zero q
            residual = (p - qr).clamp_(min=0).log_().float()  # max(p - q, 0); rows without a proposal: p
        dead = torch.isneginf(residual).all(dim=-1)  # p was all under q (then the proposal is always accepted)
        residual = torch.where(dead[:, None], xr, residual)
        fallback.index_copy_(0, rows, sample_from_logits(residual, counter_uniform(seeds, steps)))
    parts = [accepted.double(), fallback.double()]
    if top_k >= 0:
        lp, top_ids, top_lp = raw_logprobs(logits, torch.stack([d, fallback], dim=1), min(top_k, b.vocab_size))
        parts += [lp.double().flatten()]
        if top_ids is not None:
            parts += [top_ids.double().flatten(), top_lp.double().flatten()]
    host = torch.cat(parts).cpu().numpy()
    out = RowVerdicts(host[:R] != 0, host[R:2 * R].astype(np.int64))
    if top_k >= 0:
        lp = host[2 * R:4 * R].reshape(R, 2)
        out.proposal_logprob, out.fallback_logprob = lp[:, 0], lp[:, 1]
        if top_k > 0:
            K = min(top_k, b.vocab_size)
            out.top_ids = host[4 * R:4 * R + R * K].astype(np.int64).reshape(R, K)
            out.top_logprobs = host[4 * R + R * K:].reshape(R, K)
    return out
