"""Fully batched token sampler: the per-step batch description (SamplingBatch) and the Sampler that applies it.

The model runner calls :class:`Sampler` once per engine step with the float32 logits of the S
sequences being sampled (one row each) and a :class:`SamplingBatch` describing them.  Everything in
the hot path is a batched tensor operation; the only Python-level work over sequences happens in
:meth:`SamplingBatch.build`, which turns the per-sequence lists into a handful of tensors (and
host-side flags, so that the hot path does not synchronise with the device to decide what to skip;
the one exception is top-p, which checks per row whether its top-256 candidates suffice and sorts
only the rows where they do not).

Order of operations for a row (matches vLLM / HF):

1. penalties on the raw logits: repetition penalty (HF style, over prompt + output tokens:
   positive logits are divided by it, negative ones multiplied), then presence / frequency penalties
   (OpenAI style, output tokens only: ``logit -= presence * (count > 0) + frequency * count``);
2. ``min_tokens``: while a sequence has generated fewer than ``min_tokens`` tokens, its eos and
   stop token ids get ``-inf``;
3. temperature 0 (below 1e-5): greedy, the argmax of the logits after 1-2.  Otherwise:
   divide by the temperature, then top-k, top-p, min-p, then draw.

The filters (penalties, top-k / top-p, min-p) are loom.engine.sample.sampling_filters'; the random draw (a counter-based
uniform per row from its seed and step, then an inverse-CDF pick) is loom.engine.sample.sampling_rng's.  Their public
names are importable from here too.

Logprobs: the returned logprobs are always those of the *raw* model distribution,
``log_softmax(logits)`` of the unmodified logits passed in (before penalties, min_tokens masking,
temperature, top-k, top-p and min-p); this is vLLM's default ("raw_logprobs").  They are computed only
for the rows that need them (``SamplingBatch.logprob_rows``; a batch where nobody asked has no
vocabulary-wide pass beyond what sampling itself needs), as ``logit - logsumexp(logits)`` (no [rows, V]
log_softmax is materialised): the sampled token's logprob, and the top-K (K = the largest ``logprobs`` n
in the batch) ids and logprobs, sorted by decreasing logprob, when K > 0 (rows asking for fewer are
sliced by the caller).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loom.engine.sample.logits_processors import ProcessorBatch, RequestConstraints
from loom.engine.sample.sampling_filters import (
    TOP_P_CANDIDATES,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    token_counts,
)
from loom.engine.sample.sampling_rng import CDF_BLOCK, GOLDEN, counter_uniform, mix64, row_keys, sample_from_logits
from loom.engine.sampling_params import SamplingParams
from loom.kernels import argmax

__all__ = ["SAMPLING_EPS", "Sampler", "SamplerOutput", "SamplingBatch", "raw_logprobs",
           # re-exported from loom.engine.sample.sampling_filters and loom.engine.sample.sampling_rng
           "TOP_P_CANDIDATES", "apply_min_p", "apply_penalties", "apply_top_k_top_p", "token_counts",
           "CDF_BLOCK", "GOLDEN", "counter_uniform", "mix64", "row_keys", "sample_from_logits"]

SAMPLING_EPS = 1e-5  # temperatures below this are greedy


def _pad_ids(lists: list[list[int]], pad: int) -> Tensor:
    """Pad token-id lists into an int64 [N, max(L, 1)] CPU tensor filled with ``pad``; ids > pad are clamped to pad."""
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    total = int(lens.sum())
    width = max(int(lens.max()) if len(lists) else 0, 1)
    out = torch.full((len(lists), width), pad, dtype=torch.int64)
    if total:
        flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total))
        out[torch.arange(width)[None, :] < lens[:, None]] = flat.clamp_(0, pad)
    return out


def _revive_dead_rows(x: Tensor, fallback: Tensor, rows: Tensor) -> Tensor:
    """Rows whose constraints contradict each other (every token at -inf, e.g. min_tokens banning the eos that a
    completed grammar requires) fall back to ``fallback`` (the grammar-masked logits) instead of sampling NaN."""
    dead = rows[torch.isneginf(x.index_select(0, rows)).all(dim=-1)]
    if dead.numel() == 0:
        return x
    return x.index_copy(0, dead, fallback.index_select(0, dead))


# ----------------------------------------------------------------------------------------------
# Batch description
# ----------------------------------------------------------------------------------------------
@dataclass
class SamplingBatch:
    """Per-step sampling tensors for S sequences (all on the logits' device) plus host-side flags.

    Row-index tensors (``*_rows``) are int64 on the device; ``None`` means "all rows" where the
    matching flag says the feature is in use.
    """

    temperature: Tensor  # [S] f32 (0 for greedy rows)
    top_k: Tensor  # [S] int64, 0 = off
    top_p: Tensor  # [S] f32
    min_p: Tensor  # [S] f32
    repetition_penalty: Tensor  # [S] f32
    presence_penalty: Tensor  # [S] f32
    frequency_penalty: Tensor  # [S] f32
    seeds: Tensor  # [S] int64
    steps: Tensor  # [S] int64: output tokens generated so far
    vocab_size: int
    # greedy / random split
    all_greedy: bool
    all_random: bool
    random_rows: Tensor | None  # [R] rows with temperature > 0 (None: all rows, or none if all_greedy)
    # top-k / top-p, indices into the random rows
    no_top_k_top_p: bool
    use_top_p: bool  # some random row has top_p < 1 (needs the full sort)
    top_k_max: int
    top_k_top_p_rows: Tensor | None  # [Q] positions within random rows (None: all random rows)
    no_min_p: bool
    # penalties
    no_penalties: bool
    penalty_rows: Tensor | None  # [P] rows with any penalty (None: all rows)
    prompt_ids: Tensor | None  # [P, Lp] int64 padded with vocab_size; None if no repetition penalty
    output_ids: Tensor | None  # [P, Lo] int64 padded with vocab_size
    # min_tokens: (row, token) pairs to set to -inf
    min_tokens_rows: Tensor | None  # [M] int64
    min_tokens_cols: Tensor | None  # [M] int64
    # logprobs
    max_logprobs: int  # K = max requested n (0: only the sampled token's logprob)
    # grammar, allowed_token_ids, bad_words, logit_bias (loom.engine.sample.logits_processors); None: no row uses them
    processors: ProcessorBatch | None = None
    need_logprobs: bool = True  # some row wants its sampled token's logprob (logprobs or a cumulative logprob)
    logprob_rows: Tensor | None = None  # [L] those rows (None: all rows)
    greedy_rows: Tensor | None = None  # [G] rows with temperature 0 when the batch mixes greedy and random rows

    def random_part(self, t: Tensor) -> Tensor:
        """The random rows' entries of a per-row tensor (all of it when every row is random)."""
        return t if self.random_rows is None else t.index_select(0, self.random_rows)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        stop_ids_for_min_tokens: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        constraints: list[RequestConstraints | None] | None = None,
        matchers: list | None = None,
        want_logprobs: list[bool] | None = None,
    ) -> "SamplingBatch":
        """The simple path: every tensor built from the per-sequence lists (the engine keeps this state across
        steps instead, loom.engine.sample.sampling_state). ``want_logprobs``: which rows need their sampled token's
        logprob (None: every row)."""
        S = len(params)
        assert S > 0 and len(seeds) == S and len(prompt_token_ids) == S and len(output_token_ids) == S
        assert len(stop_ids_for_min_tokens) == S
        V = int(vocab_size)
        out_lens = [len(o) for o in output_token_ids]
        # one host tensor per dtype, one copy each to the device
        f = torch.tensor(
            [(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
             for p in params],
            dtype=torch.float32,
        )
        i = torch.tensor(
            [(p.top_k, s, n, p.logprobs if p.logprobs is not None else 0, p.min_tokens)
             for p, s, n in zip(params, seeds, out_lens)],
            dtype=torch.int64,
        )
        temp, top_p, min_p, rep, pres, freq = f.unbind(1)
        top_k, seed_t, steps, nlog, min_tok = i.unbind(1)
        top_k = torch.where((top_k < 0) | (top_k >= V), torch.zeros_like(top_k), top_k)
        temp = torch.where(temp < SAMPLING_EPS, torch.zeros_like(temp), temp)

        greedy = temp == 0
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())
        random_rows = None if (all_greedy or all_random) else torch.nonzero(~greedy).flatten()
        greedy_rows = None if random_rows is None else torch.nonzero(greedy).flatten()

        # top-k / top-p / min-p among the random rows
        rk = top_k if random_rows is None else top_k[random_rows]
        rp = top_p if random_rows is None else top_p[random_rows]
        rmin = min_p if random_rows is None else min_p[random_rows]
        if all_greedy:
            need_kp = torch.zeros(0, dtype=torch.bool)
        else:
            need_kp = (rk > 0) | (rp < 1.0)
        no_kp = not bool(need_kp.any())
        use_top_p = (not no_kp) and bool((rp < 1.0).any())
        top_k_max = int(rk.max()) if (not no_kp and len(rk)) else 0
        kp_rows = None if (no_kp or bool(need_kp.all())) else torch.nonzero(need_kp).flatten()
        no_min_p = all_greedy or not bool((rmin > 0).any())

        # penalties
        pen = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
        no_penalties = not bool(pen.any())
        penalty_rows = prompt_ids = output_ids = None
        if not no_penalties:
            rows = torch.nonzero(pen).flatten()
            all_pen = len(rows) == S
            sel = range(S) if all_pen else rows.tolist()
            output_ids = _pad_ids([output_token_ids[r] for r in sel], V)
            if bool((rep[rows] != 1.0).any()):
                prompt_ids = _pad_ids([prompt_token_ids[r] for r in sel], V)
            penalty_rows = None if all_pen else rows

        # min_tokens
        mt_rows = mt_cols = None
        active = torch.nonzero(steps < min_tok).flatten().tolist()
        if active:
            pairs = [(r, t) for r in active for t in stop_ids_for_min_tokens[r] if 0 <= t < V]
            if pairs:
                pt = torch.tensor(pairs, dtype=torch.int64)
                mt_rows, mt_cols = pt[:, 0], pt[:, 1]

        need_lp, lp_rows = True, None
        if want_logprobs is not None:
            lp = [r for r, w in enumerate(want_logprobs) if w]
            need_lp = bool(lp)
            lp_rows = None if len(lp) in (0, S) else torch.tensor(lp, dtype=torch.int64)

        dev = torch.device(device)

        def d(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(dev, non_blocking=True)

        return cls(
            temperature=d(temp), top_k=d(top_k), top_p=d(top_p), min_p=d(min_p),
            repetition_penalty=d(rep), presence_penalty=d(pres), frequency_penalty=d(freq),
            seeds=d(seed_t), steps=d(steps), vocab_size=V,
            all_greedy=all_greedy, all_random=all_random, random_rows=d(random_rows),
            no_top_k_top_p=no_kp, use_top_p=use_top_p, top_k_max=top_k_max, top_k_top_p_rows=d(kp_rows),
            no_min_p=no_min_p,
            no_penalties=no_penalties, penalty_rows=d(penalty_rows), prompt_ids=d(prompt_ids), output_ids=d(output_ids),
            min_tokens_rows=d(mt_rows), min_tokens_cols=d(mt_cols),
            max_logprobs=int(nlog.max()), need_logprobs=need_lp, logprob_rows=d(lp_rows), greedy_rows=d(greedy_rows),
            processors=ProcessorBatch.build(constraints or [None] * S, matchers, output_token_ids, V, dev)
            if (constraints is not None and any(c is not None for c in constraints))
            or (matchers is not None and any(m is not None for m in matchers)) else None,
        )


@dataclass
class SamplerOutput:
    """Logprob tensors cover ``logprob_rows`` (None: every row), and are None when no row needs them."""
    token_ids: Tensor  # [S] int64
    logprobs: Tensor | None  # [L] f32, raw-model logprob of the sampled token
    topk_ids: Tensor | None  # [L, K] int64, K = batch.max_logprobs (None if K == 0)
    topk_logprobs: Tensor | None  # [L, K] f32, sorted decreasing
    logprob_rows: Tensor | None = None


# ----------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------
class Sampler:
    """Stateless; one instance can serve any batch."""

    def process_logits(self, logits: Tensor, b: SamplingBatch) -> Tensor:
        """Request processors (allowed_token_ids, bad_words, logit_bias), then penalties and min_tokens masking
        (vLLM's order): the logits greedy rows take the argmax of. May return ``logits`` itself."""
        x = logits
        if b.processors is not None:
            x = b.processors.apply(x)
        if not b.no_penalties:
            rows = b.penalty_rows
            sub = x if rows is None else x.index_select(0, rows)

            def g(t: Tensor) -> Tensor:
                return t if rows is None else t.index_select(0, rows)

            sub = apply_penalties(sub, b.prompt_ids, b.output_ids,
                                  g(b.repetition_penalty), g(b.presence_penalty), g(b.frequency_penalty))
            x = sub if rows is None else x.index_copy(0, rows, sub)
        if b.min_tokens_rows is not None:
            if x is logits:
                x = x.clone()
            x.index_put_((b.min_tokens_rows, b.min_tokens_cols), torch.tensor(float("-inf"), device=x.device))
        return x

    def filtered(self, logits: Tensor, b: SamplingBatch) -> tuple[Tensor, Tensor, Tensor | None]:
        """The distributions a step draws from: (the logits after the grammar mask, which logprobs read; the
        processed logits greedy rows take the argmax of; the random rows' logits after temperature, top-k / top-p
        and min-p, in ``b.random_rows`` order, or None when every row is greedy). Speculative verification
        (loom.engine.spec_decode) reads the same three."""
        assert logits.dim() == 2 and logits.shape[1] == b.vocab_size, (tuple(logits.shape), b.vocab_size)
        logits = logits.float()
        if b.processors is not None:
            # The grammar mask comes first and also shapes the returned logprobs (vLLM applies it before its
            # sampler); it is applied in place to the logits passed in.
            logits = b.processors.apply_grammar(logits)
        x = self.process_logits(logits, b)
        if b.processors is not None and b.processors.rows is not None:
            x = _revive_dead_rows(x, logits, b.processors.rows)
        if b.all_greedy:
            return logits, x, None
        g = b.random_part
        xr = g(x) / g(b.temperature)[:, None]
        if not b.no_top_k_top_p:
            q = b.top_k_top_p_rows
            k, p = g(b.top_k), g(b.top_p)
            if q is not None:
                k, p = k.index_select(0, q), p.index_select(0, q)
            sub = xr if q is None else xr.index_select(0, q)
            sub = apply_top_k_top_p(sub, k, p if b.use_top_p else None, b.top_k_max)
            xr = sub if q is None else xr.index_copy(0, q, sub)
        if not b.no_min_p:
            xr = apply_min_p(xr, g(b.min_p))
        return logits, x, xr

    def __call__(self, logits: Tensor, b: SamplingBatch) -> SamplerOutput:
        logits, x, xr = self.filtered(logits, b)
        if b.all_greedy:
            token_ids = argmax(x)
        else:
            rows = b.random_rows
            sampled = sample_from_logits(xr, counter_uniform(b.random_part(b.seeds), b.random_part(b.steps)))
            if rows is None:
                token_ids = sampled
            else:  # greedy rows take the argmax and nothing else
                token_ids = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
                token_ids.index_copy_(0, rows, sampled)
                token_ids.index_copy_(0, b.greedy_rows, argmax(x.index_select(0, b.greedy_rows)))
        return self._logprobs(logits, token_ids, b)

    @staticmethod
    def _logprobs(logits: Tensor, token_ids: Tensor, b: SamplingBatch) -> SamplerOutput:
        """Raw-model logprobs of the rows that want them (logit - logsumexp)."""
        if not b.need_logprobs:
            return SamplerOutput(token_ids, None, None, None)
        rows = b.logprob_rows
        lg = logits if rows is None else logits.index_select(0, rows)
        tok = token_ids if rows is None else token_ids.index_select(0, rows)
        logprobs, topk_ids, topk_lp = raw_logprobs(lg, tok, min(b.max_logprobs, b.vocab_size))
        return SamplerOutput(token_ids, logprobs, topk_ids, topk_lp, rows)


def raw_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Each row's logprob of its token [R] and, when k > 0, its top-k ids and logprobs [R, k] (best first), as
    ``logit - logsumexp`` (no [rows, V] log_softmax is materialised). ``token_ids`` may be [R, m]: m tokens a row."""
    lse = torch.logsumexp(logits, dim=-1)
    tok = token_ids[:, None] if token_ids.dim() == 1 else token_ids
    logprobs = logits.gather(1, tok) - lse[:, None]
    if token_ids.dim() == 1:
        logprobs = logprobs.squeeze(1)
    topk_ids = topk_lp = None
    if k > 0:
        vals, topk_ids = logits.topk(k, dim=-1)
        topk_lp = vals - lse[:, None]
    return logprobs, topk_ids, topk_lp
