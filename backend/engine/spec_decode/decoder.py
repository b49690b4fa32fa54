"""The engine's side of speculative decoding: draft while scheduling, verify after the forward, roll back.

A step runs like this (every step of an engine with speculation is synchronous: drafting needs the tokens
accepted by the previous step on the host, so async scheduling is off):
1. the scheduler, walking the running decodes, asks `draft()`: prompt-lookup proposals d_1..d_k are appended to
   the sequence's token_ids (Sequence.num_draft_tokens = k) and it is scheduled as a row of 1 + k tokens, a small
   prefill chunk over its paged KV, in the step with the other decodes and prefills (in its adapter's LoRA group);
2. the forward returns, besides the usual sampled row (the bonus position), the logits of the k positions before
   it (`logits_rows()`: extra rows of the model runner), and `verify()` takes those sequences out of the plain
   sampling and decides, per position, with the target's distributions (loom.engine.spec_decode.verifier);
3. `finish()` rolls each sequence back to its verified length: the drafts leave token_ids, the computed length
   becomes the last real token plus the accepted drafts (the rejected drafts' KV slots are overwritten next
   step), blocks that only rejected drafts used are freed; then the accepted run plus the one token after it go
   through the output processor's stops (eos, stop_token_ids, max_tokens, the context: the run is cut there).

Proposals come from prompt lookup (loom.engine.spec_decode.ngram) or a draft model (loom.engine.spec_decode.
draft_model: proposed for all the step's candidates at once when the step starts, `active()`, and mirrored over
every target forward, `after_forward()`).

Structured outputs: proposals are checked against a fork of the sequence's grammar matcher (cut at the first token
it refuses, and after the token that ends it); the fork's bitmask of each position is the verify row's mask, so
each row's distribution is the one the plain path would sample; the matcher itself then accepts the emitted run.
Penalties: each verify row's penalties are computed from the outputs before it (SamplingBatch.build); after the run
the persistent penalty state is rewritten with the new outputs (SamplingState.resync_output).

Not speculated: a request's first token, requests with "speculative": false, and every decode of a step the
back-off (`active()`, loom.engine.spec_decode.backoff) leaves to the plain path. A step of decode and verify rows
replays a verify graph under CUDA graphs (loom.engine.worker.verify_graphs).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.engine.core.sequence import Sequence, SequenceStatus
from loom.engine.outputs import SpecDecodingStats
from loom.engine.sample.sampler import Sampler, SamplingBatch
from loom.engine.spec_decode.backoff import BackOff
from loom.engine.spec_decode.config import SpeculativeConfig
from loom.engine.spec_decode.draft_model import FixedMask, Proposal
from loom.engine.spec_decode.ngram import propose_ngram
from loom.engine.spec_decode.verifier import verify_rows


@dataclass
class Run:
    """A verified sequence's result: the accepted proposals, then the token after them."""
    seq: Sequence
    accepted: int
    tokens: list[int]
    logprobs: list | None = None  # per token (logprob, [(top id, logprob)]) when the sequence wants them


@dataclass
class VerifiedStep:
    runs: list[Run] = field(default_factory=list)


MAX_QUIET_TOKENS = 32  # the longest a request waits to propose again after misses in a row


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, engine):
        self.config = config
        self.bm = engine.block_manager
        self.state = engine.sampling_state
        self.output_processor = engine.output_processor
        self.vocab_size = engine.runner.vocab_size
        self.device = engine.runner.device
        self.stop_eos = sorted(engine.eos_token_ids)
        self.draft_model = getattr(engine, "draft", None)  # loom.engine.spec_decode.draft_model.DraftModel (or None)
        self.sampler = Sampler()
        self.stats = SpecDecodingStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._prepared: dict[Sequence, Proposal] = {}  # draft model: this step's proposals, made by active()
        self._current: dict[Sequence, Proposal] = {}  # the proposals being verified this step
        self.backoff = BackOff() if config.backoff == "measured" else None
        self._step: tuple[int, bool, float] | None = None  # this step's (decode rows, speculated, start time)
        self._pure = False  # this step has decode and verify rows only
        self._drafted = False  # ... and proposals were verified in it

    @classmethod
    def attach(cls, engine) -> "SpecDecoder":
        """Wire speculation into an engine: the scheduler drafts through it; steps become synchronous."""
        spec = cls(engine.config.speculative_config, engine)
        engine.scheduler.drafter = spec
        engine.async_scheduling = False
        return spec

    # ---- scheduling (loom.engine.core.scheduler.Drafter) ------------------------------------------------
    def active(self, running: list[Sequence]) -> bool:
        """Called as a step is scheduled: whether it speculates (disable_by_batch_size, then the measured back-off);
        a draft model proposes here for the whole step."""
        decode = sum(1 for s in running if len(s.token_ids) - s.num_computed_tokens == 1)
        limit = self.config.disable_by_batch_size
        on = not limit or decode <= limit
        if on and decode and self.backoff is not None:
            on = self.backoff.choose(decode)
        self._step = (decode, on, time.perf_counter())
        self._pure = False
        self._prepared, self._current = {}, {}  # (a failed step may have left some)
        if on and self.draft_model is not None:
            self._prepare(running)
        return on

    def end_step(self, generated: int) -> None:
        """The step's outputs are made: a decode-only step's rate goes to the back-off."""
        if self.backoff is not None and self._step is not None and self._pure:
            decode, on, t0 = self._step
            if not on or self._drafted:  # a speculative step without proposals says nothing about speculation
                self.backoff.observe(decode, on, generated, time.perf_counter() - t0)
        self._step = None

    @staticmethod
    def _quiet(seq: Sequence, outputs: int) -> None:
        """A miss (nothing accepted, or no n-gram found) at `outputs` output tokens: the request proposes again 2, 4,
        ..., MAX_QUIET_TOKENS tokens later, the longer the more misses in a row."""
        seq.spec_misses += 1
        seq.spec_quiet_until = outputs + min(1 << seq.spec_misses, MAX_QUIET_TOKENS)

    def _eligible(self, seq: Sequence) -> bool:
        return (seq.params.speculative and seq.sampling_row >= 0 and seq.num_output_tokens > 0
                and seq.num_output_tokens >= seq.spec_quiet_until)

    def _max_k(self, seq: Sequence) -> int:
        """Proposals that can all be emitted with the token after them (max_tokens, the context)."""
        p = seq.params
        max_out = min(p.max_tokens, seq.max_total_tokens - seq.num_prompt_tokens)
        return min(self.config.num_speculative_tokens, max_out - seq.num_output_tokens - 1)

    def _sampling_lists(self, seq: Sequence) -> tuple[list[int], bool]:
        p = seq.params
        return list(p.stop_token_ids) + ([] if p.ignore_eos else self.stop_eos), seq.wants_logprob

    def _prepare(self, running: list[Sequence]) -> None:
        """Draft-model proposals for every decode that may speculate this step, in one batch of draft forwards.
        Blocks for the verify row are taken now (the draft writes its KV there), never the last free ones the
        running decodes may need."""
        cands, ks = [], []
        reserve = len(running)
        for seq in running:
            if len(seq.token_ids) - seq.num_computed_tokens != 1 or not self._eligible(seq):
                continue
            k = self._max_k(seq)
            if k <= 0:
                continue
            need = self.bm.blocks_needed(seq, 1 + k)
            if self.bm.num_free_blocks - need < reserve or not self.bm.allocate(seq, 1 + k):
                continue
            cands.append(seq)
            ks.append(k)
        if cands:
            props = self.draft_model.propose(cands, ks, self._sampling_lists)
            self._prepared = dict(zip(cands, props))

    def draft(self, seq: Sequence, max_tokens: int) -> int:
        if not self._eligible(seq):
            return 0
        k = min(self._max_k(seq), max_tokens)
        if k <= 0:
            return 0
        if self.draft_model is not None:
            prop = self._prepared.pop(seq, None)
            if prop is None:
                return 0
            prop = prop.cut(k)
        else:
            c = self.config
            prop = Proposal(propose_ngram(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max))
            if not prop.tokens:  # no n-gram recurs: searching again at every token costs the step (open-ended text)
                self._quiet(seq, seq.num_output_tokens)
            if seq.matcher is not None and prop.tokens:
                prop = self._check_grammar(seq, prop.tokens)
        if not prop.tokens:
            return 0
        self._current[seq] = prop
        seq.token_ids += prop.tokens
        seq.num_draft_tokens = len(prop.tokens)
        return len(prop.tokens)

    def _check_grammar(self, seq: Sequence, tokens: list[int]) -> Proposal:
        """Prompt-lookup proposals cut at the first token the grammar refuses (and after one that ends it), with the
        grammar's bitmask of each verify position."""
        import xgrammar as xgr

        m = seq.matcher.fork()
        bm = xgr.allocate_token_bitmask(1, self.vocab_size)
        masks, kept, ended = [], [], False
        for t in tokens:
            m.fill_next_token_bitmask(bm, 0)
            masks.append(bm[0].clone())
            if not m.accept_token(t):
                break
            kept.append(t)
            if m.is_terminated():
                ended = True
                break
        if len(masks) == len(kept):
            if ended:
                masks.append(None)
            else:
                m.fill_next_token_bitmask(bm, 0)
                masks.append(bm[0].clone())
        return Proposal(kept, None, masks)

    def undo(self, seq: Sequence) -> None:
        self._current.pop(seq, None)
        if seq.num_draft_tokens:
            del seq.token_ids[-seq.num_draft_tokens:]
            seq.num_draft_tokens = 0

    def after_forward(self, batch) -> None:
        """The target's forward of a step is queued (computed lengths not advanced yet): the draft's KV follows it."""
        # decode rows and verify rows only: a step the back-off can compare with another of the same rows
        self._pure = all(n == 1 or s.num_draft_tokens for s, n in zip(batch.seqs, batch.num_scheduled_tokens))
        self._drafted = bool(self._current)
        if self.draft_model is not None:
            self.draft_model.mirror(batch)

    # ---- the step ----------------------------------------------------------------------------------
    @staticmethod
    def logits_rows(batch) -> list[int]:
        """Flat token rows of the step whose logits verification needs besides the sampled ones: positions
        0..k-1 of each verify row (position k, after the last proposal, is its sampled row)."""
        rows: list[int] = []
        off = 0
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            if seq.num_draft_tokens:
                rows.extend(range(off, off + seq.num_draft_tokens))
            off += n
        return rows

    def verify(self, launched, logits: torch.Tensor, sampled_idx: list[int], first_extra: int):
        """Verify the drafted sequences of a run step (their extra rows start at logits row `first_extra`), and
        note their runs in `launched.spec`. -> the logits and batch indices of the other sampled sequences."""
        seqs = launched.batch.seqs
        plain_pos, plain_idx, rows = [], [], []
        drafted: list[Sequence] = []
        extra = first_extra
        for pos, i in enumerate(sampled_idx):
            seq = seqs[i]
            k = seq.num_draft_tokens
            if not k:
                plain_pos.append(pos)
                plain_idx.append(i)
                continue
            drafted.append(seq)
            rows += range(extra, extra + k)
            rows.append(pos)
            extra += k
        dev = logits.device
        launched.spec = VerifiedStep(self._verify(drafted, logits.index_select(0, torch.tensor(rows, device=dev))))
        return logits.index_select(0, torch.tensor(plain_pos, dtype=torch.int64, device=dev)), plain_idx

    def _verify(self, drafted: list[Sequence], logits: torch.Tensor) -> list[Run]:
        params, seeds, prompts, outputs, stops, constraints, want_lp, proposals = [], [], [], [], [], [], [], []
        matchers: list | None = None
        q_rows: list | None = None
        props = [self._current.pop(seq, None) or Proposal(seq.token_ids[-seq.num_draft_tokens:]) for seq in drafted]
        zero = None
        for seq, prop in zip(drafted, props):
            p, k = seq.params, seq.num_draft_tokens
            out = seq.output_token_ids  # with the proposals: row j sees the outputs and d_1..d_j
            n0 = len(out) - k
            stop, wants = self._sampling_lists(seq)
            for j in range(k + 1):
                params.append(p)
                seeds.append(seq.seed)
                prompts.append(seq.prompt_token_ids)
                outputs.append(out[:n0 + j])
                stops.append(stop)
                constraints.append(seq.constraints)
                want_lp.append(wants)
            proposals += out[n0:] + [-1]
            if prop.masks is not None and matchers is None:
                matchers = [None] * (len(params) - k - 1)
            if matchers is not None:
                matchers += [FixedMask(m) for m in prop.masks] if prop.masks is not None else [None] * (k + 1)
            if prop.q is not None and q_rows is None:
                zero = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
                q_rows = [zero] * (len(params) - k - 1)
            if q_rows is not None:
                q_rows += list(prop.q.unbind(0)) + [zero] if prop.q is not None else [zero] * (k + 1)
        b = SamplingBatch.build(params, seeds, prompts, outputs, stops, self.vocab_size, self.device,
                                constraints=constraints, matchers=matchers, want_logprobs=want_lp)
        top_k = max((s.params.logprobs or 0) for s in drafted) if any(s.wants_logprob for s in drafted) else -1
        v = verify_rows(self.sampler, logits, b, torch.tensor(proposals, dtype=torch.int64, device=self.device),
                        top_k, None if q_rows is None else torch.stack(q_rows))
        runs, r = [], 0
        st = self.stats
        for seq in drafted:
            k = seq.num_draft_tokens
            acc = v.accepted[r:r + k]
            a = k if acc.all() else int(np.argmin(acc))  # the first rejected position
            tokens = proposals[r:r + a] + [int(v.fallback[r + a])]
            lps = None
            if seq.wants_logprob:
                vals = list(v.proposal_logprob[r:r + a]) + [v.fallback_logprob[r + a]]
                tops = [[]] * (a + 1) if v.top_ids is None else [
                    list(zip(v.top_ids[j].tolist(), v.top_logprobs[j].tolist())) for j in range(r, r + a + 1)]
                lps = [(float(x), t) for x, t in zip(vals, tops)]
            runs.append(Run(seq, a, tokens, lps))
            if a:
                seq.spec_misses = 0
            else:  # nothing accepted: this request's proposals wait (rows cost 1 + k tokens each)
                self._quiet(seq, seq.num_output_tokens - k + 1)
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += a
            for j in range(a):
                st.accepted_per_pos[j] += 1
            r += k + 1
        return runs

    def finish(self, step: VerifiedStep):
        """Roll the verified sequences back to their verified length and make their outputs (runs cut at stops).
        -> (outputs, sequences ending, tokens generated), as OutputProcessor.process."""
        runs = []
        for run in step.runs:
            seq = run.seq
            self.undo(seq)
            if seq.status is SequenceStatus.FINISHED:  # ended since the launch: nothing to place
                continue
            seq.num_computed_tokens = len(seq.token_ids) + run.accepted  # the last real token and the accepted
            self.bm.trim(seq)
            runs.append((seq, run.tokens, run.logprobs))
        results, ending, generated = self.output_processor.process_runs(runs)
        ended = {id(s) for s, _ in ending}
        for seq, _, _ in runs:
            if id(seq) not in ended:
                self.bm.register_full_blocks(seq)
                self.state.resync_output(seq)  # the plain path's output index and penalty state
        return results, ending, generated
