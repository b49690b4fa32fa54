"""Per-request sampling state kept across steps, so a step's SamplingBatch is a gather, not a rebuild.

vLLM v1's persistent input batch is the idea; this is our own, smaller version. A sequence gets a row when it
first samples and keeps it until it finishes (a preempted sequence keeps its row: its parameters and output do
not change while it waits). A row holds the request's parameters, its flags, its output count and where it ends
by length, in host numpy arrays; the parameters also live in device tensors that are written only when a row
joins. A request with penalties also gets a slot in padded device tensors of its prompt and output ids; after
each draw its token is appended there on the device, so the next step can be sampled before this step's tokens
reach the host (async scheduling), and nothing is re-padded from Python lists.

Per step the work is O(rows of the step) numpy (a gather of flags, a few nonzero()s), one upload of the step's
index arrays (int64) and, when rows joined, one of their parameters (float32); the sampler's draws are the same
functions of (logits, parameters, seed, step) as with SamplingBatch.build, so tokens are identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loom.engine.sample.logits_processors import ProcessorBatch
from loom.engine.sample.sampler import SAMPLING_EPS, SamplingBatch
from loom.engine.worker.step_buffers import StepBuffers

# Row flags
GREEDY = 1
TOP_K = 2
TOP_P = 4
MIN_P = 8
PENALTY = 16
REPETITION = 32
LOGPROBS = 64  # the sampled token's logprob is needed (logprobs, or a cumulative logprob)
PROCESSORS = 128  # logit_bias / allowed_token_ids / bad_words / grammar
HOST_TOKENS = 256  # sampling needs the previous token on the host (grammar, bad_words)
MIN_TOKENS = 512  # min_tokens > 0 with eos / stop ids to mask
IGNORE_EOS = 1024
STOP_IDS = 2048  # stop_token_ids given


class _Pack:
    """The index arrays of one step, uploaded in one copy."""

    def __init__(self):
        self.parts: list[np.ndarray] = []
        self.dev: list[Tensor] = []

    def add(self, a) -> int:
        self.parts.append(np.asarray(a, dtype=np.int64).reshape(-1))
        return len(self.parts) - 1

    def upload(self, buffers: StepBuffers) -> None:
        self.dev = buffers.upload(self.parts, torch.int64) if self.parts else []

    def __getitem__(self, i: int) -> Tensor:
        return self.dev[i]


@dataclass
class StepRows:
    """What a step's sampling needs afterwards: the rows, and the penalty tensors' append positions."""
    rows: np.ndarray  # [S] state row of each sampled sequence
    flags: np.ndarray  # [S] their flags
    pen_rows: Tensor | None = None  # [P] positions in the step of the rows with penalties
    pen_slots: Tensor | None = None  # [P] their slots
    pen_cols: Tensor | None = None  # [P] where their next output id goes


class SamplingState:
    def __init__(self, vocab_size: int, device: torch.device | str, buffers: StepBuffers, eos_token_ids=()):
        self.V = int(vocab_size)
        self.device = torch.device(device)
        self.buffers = buffers  # the model runner's: a step's uploads go through its pinned slots
        self.eos = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self.cap = 0
        self.fparams = np.zeros((0, 6), np.float32)  # temperature, top_p, min_p, repetition, presence, frequency
        self.iparams = np.zeros((0, 2), np.int64)  # top_k (0 = off), seed
        self.flags = np.zeros(0, np.int32)
        self.steps = np.zeros(0, np.int64)  # output tokens so far, counting the one of a step in flight
        self.min_tokens = np.zeros(0, np.int64)
        self.nlogprobs = np.zeros(0, np.int64)  # top-n logprobs wanted
        self.max_out = np.zeros(0, np.int64)  # output count at which the sequence ends by length
        self.pen_slot = np.zeros(0, np.int64)
        self.stop_ids: list = []  # per row: token ids masked while below min_tokens; set of stop_token_ids
        self.stop_token_ids: list = []
        self.fdev = torch.zeros((0, 6), dtype=torch.float32, device=self.device)
        self.idev = torch.zeros((0, 2), dtype=torch.int64, device=self.device)
        self._free: list[int] = []
        self._joined: list[int] = []  # rows whose parameters go to the device with the next step
        # penalty slots: padded prompt and output ids on the device (pad = V), output lengths on the host
        self.pen_cap = 0
        self.pen_prompt = torch.full((0, 1), self.V, dtype=torch.int64, device=self.device)
        self.pen_out = torch.full((0, 1), self.V, dtype=torch.int64, device=self.device)
        self.pen_prompt_len = np.zeros(0, np.int64)
        self.pen_out_len = np.zeros(0, np.int64)
        self._pen_free: list[int] = []
        self._pen_joined: list[tuple[int, list[int] | None, list[int]]] = []  # (slot, prompt or None, output)
        self._grow(64)

    @property
    def num_rows(self) -> int:
        return self.cap - len(self._free)

    # ---- rows ------------------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        old = self.cap

        def ext(a: np.ndarray, fill=0) -> np.ndarray:
            out = np.full((cap,) + a.shape[1:], fill, dtype=a.dtype)
            out[:old] = a
            return out

        self.fparams, self.iparams = ext(self.fparams), ext(self.iparams)
        self.flags, self.steps, self.min_tokens = ext(self.flags), ext(self.steps), ext(self.min_tokens)
        self.nlogprobs, self.max_out, self.pen_slot = ext(self.nlogprobs), ext(self.max_out), ext(self.pen_slot, -1)
        self.stop_ids += [None] * (cap - old)
        self.stop_token_ids += [None] * (cap - old)
        fdev = torch.zeros((cap, 6), dtype=torch.float32, device=self.device)
        idev = torch.zeros((cap, 2), dtype=torch.int64, device=self.device)
        fdev[:old], idev[:old] = self.fdev, self.idev
        self.fdev, self.idev = fdev, idev
        self._free.extend(range(cap - 1, old - 1, -1))  # lowest rows first
        self.cap = cap

    def join(self, seq, eos_token_ids) -> int:
        """Give a sequence its row (it samples for the first time)."""
        if not self._free:
            self._grow(2 * self.cap)
        row = self._free.pop()
        p = seq.params
        temp = float(p.temperature) if p.temperature >= SAMPLING_EPS else 0.0
        top_k = int(p.top_k) if 0 < p.top_k < self.V else 0
        self.fparams[row] = (temp, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        self.iparams[row] = (top_k, seq.seed)
        f = 0
        if temp == 0.0:
            f |= GREEDY
        if top_k:
            f |= TOP_K
        if p.top_p < 1.0:
            f |= TOP_P
        if p.min_p > 0.0:
            f |= MIN_P
        rep = p.repetition_penalty != 1.0
        if rep or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            f |= PENALTY | (REPETITION if rep else 0)
        if p.logprobs is not None or p.cumulative_logprob:
            f |= LOGPROBS
        if seq.constraints is not None or seq.matcher is not None:
            f |= PROCESSORS
        if seq.matcher is not None or (seq.constraints is not None and seq.constraints.bad_words):
            f |= HOST_TOKENS
        if p.ignore_eos:
            f |= IGNORE_EOS
        if p.stop_token_ids:
            f |= STOP_IDS
            self.stop_token_ids[row] = frozenset(p.stop_token_ids)
        masked = [t for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids)) if 0 <= t < self.V]
        if p.min_tokens > 0 and masked:
            f |= MIN_TOKENS
            self.stop_ids[row] = np.asarray(masked, dtype=np.int64)
        self.flags[row] = f
        self.steps[row] = seq.num_output_tokens
        self.min_tokens[row] = p.min_tokens
        self.nlogprobs[row] = p.logprobs or 0
        self.max_out[row] = min(p.max_tokens, seq.max_total_tokens - seq.num_prompt_tokens)
        if f & PENALTY:
            self.pen_slot[row] = self._pen_join(seq, rep)
        self._joined.append(row)
        seq.sampling_row = row
        return row

    def release(self, seq) -> None:
        row = seq.sampling_row
        if row < 0:
            return
        seq.sampling_row = -1
        slot = int(self.pen_slot[row])
        if slot >= 0:
            self._pen_joined = [j for j in self._pen_joined if j[0] != slot]
            self._pen_free.append(slot)
            self.pen_slot[row] = -1
        self.flags[row] = 0
        self.stop_ids[row] = self.stop_token_ids[row] = None
        if row in self._joined:
            self._joined.remove(row)
        self._free.append(row)

    def resync_output(self, seq) -> None:
        """The sequence's output grew outside the sampler (a speculative run of several tokens): its output count,
        and its penalty slot's output ids, rewritten from the sequence with the next step."""
        row = seq.sampling_row
        self.steps[row] = seq.num_output_tokens
        slot = int(self.pen_slot[row])
        if slot < 0:
            return
        out = seq.output_token_ids
        self.pen_out_len[slot] = len(out)
        self._pen_joined = [j for j in self._pen_joined if j[0] != slot]
        self._pen_joined.append((slot, list(seq.prompt_token_ids) if self.flags[row] & REPETITION else None, out))

    # ---- penalty slots ---------------------------------------------------------------------------
    def _pen_join(self, seq, rep: bool) -> int:
        if not self._pen_free:
            self._pen_grow(rows=max(8, 2 * self.pen_cap))
        slot = self._pen_free.pop()
        out = seq.output_token_ids
        self.pen_prompt_len[slot] = seq.num_prompt_tokens if rep else 0
        self.pen_out_len[slot] = len(out)
        self._pen_joined.append((slot, list(seq.prompt_token_ids) if rep else None, out))
        return slot

    def _pen_grow(self, rows: int | None = None, prompt_cols: int | None = None, out_cols: int | None = None) -> None:
        """New device tensors with more slots or columns, the old content copied over (pad = V)."""
        old = self.pen_cap
        rows = rows or old

        def grown(t: Tensor, cols: int | None) -> Tensor:
            cols = max(cols or 0, t.shape[1])
            new = torch.full((rows, cols), self.V, dtype=torch.int64, device=self.device)
            new[:t.shape[0], :t.shape[1]] = t
            return new

        self.pen_prompt = grown(self.pen_prompt, prompt_cols)
        self.pen_out = grown(self.pen_out, out_cols)
        if rows > old:
            self.pen_prompt_len = np.concatenate([self.pen_prompt_len, np.zeros(rows - old, np.int64)])
            self.pen_out_len = np.concatenate([self.pen_out_len, np.zeros(rows - old, np.int64)])
            self._pen_free.extend(range(rows - 1, old - 1, -1))
            self.pen_cap = rows

    # ---- a step ----------------------------------------------------------------------------------
    def batch(self, seqs, rows: np.ndarray) -> tuple[SamplingBatch, StepRows]:
        """The SamplingBatch of the sequences `seqs` (their rows `rows`, in the logits' order)."""
        S = len(rows)
        V = self.V
        fl = self.flags[rows]
        any_f = int(np.bitwise_or.reduce(fl))
        greedy = (fl & GREEDY) != 0
        all_greedy = bool(greedy.all())
        all_random = not (any_f & GREEDY)
        pack = _Pack()
        fpack: list[np.ndarray] = []
        # rows joined since the last step: their parameters go to the device first
        j_rows = j_ints = None
        if self._joined:
            joined = np.asarray(self._joined, dtype=np.int64)
            self._joined = []
            j_rows, j_ints = pack.add(joined), pack.add(self.iparams[joined])
            fpack.append(self.fparams[joined].reshape(-1))
        pj = self._penalty_joins(pack)
        need_rows = (not all_greedy) or bool(any_f & PENALTY)  # per-row parameters are gathered
        i_rows = pack.add(rows) if need_rows else None

        i_random = i_greedy = i_steps = i_kp = None
        no_kp, use_top_p, top_k_max, no_min_p = True, False, 0, True
        if not all_greedy:
            rnd = np.nonzero(~greedy)[0]
            if not all_random:
                i_random, i_greedy = pack.add(rnd), pack.add(np.nonzero(greedy)[0])
            rfl = fl[rnd]
            kp = (rfl & (TOP_K | TOP_P)) != 0
            no_kp = not kp.any()
            if not no_kp:
                use_top_p = bool((rfl & TOP_P).any())
                top_k_max = int(self.iparams[rows[rnd], 0].max())
                if not kp.all():
                    i_kp = pack.add(np.nonzero(kp)[0])
            no_min_p = not (rfl & MIN_P).any()
            i_steps = pack.add(self.steps[rows])

        i_pen = i_slots = i_cols = None
        w_prompt = w_out = 0
        no_pen = not (any_f & PENALTY)
        if not no_pen:
            pen = np.nonzero(fl & PENALTY)[0]
            slots = self.pen_slot[rows[pen]]
            cols = self.pen_out_len[slots]
            w_out = int(cols.max()) + 1
            if w_out > self.pen_out.shape[1]:
                self._pen_grow(out_cols=2 * w_out)
            if (fl[pen] & REPETITION).any():
                w_prompt = max(1, int(self.pen_prompt_len[slots].max()))
            i_pen, i_slots, i_cols = pack.add(pen), pack.add(slots), pack.add(cols)
            self.pen_out_len[slots] = cols + 1

        i_mt_r = i_mt_c = None
        if any_f & MIN_TOKENS:
            act = np.nonzero((fl & MIN_TOKENS) != 0)[0]
            act = act[self.steps[rows[act]] < self.min_tokens[rows[act]]]
            if len(act):
                ids = [self.stop_ids[rows[a]] for a in act]
                i_mt_r = pack.add(np.repeat(act, [len(x) for x in ids]))
                i_mt_c = pack.add(np.concatenate(ids))

        i_lp = None
        need_lp = bool(any_f & LOGPROBS)
        max_lp = 0
        if need_lp:
            lp = np.nonzero(fl & LOGPROBS)[0]
            max_lp = int(self.nlogprobs[rows[lp]].max())
            if len(lp) < S:
                i_lp = pack.add(lp)

        pack.upload(self.buffers)
        if fpack:
            fdev = self.buffers.upload(fpack, torch.float32)[0]
            self.fdev.index_copy_(0, pack[j_rows], fdev.view(-1, 6))
            self.idev.index_copy_(0, pack[j_rows], pack[j_ints].view(-1, 2))
        if pj is not None:
            self._apply_penalty_joins(pack, pj)

        def get(i):
            return None if i is None else pack[i]

        fp = ip = None
        if need_rows:
            rows_dev = pack[i_rows]
            fp = self.fdev.index_select(0, rows_dev)
            ip = self.idev.index_select(0, rows_dev)
        prompt_ids = output_ids = None
        if not no_pen:
            output_ids = self.pen_out.index_select(0, pack[i_slots])[:, :w_out]
            if w_prompt:
                prompt_ids = self.pen_prompt.index_select(0, pack[i_slots])[:, :w_prompt]
        processors = None
        if any_f & PROCESSORS:
            pos = np.nonzero(fl & PROCESSORS)[0].tolist()
            sub = [seqs[i] for i in pos]
            processors = ProcessorBatch.build([s.constraints for s in sub], [s.matcher for s in sub],
                                              [s.output_token_ids for s in sub], V, self.device, rows=pos)

        def col(t: Tensor | None, c: int) -> Tensor | None:
            return None if t is None else t[:, c]

        sb = SamplingBatch(
            temperature=col(fp, 0), top_k=col(ip, 0), top_p=col(fp, 1), min_p=col(fp, 2),
            repetition_penalty=col(fp, 3), presence_penalty=col(fp, 4), frequency_penalty=col(fp, 5),
            seeds=col(ip, 1), steps=get(i_steps), vocab_size=V,
            all_greedy=all_greedy, all_random=all_random, random_rows=get(i_random),
            no_top_k_top_p=no_kp, use_top_p=use_top_p, top_k_max=top_k_max, top_k_top_p_rows=get(i_kp),
            no_min_p=no_min_p, no_penalties=no_pen,
            penalty_rows=None if no_pen or len(pack.parts[i_pen]) == S else pack[i_pen],
            prompt_ids=prompt_ids, output_ids=output_ids,
            min_tokens_rows=get(i_mt_r), min_tokens_cols=get(i_mt_c),
            max_logprobs=max_lp, processors=processors,
            need_logprobs=need_lp, logprob_rows=get(i_lp), greedy_rows=get(i_greedy),
        )
        self.steps[rows] += 1
        return sb, StepRows(rows, fl, get(i_pen), get(i_slots), get(i_cols))

    def after_sample(self, step: StepRows, token_ids: Tensor) -> None:
        """Append the sampled tokens of penalty rows to their output ids, on the device."""
        if step.pen_rows is not None:
            self.pen_out.index_put_((step.pen_slots, step.pen_cols), token_ids.index_select(0, step.pen_rows))

    def _penalty_joins(self, pack: _Pack):
        """Index arrays writing the ids of penalty slots that joined (their prompt and output so far)."""
        if not self._pen_joined:
            return None
        joins, self._pen_joined = self._pen_joined, []
        need_p = max((len(p) for _, p, _ in joins if p is not None), default=0)
        need_o = max(len(o) for _, _, o in joins) + 1
        if need_p > self.pen_prompt.shape[1] or need_o > self.pen_out.shape[1]:
            self._pen_grow(prompt_cols=2 * need_p if need_p > self.pen_prompt.shape[1] else None,
                           out_cols=2 * need_o if need_o > self.pen_out.shape[1] else None)
        slots = np.asarray([s for s, _, _ in joins], dtype=np.int64)
        out = []
        for ids_of in (lambda j: j[1] or [], lambda j: j[2]):
            lists = [ids_of(j) for j in joins]
            lens = [len(x) for x in lists]
            r = np.repeat(slots, lens)
            c = np.concatenate([np.arange(n, dtype=np.int64) for n in lens]) if lens else np.zeros(0, np.int64)
            v = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=sum(lens))
            out.append((pack.add(r), pack.add(c), pack.add(np.minimum(v, self.V))))
        return pack.add(slots), out

    def _apply_penalty_joins(self, pack: _Pack, pj) -> None:
        i_slots, ((pr, pc, pv), (orr, oc, ov)) = pj
        slots = pack[i_slots]
        self.pen_prompt.index_fill_(0, slots, self.V)
        self.pen_out.index_fill_(0, slots, self.V)
        if pack.parts[pv].size:
            self.pen_prompt.index_put_((pack[pr], pack[pc]), pack[pv])
        if pack.parts[ov].size:
            self.pen_out.index_put_((pack[orr], pack[oc]), pack[ov])
