"""A step's results on the host: the sampled tokens into place, token-level stops, the StepOutputs; prompt logprobs.

The engine launches a step (LaunchedStep: its device work queued, and what the host needs to read its results);
once that work is done, OutputProcessor.process() turns it into outputs. Synchronous steps append each token;
with async scheduling the token replaces the placeholder the next step was scheduled with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.engine.core.scheduler import ScheduledBatch
from loom.engine.core.sequence import Sequence, SequenceStatus
from loom.engine.outputs import StepOutput, TokenLogprob


@dataclass(eq=False)
class LaunchedStep:
    """A step whose device work is queued: what waiting for it and making its outputs need."""
    batch: ScheduledBatch
    deferred_register: bool  # its computed range held placeholders: prefix-cache registration waits for them
    seqs: list = field(default_factory=list)  # the sampled sequences, in the logits' order
    tokens: torch.Tensor | None = None  # [S] sampled ids on the device (the next step's inputs, async)
    host: torch.Tensor | None = None  # the one host copy: tokens (int64), or tokens + logprobs (float64)
    event: object = None  # the end of its device work (CUDA), None where it is done already
    positions: list | None = None  # async: index of each sequence's new token in its token_ids (None: appended)
    lp_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rows with logprobs computed
    k: int = 0  # top logprobs per row in `host`
    nout: np.ndarray | None = None  # output count with this token
    max_out: np.ndarray | None = None  # output count that ends it by length
    min_tokens: np.ndarray | None = None
    ignore_eos: np.ndarray | None = None
    stop_ids: dict = field(default_factory=dict)  # row -> its stop_token_ids
    processors: object = None  # ProcessorBatch (grammar matchers accept the tokens)
    needs_host_tokens: bool = False  # grammar / bad_words rows: the next step samples after this one is done
    spec: object = None  # loom.engine.spec_decode.decoder.VerifiedStep: the sequences verified instead of sampled


def final_output(seq: Sequence, error: str | None = None) -> StepOutput:
    """The last output of a sequence ended outside a step (abort, refusal, failed step): no new token."""
    return StepOutput(seq.request_id, [], None, seq.status is SequenceStatus.FINISHED, seq.finish_reason,
                      seq.num_prompt_tokens, seq.num_cached_tokens,
                      seq.cumulative_logprob if seq.wants_logprob else None, error, seq.index)


class OutputProcessor:
    def __init__(self, eos_token_ids):
        self.eos = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self.eos_set = frozenset(eos_token_ids)

    def process(self, launched: LaunchedStep) -> tuple[list[StepOutput], list[tuple[Sequence, str]], int]:
        """A launched step whose device work is done -> its outputs, the sequences that end with it (and why), and
        how many tokens it generated for sequences still alive."""
        seqs = launched.seqs
        S = len(seqs)
        host = launched.host.numpy()
        toks = host[:S].astype(np.int64) if host.dtype != np.int64 else host
        # token-level stops, vectorised: eos / stop_token_ids once min_tokens is reached, then length
        nout = launched.nout
        if len(self.eos) == 1:
            hit = (toks == self.eos[0]) & ~launched.ignore_eos
        elif len(self.eos):
            hit = np.isin(toks, self.eos) & ~launched.ignore_eos
        else:
            hit = np.zeros(S, dtype=bool)
        for i, ids in launched.stop_ids.items():
            hit[i] |= int(toks[i]) in ids
        hit &= nout >= launched.min_tokens
        done = np.nonzero(hit | (nout >= launched.max_out))[0].tolist()
        reasons = {i: ("stop" if hit[i] else "length") for i in done}
        tok_list = toks.tolist()
        first = np.nonzero(nout == 1)[0].tolist()  # first tokens: timing, prompt logprobs
        lps = self._logprobs(launched, host, S)
        refused, complete = launched.processors.accept(tok_list) if launched.processors is not None else ([], [])
        # the grammar took its stop token: the output is whole, even under ignore_eos / min_tokens
        reasons.update(dict.fromkeys(complete, "stop"))
        refused, first = set(refused), set(first)
        special = set(done) | first | set(lps) | refused | set(complete)  # rows that need more than a plain output
        dropped = self._place(launched, tok_list)
        ending: list[tuple[Sequence, str]] = []
        now = time.monotonic()
        # a plain output for every row (one comprehension: this is the step's per-request cost), then the rows
        # that need more (ending, first token, logprobs) get theirs in place, in row order
        results = [StepOutput(seq.request_id, [tok], None, False, None, seq.num_prompt_tokens, seq.num_cached_tokens,
                              None, None, seq.index) for seq, tok in zip(seqs, tok_list)]
        for i in sorted(special - dropped):
            seq, tok = seqs[i], tok_list[i]
            lp = cum = plp = timing = error = None
            if i in lps:
                v, best = lps[i]
                seq.cumulative_logprob += v
                cum = seq.cumulative_logprob
                n = seq.params.logprobs
                if n is not None:
                    lp = [TokenLogprob(tok, v, best[:n])]
            if i in first:  # its first token
                timing = (seq.first_scheduled_time, now)
                if seq.index == 0 and seq.prompt_logprobs is not None:
                    plp = seq.prompt_logprobs
            reason = reasons.get(i)
            if i in refused:  # a refused token (cannot happen under the mask) or a failed matcher: never run on
                reason, error = "error", f"structured_outputs: the grammar cannot go on at token {tok}"
            if reason is not None:
                ending.append((seq, reason))
            results[i] = StepOutput(seq.request_id, [tok], lp, reason is not None, reason, seq.num_prompt_tokens,
                                    seq.num_cached_tokens, cum, error, seq.index, plp, timing)
        if dropped:
            results = [r for i, r in enumerate(results) if i not in dropped]
        return results, ending, S - len(dropped)

    def process_runs(self, runs: list[tuple[Sequence, list[int], list | None]],
                     ) -> tuple[list[StepOutput], list[tuple[Sequence, str]], int]:
        """Sequences that produced several tokens in one step (speculative decoding: (sequence, tokens, per token
        (logprob, top) or None)): each run is cut at its first token that ends the sequence, by the stops of
        process(), then appended, in one StepOutput per sequence. -> as process()."""
        results, ending, generated = [], [], 0
        eos = self.eos_set
        for seq, toks, lps in runs:
            p = seq.params
            nout = seq.num_output_tokens
            max_out = min(p.max_tokens, seq.max_total_tokens - seq.num_prompt_tokens)
            reason = error = None
            m = seq.matcher
            for i, t in enumerate(toks):
                n = nout + i + 1
                if m is not None:  # the grammar follows the emitted tokens; its stop token ends the output
                    try:
                        ok = m.accept_token(t)
                    except Exception:
                        ok = False
                    if not ok:
                        reason, error = "error", f"structured_outputs: the grammar cannot go on at token {t}"
                    elif m.is_terminated():
                        reason = "stop"
                if reason is not None:
                    pass
                elif n >= p.min_tokens and ((t in eos and not p.ignore_eos) or t in p.stop_token_ids):
                    reason = "stop"
                elif n >= max_out:
                    reason = "length"
                if reason is not None:
                    toks = toks[:i + 1]
                    break
            seq.token_ids += toks
            generated += len(toks)
            lp = cum = None
            if lps is not None:
                lps = lps[:len(toks)]
                seq.cumulative_logprob += sum(v for v, _ in lps)
                cum = seq.cumulative_logprob
                if p.logprobs is not None:
                    lp = [TokenLogprob(t, v, top[:p.logprobs]) for t, (v, top) in zip(toks, lps)]
            if reason is not None:
                ending.append((seq, reason))
            results.append(StepOutput(seq.request_id, toks, lp, reason is not None, reason, seq.num_prompt_tokens,
                                      seq.num_cached_tokens, cum, error, seq.index))
        return results, ending, generated

    @staticmethod
    def _logprobs(launched: LaunchedStep, host: np.ndarray, S: int) -> dict:
        """row -> (sampled token's logprob, [(top id, logprob)]) for the rows that computed them."""
        L = len(launched.lp_pos)
        if not L:
            return {}
        pos = launched.lp_pos.tolist()
        vals = host[S:S + L].tolist()
        k = launched.k
        if not k:
            return {p: (v, []) for p, v in zip(pos, vals)}
        ids = host[S + L:S + L + L * k].astype(np.int64).reshape(L, k).tolist()
        lps = host[S + L + L * k:S + L + 2 * L * k].reshape(L, k).tolist()
        return {p: (v, list(zip(a, b))) for p, v, a, b in zip(pos, vals, ids, lps)}

    @staticmethod
    def _place(launched: LaunchedStep, tok_list: list[int]) -> set[int]:
        """Put the tokens in their sequences; -> rows that get no output (async: aborted or ended after launch)."""
        seqs, positions = launched.seqs, launched.positions
        if positions is None:
            for seq, tok in zip(seqs, tok_list):
                seq.token_ids.append(tok)
            return set()
        dropped = set()
        finished = SequenceStatus.FINISHED
        for i, seq in enumerate(seqs):
            seq.token_ids[positions[i]] = tok_list[i]
            pend = seq.pending
            if pend is not None and pend[0] is launched:
                seq.pending = None
            if seq.status is finished:
                dropped.add(i)
        return dropped


# ---- prompt logprobs ---------------------------------------------------------------------------------------
def prompt_logprob_rows(batch: ScheduledBatch) -> tuple[list[tuple[int, Sequence, int]], list[int]]:
    """(flat token row, sequence, prompt position) for every scheduled prompt position whose logits predict a
    prompt token not scored yet, and those tokens."""
    rows, targets = [], []
    offset = 0
    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
        if seq.prompt_logprobs_pending:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]  # the first prompt token has no context
            start = seq.num_computed_tokens
            for pos in range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)):
                rows.append((offset + pos - start, seq, pos))
                targets.append(seq.prompt_token_ids[pos + 1])
        offset += n
    return rows, targets


def add_prompt_logprobs(logits: torch.Tensor, rows, targets: list[int], chunk: int = 256) -> None:
    """Raw-model logprob and exact rank of each scored prompt token, and the top-n (vLLM's prompt_logprobs).
    In chunks of rows, so a long prompt never holds a second [rows, vocab] tensor at once."""
    k = max(seq.params.prompt_logprobs for _, seq, _ in rows)
    for c in range(0, len(rows), chunk):
        lp = torch.log_softmax(logits[c:c + chunk].float(), dim=-1)
        tgt = torch.tensor(targets[c:c + chunk], dtype=torch.int64, device=lp.device)[:, None]
        tok_lp = lp.gather(1, tgt)
        ranks = (lp >= tok_lp).sum(dim=-1).tolist()  # vLLM's rank: how many tokens are at least as likely
        top_lp = top_ids = None
        if k > 0:
            top = lp.topk(k, dim=-1)
            top_lp, top_ids = top.values.tolist(), top.indices.tolist()
        for j, (_, seq, pos) in enumerate(rows[c:c + chunk]):
            if len(seq.prompt_logprobs) != pos + 1:
                continue  # already scored (recomputed after a preemption)
            kk = seq.params.prompt_logprobs
            best = list(zip(top_ids[j][:kk], top_lp[j][:kk])) if kk else []
            seq.prompt_logprobs.append(TokenLogprob(targets[c + j], tok_lp[j, 0].item(), best, ranks[j]))
