"""Speculative decoding's verify steps as CUDA graphs: one graph per batch-size bucket of rows of up to 1 + k tokens.

A verify step (loom.engine.spec_decode) has rows of 1 + k_i tokens, a decode row's last token and its k_i <= k
proposals, beside plain decode rows (k_i = 0). A graph cannot follow the step's shape, so it is captured for the
widest: bucket b (the decode graphs' buckets, loom.engine.worker.cuda_graphs) holds b rows of up to w = 1 + k query
tokens, b * w token rows in all, every row through the paged prefill attention (query length w at most, the grid's
constant). What changes from step to step is data in the runner's persistent buffers: the step's tokens sit packed
at the front, as the eager layout has them (so the verify rows' logits indices are the eager path's), each row's
query range in prefill_cu and its context in seq_lens; rows past the step's are empty (query length 0, context
0: their attention programs return at once) and token rows past its tokens are padding (token 0 at position 0, slot
-1 so nothing is stored, in no row: no attention reads or writes them, and every other op works row by row, so they
touch no real row). The graph writes the final hidden states of its b * w token rows into the runner's
verify_hidden; lm_head then runs eagerly on the rows verification needs (loom.engine.worker.compiled_forward
.logits_of), as after a decode graph.

Everything else is the decode graphs': the capture (one pool shared with them, the capture stream), LoRA groups in
static buffers and the graph keys by LoRA module groups, steps with expert LoRA run eagerly. Any step whose rows all
have at most w tokens fits (a step of short prompts' prefills too); one with more rows than the largest bucket, or a
longer row (a prefill chunk), runs eagerly. capture=False (CPU, tests) runs
the same staging and calls the forward where CUDA would replay.

Decode rows go through the prefill kernel here (query length 1), the decode kernel in the eager path: the same
attention, rounded in another order.
"""
from __future__ import annotations

import numpy as np

from loom.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from loom.layers.forward_context import AttentionMeta, ForwardContext, LoraBatchMeta, forward_context


class VerifyGraphs(DecodeGraphs):
    def __init__(self, runner, capture: bool, pool=None):
        """pool: the decode graphs' memory pool (CUDA), shared: a capture keeps no tensor of its own."""
        super().__init__(runner, capture)
        self.width = runner.verify_width()
        self.max_batch = runner.verify_graph_max_batch()
        self.buckets = graph_batch_sizes(self.max_batch)
        self.hidden = runner.verify_hidden  # [max_batch * width, hidden]
        if pool is not None:
            self._pool = pool

    def tokens_of(self, b: int) -> int:
        return b * self.width

    def _forward_fn(self, b: int, key: frozenset | None):
        r = self.runner
        dev = r.buffers.device_view
        n, width = self.tokens_of(b), r.max_blocks_per_seq
        rows = AttentionMeta(dev("prefill_cu", b + 1), dev("seq_lens", b), dev("block_tables", b, width), self.width,
                             width * r.block_size)
        ctx = ForwardContext(positions=dev("positions", n), slot_mapping=dev("slot_mapping", n), num_decode_seqs=0,
                             decode=None, prefill=rows, logits_indices=dev("logits_indices", b),
                             lora=None if key is None else self._static_lora(b, key))
        ids, model, out = dev("input_ids", n), r.model, self.hidden[:n]

        def forward() -> None:
            with forward_context(ctx):
                out.copy_(model(ids, ctx.positions))

        return forward

    def _stage_padding_rows(self, b: int) -> None:
        self.runner.buffers.host("prefill_cu", b + 1)[:] = 0  # every row empty

    def run(self, batch, lora: LoraBatchMeta | None, extra_rows: list[int] | None = None, fill=None):
        """Serve a step whose rows all have at most `width` tokens, one at least two (decode-only steps are the
        decode graphs'), from its bucket's graph: -> float32 logits of the sampled rows then of `extra_rows` (flat
        token indices, as the eager path takes them), and the sampled sequences' indices; None when the step is
        not one for this path."""
        s = len(batch.seqs)
        counts = batch.num_scheduled_tokens
        if s == 0 or batch.num_decode_seqs == s or max(counts) > self.width or (
                lora is not None and lora.experts is not None):
            return None
        b = self.bucket(s)
        if b is None:
            return None
        key = self._serving_key(b, lora)
        r = self.runner
        _, _, sampled = r.prepare(batch, lora, extra_rows, pad_to=self.tokens_of(b), fill=fill, pad_seqs=b)
        cu = r.buffers.host("prefill_cu", b + 1)
        cu[0] = 0
        np.cumsum(counts, out=cu[1:s + 1])
        cu[s + 1:] = cu[s]  # rows past the step's: no query
        return self._stage_and_replay(b, key, lora, fill, len(sampled) + len(extra_rows or ())), sampled
