"""The persistent sampling state (loom.engine.sample.sampling_state) against the simple path (SamplingBatch.build from
the sequences' lists), token for token, over a population of sequences that join, sample and leave."""
from __future__ import annotations

import random

import numpy as np
import torch

from loom.engine.core.sequence import Sequence
from loom.engine.sample.logits_processors import build_constraints
from loom.engine.sample.sampler import Sampler, SamplingBatch
from loom.engine.sample.sampling_state import GREEDY, LOGPROBS, SamplingState
from loom.engine.sampling_params import SamplingParams as SP
from loom.engine.worker.step_buffers import StepBuffers

V = 97
EOS = (2,)


def random_params(rng: random.Random) -> SP:
    kind = rng.randrange(8)
    kw = dict(max_tokens=rng.randint(5, 30), seed=rng.randrange(1 << 40) if rng.random() < 0.8 else None)
    if kind == 0:
        kw.update(temperature=0.0)
    elif kind == 1:
        kw.update(temperature=0.0, logprobs=rng.randint(0, 4), repetition_penalty=1.4)
    elif kind == 2:
        kw.update(temperature=rng.uniform(0.3, 1.5), top_k=rng.choice([0, 5, 40, V + 3]), top_p=rng.choice([1.0, 0.8]))
    elif kind == 3:
        kw.update(temperature=0.9, min_p=0.05, presence_penalty=0.6, frequency_penalty=-0.3, cumulative_logprob=True)
    elif kind == 4:
        kw.update(temperature=0.7, min_tokens=4, stop_token_ids=[5, 6], repetition_penalty=0.8, logprobs=2)
    elif kind == 5:
        kw.update(temperature=1.0, logit_bias={3: 5.0, 4: -100.0}, allowed_token_ids=list(range(3, 40)))
    elif kind == 6:
        kw.update(temperature=0.0, min_tokens=2, ignore_eos=True)
    else:
        kw.update(temperature=1.3, top_k=3, frequency_penalty=1.0)
    return SP(**kw)


def make_seq(rng: random.Random, i: int) -> Sequence:
    p = random_params(rng)
    prompt = [rng.randrange(3, V) for _ in range(rng.randint(1, 12))]
    seq = Sequence(f"r{i}", prompt, p, p.seed if p.seed is not None else rng.randrange(1 << 40),
                   max_total_tokens=len(prompt) + p.max_tokens, constraints=build_constraints(p, V))
    return seq


def stop_ids(seq: Sequence) -> list[int]:
    return list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(EOS))


def test_persistent_state_samples_what_the_simple_path_samples():
    rng = random.Random(0)
    torch.manual_seed(0)
    state = SamplingState(V, "cpu", StepBuffers({}, torch.device("cpu")))
    sampler = Sampler()
    live: list[Sequence] = []
    made = 0
    checked_lp = 0
    seen = {"penalties": 0, "min_tokens": 0, "processors": 0, "mixed": 0, "top_k_top_p": 0}
    for step in range(60):
        for _ in range(rng.randint(0, 4) if step < 45 else 0):  # arrivals
            live.append(make_seq(rng, made))
            made += 1
        if not live:
            continue
        seqs = [s for s in live if rng.random() < 0.85]  # some sit out a step (prefill chunks, preempted)
        if not seqs:
            continue
        rng.shuffle(seqs)
        logits = torch.randn(len(seqs), V) * 3
        ref_b = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs],
                                    [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                                    [stop_ids(s) for s in seqs], V, "cpu", constraints=[s.constraints for s in seqs],
                                    want_logprobs=[s.wants_logprob for s in seqs])
        ref = sampler(logits.clone(), ref_b)
        rows = [s.sampling_row if s.sampling_row >= 0 else state.join(s, EOS) for s in seqs]
        b, step_rows = state.batch(seqs, np.asarray(rows, dtype=np.int64))
        got = sampler(logits.clone(), b)
        state.after_sample(step_rows, got.token_ids)
        seen["penalties"] += (not b.no_penalties) and b.output_ids.shape[1] > 2 and b.prompt_ids is not None
        seen["min_tokens"] += b.min_tokens_rows is not None
        seen["processors"] += b.processors is not None
        seen["mixed"] += not (b.all_greedy or b.all_random)
        seen["top_k_top_p"] += (not b.no_top_k_top_p) and b.use_top_p and b.top_k_top_p_rows is not None
        assert got.token_ids.tolist() == ref.token_ids.tolist(), step
        assert (got.logprobs is None) == (ref.logprobs is None)
        if ref.logprobs is not None:
            assert torch.equal(got.logprobs, ref.logprobs)
            assert (got.topk_ids is None) == (ref.topk_ids is None)
            if ref.topk_ids is not None:
                assert torch.equal(got.topk_ids, ref.topk_ids) and torch.equal(got.topk_logprobs, ref.topk_logprobs)
            checked_lp += 1
        for s, t in zip(seqs, got.token_ids.tolist()):
            s.token_ids.append(t)
        for s in list(live):  # leave: by length, or at random (aborts)
            if s.num_output_tokens >= s.params.max_tokens or rng.random() < 0.03:
                state.release(s)
                live.remove(s)
    assert made > 60 and checked_lp > 10 and all(v > 5 for v in seen.values()), seen
    for s in live:
        state.release(s)
    assert state.num_rows == 0


def test_flags_and_nothing_unasked():
    """A greedy batch without logprobs uploads nothing and computes no logprob; rows come back after release."""
    state = SamplingState(V, "cpu", StepBuffers({}, torch.device("cpu")))
    seqs = [Sequence(f"g{i}", [5, 6], SP(temperature=0.0), i) for i in range(3)]
    rows = np.asarray([state.join(s, EOS) for s in seqs])
    assert all(state.flags[r] == GREEDY for r in rows)
    b, _ = state.batch(seqs, rows)
    assert b.all_greedy and not b.need_logprobs and b.temperature is None and b.processors is None
    out = Sampler()(torch.randn(3, V), b)
    assert out.logprobs is None and out.topk_ids is None
    lp = Sequence("l", [5], SP(temperature=0.0, cumulative_logprob=True), 9)
    r = state.join(lp, EOS)
    assert state.flags[r] & LOGPROBS
    b, _ = state.batch(seqs + [lp], np.append(rows, r))
    assert b.need_logprobs and b.logprob_rows.tolist() == [3] and b.max_logprobs == 0
    for s in seqs + [lp]:
        state.release(s)
    assert state.num_rows == 0 and sorted(state._free)[:4] == [0, 1, 2, 3]
