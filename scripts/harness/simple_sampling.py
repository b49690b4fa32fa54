"""The simple sampling path: the reference the engine's persistent sampling state is tested (and benchmarked)
against. Every step rebuilds the sampling tensors from the sequences' Python lists (SamplingBatch.build), so it
reads each sequence's last token on the host: synchronous only.

    use_simple_sampling(engine)   # before the first request
"""
from __future__ import annotations

import numpy as np
import torch

from loom.engine.core.output_processor import LaunchedStep
from loom.engine.sample.sampler import SamplerOutput, SamplingBatch


def simple_sample(engine, launched: LaunchedStep, logits: torch.Tensor) -> SamplerOutput:
    """LLMEngine._sample from the sequences' lists: the same draws, and the same notes in `launched`."""
    seqs = launched.seqs
    ps = [s.params for s in seqs]
    stops = [list(p.stop_token_ids) + ([] if p.ignore_eos else list(engine.eos_token_ids)) for p in ps]
    sb = SamplingBatch.build(ps, [s.seed for s in seqs], [s.prompt_token_ids for s in seqs],
                             [s.output_token_ids for s in seqs], stops, engine.runner.vocab_size, logits.device,
                             constraints=[s.constraints for s in seqs], matchers=[s.matcher for s in seqs],
                             want_logprobs=[s.wants_logprob for s in seqs])
    out = engine.sampler(logits, sb)
    launched.nout = np.asarray([s.num_output_tokens + 1 for s in seqs], dtype=np.int64)
    launched.max_out = np.asarray([min(p.max_tokens, s.max_total_tokens - s.num_prompt_tokens)
                                   for p, s in zip(ps, seqs)], dtype=np.int64)
    launched.min_tokens = np.asarray([p.min_tokens for p in ps], dtype=np.int64)
    launched.ignore_eos = np.asarray([p.ignore_eos for p in ps], dtype=bool)
    launched.stop_ids = {i: frozenset(p.stop_token_ids) for i, p in enumerate(ps) if p.stop_token_ids}
    launched.lp_pos = np.asarray([i for i, s in enumerate(seqs) if s.wants_logprob], dtype=np.int64)
    launched.needs_host_tokens = any(s.matcher is not None or (s.constraints is not None and s.constraints.bad_words)
                                     for s in seqs)
    launched.processors = sb.processors
    return out


def use_simple_sampling(engine) -> None:
    """Switch an engine to the simple path (and to synchronous steps) before it has requests."""
    if engine.requests or engine._inflight is not None:
        raise RuntimeError("switch the sampling path before adding requests")
    engine._sample = lambda launched, logits: simple_sample(engine, launched, logits)
    engine.async_scheduling = False
