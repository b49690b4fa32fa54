"""Draft-model proposals: a small model with the target's vocabulary, on its own share of the paged KV blocks.

The draft's KV lives beside the target's under the same block ids (a second cache of the same block count; the
KV budget is split between the two, loom.engine.worker.model_runner kv_share_bytes): one block table per
sequence, one block manager. So prefix caching, forks (n > 1), preemption and freeing are the target's, and
whatever block holds a computed token of the target holds the draft's KV of it too, because every target forward
is mirrored by a draft forward over the same tokens, positions and slots (`mirror`, KV only, no adapter).

Proposing (`propose`, before the scheduler walks the running decodes): for each sequence, k single-token draft
forwards, batched over the sequences, from its last token (not computed yet by either model) on, each drawing
d_j from the draft's distribution q_j after the request's own processors and filters (greedy rows: the argmax;
random rows: a counter-uniform draw from its own stream, so seeded requests reproduce) and, under a grammar, the
mask of the grammar's state after d_1..d_{j-1} (a fork of the sequence's matcher). The draft's KV of those
positions is written into the sequence's blocks past its computed tokens; the verify row rewrites them.

The target runs with the request's LoRA adapter; the draft runs without one, or with the draft adapter of the same
name under speculative_config.draft_adapter_roots (loom.engine.spec_decode.draft_adapters), in its proposing
forwards and its mirror of the target's.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from loom.engine.core.scheduler import ScheduledBatch
from loom.engine.core.sequence import Sequence
from loom.engine.sample.sampler import SAMPLING_EPS, Sampler, SamplingBatch
from loom.engine.sample.sampling_rng import counter_uniform, mix64, sample_from_logits
from loom.engine.spec_decode.draft_adapters import DraftAdapters
from loom.errors import ConfigError
from loom.kernels import argmax
from loom.layers.forward_context import forward_context

DRAFT_STREAM = 0x2545F4914F6CDD1D  # xor'ed into the mixed seed: the draft's draws, independent of the target's


@dataclass
class Proposal:
    """Proposed tokens; q [k, V] the probabilities each was drawn from (None: greedy or point masses); masks the
    grammar's bitmask rows for the verify positions 0..k (None: no grammar)."""
    tokens: list[int]
    q: torch.Tensor | None = None
    masks: list | None = None

    def cut(self, k: int) -> "Proposal":
        if k >= len(self.tokens):
            return self
        return Proposal(self.tokens[:k], None if self.q is None else self.q[:k],
                        None if self.masks is None else self.masks[:k + 1])


class _View:
    """What the model runner reads of a sequence, for a draft forward of its last known token."""
    __slots__ = ("num_computed_tokens", "token_ids", "block_table", "table_epoch")

    def __init__(self, seq: Sequence):
        self.token_ids = seq.token_ids
        self.num_computed_tokens = len(seq.token_ids) - 1
        self.block_table = seq.block_table
        self.table_epoch = seq.table_epoch


class RecordingMatcher:
    """A grammar matcher fork that keeps a copy of each bitmask row it fills (the verify rows reuse them)."""

    def __init__(self, matcher):
        self.m = matcher
        self.rows: list[torch.Tensor] = []

    def fill_next_token_bitmask(self, bitmask, r: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, r)
        self.rows.append(bitmask[r].clone())


class FixedMask:
    """A bitmask row computed earlier, in the matcher interface ProcessorBatch.apply_grammar calls."""

    def __init__(self, row: torch.Tensor | None):
        self.row = row

    def fill_next_token_bitmask(self, bitmask, r: int) -> None:
        if self.row is None:
            bitmask[r].fill_(-1)  # past the grammar's end: every token (the run is cut before this row's token)
        else:
            bitmask[r].copy_(self.row)


def check_vocabulary(target_dir: str, draft_dir: str, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft model that does not share the target's vocabulary, naming what differs."""
    if draft_vocab != target_vocab:
        raise ConfigError("speculative_config.model", f"the draft's vocab_size {draft_vocab} differs from the "
                          f"target's {target_vocab}: a draft model must use the target's tokenizer")
    t_tok, d_tok = (os.path.join(d, "tokenizer.json") for d in (target_dir, draft_dir))
    if os.path.isfile(t_tok) != os.path.isfile(d_tok):
        raise ConfigError("speculative_config.model", "one of the target and the draft has a tokenizer.json and the "
                          "other has none: a draft model must use the target's tokenizer")
    if os.path.isfile(t_tok):
        with open(t_tok) as f:
            t_vocab = json.load(f).get("model", {}).get("vocab")
        with open(d_tok) as f:
            d_vocab = json.load(f).get("model", {}).get("vocab")
        if t_vocab != d_vocab:
            raise ConfigError("speculative_config.model", "the draft's tokenizer vocabulary differs from the "
                              "target's: a draft model must use the target's tokenizer")


class DraftModel:
    def __init__(self, runner, vocab_size: int, adapters: DraftAdapters | None = None):
        self.runner = runner  # loom.engine.worker.model_runner.ModelRunner of the draft, KV blocks as the target's
        self.vocab_size = vocab_size
        self.device = runner.device
        self.sampler = Sampler()
        self.adapters = adapters  # the draft's own adapters (draft_adapter_roots), or None

    def prefetch(self, target) -> None:
        """A request with target adapter `target` (an AdapterRef) arrived: its twin starts loading."""
        if self.adapters is not None:
            self.adapters.prefetch(target)

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()

    def _lora(self, seqs, num_tokens: list[int]):
        """The draft forward's LoRA metadata (each sequence's twin of its target adapter), or None."""
        if self.adapters is None or all(s.adapter is None for s in seqs):
            return None
        return self.adapters.meta([s.adapter for s in seqs], num_tokens)

    @classmethod
    def load(cls, config, target_dir: str):
        """The draft's runner (KV not allocated yet: allocate_kv(target's block count) once the target sized it)."""
        from loom.engine.worker.model_runner import ModelRunner
        from loom.models.loader import load_hf_config

        path = config.speculative_config.model
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError("speculative_config.model", f"{path!r} is not a model directory (no config.json)")
        # the target's context length: the draft's block tables are as wide as the target's
        max_len = config.max_model_len or int(getattr(load_hf_config(target_dir), "max_position_embeddings", 4096)
                                              or 4096)
        dcfg = replace(config, model=path, speculative_config=None, cuda_graphs=False, kv_cache_memory_bytes=0,
                       max_model_len=max_len, lora_memory_bytes=0, lora_expert_memory_bytes=0, adapter_roots=[],
                       adapter_sources=[])
        runner = ModelRunner(dcfg, path, defer_kv=True)
        # the twins' pools exist before the target sizes its KV cache (on CUDA its profile sees them as used)
        adapters = DraftAdapters(config, runner) if config.speculative_config.draft_adapter_roots else None
        return cls(runner, runner.vocab_size, adapters)

    def mirror(self, batch: ScheduledBatch) -> None:
        """The target's step over the draft: the same tokens at the same slots, KV only (no logits), each sequence with
        its twin adapter if it has one."""
        r = self.runner
        with torch.inference_mode():
            ids, ctx, _ = r.prepare(batch, self._lora(batch.seqs, batch.num_scheduled_tokens))
            ctx = replace(ctx, logits_indices=ctx.logits_indices[:0])
            with forward_context(ctx):
                r.forward(ids, ctx.positions, ctx.logits_indices)

    def propose(self, seqs: list[Sequence], ks: list[int], sampling_lists) -> list[Proposal]:
        """Up to ks[i] tokens for each sequence (its blocks hold positions up to len(token_ids) - 1 + ks[i]);
        sampling_lists(seq) -> (stop ids, wants logprob) as the verifier builds its rows. token_ids are left as
        they were."""
        props = [Proposal([], [], None) for _ in seqs]
        forks = [RecordingMatcher(s.matcher.fork()) if s.matcher is not None else None for s in seqs]
        live = list(range(len(seqs)))
        try:
            while live:
                views = [_View(seqs[i]) for i in live]
                lora = self._lora([seqs[i] for i in live], [1] * len(live))
                with torch.inference_mode():
                    logits, _ = self.runner.run(ScheduledBatch(views, [1] * len(views), len(views)), lora)
                    toks, q = self._draw([seqs[i] for i in live], [forks[i] for i in live], logits, sampling_lists)
                nxt = []
                for row, i in enumerate(live):
                    t = toks[row]
                    seqs[i].token_ids.append(t)
                    props[i].tokens.append(t)
                    if q is not None and seqs[i].params.temperature >= SAMPLING_EPS:
                        props[i].q.append(q[row])
                    f = forks[i]
                    ended = False
                    if f is not None:
                        ended = not f.m.accept_token(t) or f.m.is_terminated()
                    if len(props[i].tokens) < ks[i] and not ended:
                        nxt.append(i)
                live = nxt
        finally:
            for s, p in zip(seqs, props):
                if p.tokens:
                    del s.token_ids[-len(p.tokens):]
        for p, f in zip(props, forks):
            p.q = torch.stack(p.q) if p.q else None
            if f is not None:  # the rows of positions 0..k-1 were recorded; the bonus row's state follows d_k
                masks = f.rows[:len(p.tokens)]
                if f.m.is_terminated():
                    masks.append(None)
                else:
                    bm = _one_bitmask(self.vocab_size)
                    f.m.fill_next_token_bitmask(bm, 0)
                    masks.append(bm[0].clone())
                p.masks = masks
        return props

    def _draw(self, seqs: list[Sequence], forks, logits: torch.Tensor, sampling_lists):
        """Each row's draft token, and the probabilities of the random rows' draws ([n, V], zeros on greedy rows;
        None when every row is greedy)."""
        stops, want = zip(*(sampling_lists(s) for s in seqs))
        b = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], [s.prompt_token_ids for s in seqs],
                                [s.output_token_ids for s in seqs], list(stops), self.vocab_size, self.device,
                                constraints=[s.constraints for s in seqs],
                                matchers=forks if any(f is not None for f in forks) else None,
                                want_logprobs=[False] * len(seqs))
        _, x, xr = self.sampler.filtered(logits, b)
        n = logits.shape[0]
        toks = torch.empty(n, dtype=torch.int64, device=logits.device)
        q = None
        if b.all_greedy or b.greedy_rows is not None:
            g = torch.arange(n, device=logits.device) if b.all_greedy else b.greedy_rows
            toks.index_copy_(0, g, argmax(x.index_select(0, g)))
        if xr is not None:
            rows = torch.arange(n, device=logits.device) if b.random_rows is None else b.random_rows
            u = counter_uniform(mix64(b.random_part(b.seeds)) ^ DRAFT_STREAM, b.random_part(b.steps))
            toks.index_copy_(0, rows, sample_from_logits(xr, u))
            q = torch.zeros(n, logits.shape[1], dtype=torch.float32, device=logits.device)
            q.index_copy_(0, rows, torch.softmax(xr.double(), dim=-1).float())
        return toks.tolist(), q


def _one_bitmask(vocab_size: int):
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(1, vocab_size)
