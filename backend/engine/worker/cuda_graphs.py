"""Decode steps as CUDA graphs: one graph per batch-size bucket, replayed over persistent input buffers.

A decode-only step of B sequences runs in the smallest bucket b >= B (1, 2, 4, 8, then multiples of 8): its
rows are staged into the runner's persistent buffers padded to b rows (token 0 at position 0, slot -1 so nothing
is stored, context length 0 so attention returns zeros), the graph captured for b replays the model up to the
final hidden states, which it writes into the first b rows of the runner's graph_hidden, and lm_head then runs
eagerly on the sampled rows only (loom.engine.worker.compiled_forward.logits_of, as the eager forward): padded rows
never get vocabulary-wide work. Every kernel argument of a captured launch is fixed: block tables as wide as
max_model_len, the decode split count chosen from b, LoRA tiles from b and max_lora_rank, flash-decoding's ticket
counters the runner's one buffer (zero between launches, so every replay finds them as the capture did).

Memory (what loom.engine.worker.memory_profile must leave room for, and counts exactly): every graph is warmed up and
captured on the runner's one capture stream, into one shared pool, largest bucket first. A capture keeps no
tensor of its own - its output goes to graph_hidden, allocated before KV sizing - so what a capture frees is
free in the pool for the next one, and the pool stays at one forward of the largest bucket however many graphs
and LoRA keys are captured. (Before: each graph kept its own [b, vocab] float32 logits in the pool, for every
bucket and key - over 1 GiB for a 128k vocabulary at the default buckets - and each capture warmed up on a new
stream, each with a cuBLAS workspace of its own for the process's life.)

LoRA: the step's adapter grouping (LoraBatchMeta) is copied into static buffers of b groups (groups past the
step's have no tokens and rank 0, tokens past its LoRA tokens are in no group), so a mixed-adapter step replays
too. Graphs are keyed by the module groups the step's adapters target (attention only, ..., all), since a layer
whose group no adapter targets skips LoRA: one key without LoRA and one with every group are captured at start,
others on first use (at most MAX_LORA_KEYS; beyond that the all-groups graph serves, adding zero rows). Steps with
expert LoRA, prompt logprobs or more than the largest bucket's sequences run eagerly.

capture=False (CPU, tests) runs the same staging and padding and calls the forward eagerly where CUDA would
replay: identical tokens with and without this path is what the CPU tests check. The CUDA-only part is
_CapturedGraph. Speculative decoding's verify steps replay graphs of their own on this machinery (tokens_of, the
staging and replay; loom.engine.worker.verify_graphs).

Tensor parallelism: every rank captures its own graphs, the model's collectives (NCCL all-reduces) inside them. A
capture records a collective without running it, so the ranks must record theirs in the same order: capture_all
runs the same (bucket, key) sequence on every rank (checked across the ranks before and after), and rank 0 alone
decides each step's graph - its bucket and LoRA key go in the step header (loom.distributed.step_broadcast), with
the bucket's padded rows as the payload - so a worker replays (or, for a LoRA key first needed then, captures) the
same graph at the same time (run_sent). lm_head and the gather of the logits run after the replay, eagerly.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from loom.distributed.step_broadcast import GraphKey
from loom.engine.worker.compiled_forward import logits_of
from loom.layers.forward_context import AttentionMeta, ForwardContext, LoraBatchMeta, forward_context

log = logging.getLogger("loom")

MAX_LORA_KEYS = 4  # module-group sets captured besides "none" and "all"


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Buckets up to max_batch: 1, 2, 4, 8, 16, 24, ... (at most 7 padding rows past 8), and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class _CapturedGraph:
    """CUDA only: the forward of one bucket captured once on `stream` into `pool`, replayed per step."""

    def __init__(self, fn, pool, stream):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a first run outside capture, on the capture stream: lazy inits
            fn()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a capture while serving must not fail on what another thread (the adapter loader pinning
        # host memory) does meanwhile
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            fn()
        torch.cuda.current_stream().wait_stream(stream)

    def __call__(self) -> None:
        self.graph.replay()


class _Eager:
    """capture=False: the same forward over the same static context, run when called."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


class DecodeGraphs:
    def __init__(self, runner, capture: bool):
        self.runner = runner
        self.capture = capture
        self.max_batch = runner.graph_max_batch()
        self.buckets = graph_batch_sizes(self.max_batch)
        self._graphs: dict[tuple[int, frozenset | None], _CapturedGraph | _Eager] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # one pool for every graph
        self._stream = runner.capture_stream() if capture else None
        self.hidden = runner.graph_hidden  # [max_batch, hidden]: every graph's output rows
        # LoRA module groups with pools attached (checked when graphs are made: after the registry attached them)
        self.lora_groups = frozenset(m.lora_group for m in runner.model.lora_modules().values()
                                     if m.lora_a is not None and m.lora_group is not None
                                     and not m.lora_group.startswith("experts"))
        self.replays = 0  # steps served by this path (tests, metrics)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def lora_key(self, lora: LoraBatchMeta | None) -> frozenset | None:
        if lora is None or lora.token_indices.numel() == 0 or not self.lora_groups:
            return None
        groups = self.lora_groups if lora.module_groups is None else frozenset(lora.module_groups)
        return (groups & self.lora_groups) or None

    # ---- capture ---------------------------------------------------------------------------------
    def capture_all(self) -> int:
        """Start-up: every bucket without LoRA and, when pools are attached, with every LoRA group; -> graphs.
        Under tensor parallelism every rank runs this at the same point, and the ranks' plans and captures are
        compared (a rank that captured other graphs would record its collectives out of order)."""
        keys = [None] + ([self.lora_groups] if self.lora_groups else [])
        plan = [(b, key) for key in keys for b in reversed(self.buckets)]  # largest first: smaller graphs reuse its
        tp = self.runner.tp                                                 # pool memory
        if tp is not None:
            check_same_graphs(tp, plan, "plan to capture")
        for b, key in plan:
            self._get(b, key, stage_padding=True)
        if tp is not None:
            check_same_graphs(tp, list(self._graphs), "captured")
        return len(self._graphs)

    def _get(self, b: int, key: frozenset | None, stage_padding: bool = True):
        g = self._graphs.get((b, key))
        if g is None:
            fn = self._forward_fn(b, key)
            if stage_padding:  # a capture's first run reads the inputs: make them a valid (empty) batch
                self._stage_padding(b, key)
            if self.capture:
                g = _CapturedGraph(fn, self._pool, self._stream)
            else:
                g = _Eager(fn)
                if stage_padding:  # start-up without capture: still launch what a capture would
                    g()
            self._graphs[(b, key)] = g
        return g

    def tokens_of(self, b: int) -> int:
        """Token rows of bucket b's graph (a decode row is one token)."""
        return b

    def _static_lora(self, b: int, key: frozenset) -> LoraBatchMeta:
        dev = self.runner.buffers.device_view
        n = self.tokens_of(b)
        return LoraBatchMeta(
            token_indices=dev("lora_tokens", n), seg_starts=dev("lora_seg", b + 1), row_start=dev("lora_rows", b),
            ranks=dev("lora_ranks", b), scalings=dev("lora_scalings", b),
            max_rank=self.runner.config.max_lora_rank, max_seg_len=n, module_groups=key)

    def _static_ctx(self, b: int, rows: int, lora: LoraBatchMeta | None) -> ForwardContext:
        """The context over the static buffers' first b rows (rows: logits rows)."""
        r = self.runner
        dev = r.buffers.device_view
        width = r.max_blocks_per_seq
        decode = AttentionMeta(dev("cu_seqlens", b + 1), dev("seq_lens", b), dev("block_tables", b, width), 1,
                               width * r.block_size)
        return ForwardContext(positions=dev("positions", b), slot_mapping=dev("slot_mapping", b), num_decode_seqs=b,
                              decode=decode, prefill=None, logits_indices=dev("logits_indices", rows), lora=lora)

    def _forward_fn(self, b: int, key: frozenset | None):
        r = self.runner
        ctx = self._static_ctx(b, b, None if key is None else self._static_lora(b, key))
        ids, model, out = r.buffers.device_view("input_ids", b), r.model, self.hidden[:b]

        def forward() -> None:
            with forward_context(ctx):
                out.copy_(model(ids, ctx.positions))  # a capture keeps no output of its own

        return forward

    def run_padding(self, b: int) -> None:
        """The forward a capture of bucket b (without LoRA) records, run once over all-padding inputs: what the
        memory profile measures."""
        self._stage_padding(b, None)
        self._forward_fn(b, None)()

    def _stage_padding_rows(self, b: int) -> None:
        """What else a padding capture's rows need (verify graphs: their empty prefill rows)."""

    def _stage_padding(self, b: int, key: frozenset | None) -> None:
        """All-padding inputs for a capture: no token stored, every context empty, no LoRA token."""
        buf = self.runner.buffers
        n = self.tokens_of(b)
        buf.begin()
        buf.host("input_ids", n)[:] = 0
        buf.host("positions", n)[:] = 0
        buf.host("slot_mapping", n)[:] = -1
        self._stage_padding_rows(b)
        buf.host("seq_lens", b)[:] = 0
        buf.host("block_tables", b, self.runner.max_blocks_per_seq)[:] = 0
        self.runner.forget_block_tables()
        if key is not None:
            self._stage_lora_groups(b, [0], [], [], [])
        buf.commit()

    # ---- one step ----------------------------------------------------------------------------------
    def run(self, batch, lora: LoraBatchMeta | None, fill=None) -> tuple[torch.Tensor, list[int]] | None:
        """Serve a decode-only step from its bucket's graph (-> float32 logits of the sampled rows, their indices);
        None when the step is not one for this path.
        fill: ModelRunner's TokenFill (async scheduling), written into the static input ids before the replay."""
        n = len(batch.seqs)
        if n == 0 or batch.num_decode_seqs != n or (lora is not None and lora.experts is not None):
            return None
        b = self.bucket(n)
        if b is None:
            return None
        key = self._serving_key(b, lora)
        _, _, sampled = self.runner.prepare(batch, lora, pad_to=b, fill=fill)
        return self._stage_and_replay(b, key, lora, fill, len(sampled)), sampled

    def _serving_key(self, b: int, lora: LoraBatchMeta | None) -> frozenset | None:
        """The graph key a step of bucket b with this LoRA grouping replays (a lazy capture's key, or the all-groups
        graph once MAX_LORA_KEYS lazy keys exist)."""
        key = self.lora_key(lora)
        if self.capture and (b, key) not in self._graphs and key not in (None, self.lora_groups):
            lazy = {k for _, k in self._graphs} - {None, self.lora_groups}
            if key not in lazy and len(lazy) >= MAX_LORA_KEYS:
                key = self.lora_groups  # zero rows for the groups no adapter targets: the same result
            else:
                log.info("capturing the CUDA graph of batch %d with LoRA on %s", b, sorted(key))
        return key

    def _stage_and_replay(self, b: int, key: frozenset | None, lora: LoraBatchMeta | None, fill,
                          num_logits: int) -> torch.Tensor:
        """The step's inputs are staged (not committed): its LoRA rows too, commit, replay (under tensor parallelism
        the workers replay the same graph over the same rows: run_sent); -> float32 logits of the first num_logits
        logits_indices."""
        r = self.runner
        if key is not None:
            self._stage_lora(b, lora)
        r.buffers.commit()
        r.fill_ids(r.buffers.device_view("input_ids", self.tokens_of(b)), fill)
        if key is not None:
            r.buffers.device_view("lora_tokens", lora.token_indices.numel()).copy_(lora.token_indices,
                                                                                    non_blocking=True)
        idx = r.buffers.device_view("logits_indices", num_logits)
        if r.tp is None:
            return self._replay(b, key, idx)
        with r.tp.step_guard():
            ids = r.buffers.device_view("input_ids", b)
            r.send_step(ids, self._static_ctx(b, num_logits, None if key is None else lora), (b, key))
            return self._replay(b, key, idx)

    def _replay(self, b: int, key: frozenset | None, idx: torch.Tensor) -> torch.Tensor:
        # a graph first needed now is captured over this step's staged inputs (its first run is this step's)
        self._get(b, key, stage_padding=False)()
        self.replays += 1
        return logits_of(self.runner.model, self.hidden, idx)

    def run_sent(self, graph: GraphKey, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Ranks 1..N-1: rank 0's graph step - its bucket and LoRA key, the bucket's rows it sent (ctx.lora: the
        step's own grouping) - staged into this rank's static buffers and replayed; -> this rank's logits share."""
        b, key = graph
        r = self.runner
        buf, dev = r.buffers, r.buffers.device_view
        if key is not None:
            if ctx.lora is None:
                raise RuntimeError(f"rank 0 sent a decode-graph step with LoRA on {sorted(key)} but no adapter "
                                   "grouping")
            buf.begin()
            self._stage_lora(b, ctx.lora)
            buf.commit()  # before the copies below: it rewrites the int32 buffers' prefix from the host
            dev("lora_tokens", ctx.lora.token_indices.numel()).copy_(ctx.lora.token_indices)
        for name, src in (("input_ids", ids), ("positions", ctx.positions), ("slot_mapping", ctx.slot_mapping),
                          ("seq_lens", ctx.decode.seq_lens)):
            dev(name, b).copy_(src)
        dev("block_tables", b, r.max_blocks_per_seq).copy_(ctx.decode.block_tables)
        return self._replay(b, key, ctx.logits_indices)

    def _stage_lora(self, b: int, meta: LoraBatchMeta) -> None:
        seg = meta.seg_starts_cpu if meta.seg_starts_cpu is not None else meta.seg_starts.tolist()
        rows = meta.row_start_cpu if meta.row_start_cpu is not None else meta.row_start.tolist()
        ranks = meta.ranks_cpu if meta.ranks_cpu is not None else meta.ranks.tolist()
        scal = meta.scalings_cpu if meta.scalings_cpu is not None else meta.scalings.tolist()
        self._stage_lora_groups(b, seg, rows, ranks, scal)

    def _stage_lora_groups(self, b: int, seg, rows, ranks, scal) -> None:
        """Groups [0, G) as given; groups [G, b) empty (their segments end where the last one does), rank 0."""
        buf = self.runner.buffers
        g = len(rows)
        seg_h = buf.host("lora_seg", b + 1)
        seg_h[:g + 1] = seg
        seg_h[g + 1:] = seg[-1]
        for name, vals in (("lora_rows", rows), ("lora_ranks", ranks), ("lora_scalings", scal)):
            a = buf.host(name, b)
            a[:g] = np.asarray(vals, dtype=a.dtype)
            a[g:] = 0


def describe_graphs(graphs: list[tuple[int, frozenset | None]]) -> list[tuple[int, list[str] | None]]:
    return [(b, None if key is None else sorted(key)) for b, key in graphs]


def check_same_graphs(tp, graphs: list[tuple[int, frozenset | None]], what: str) -> None:
    """Raise on every rank unless every rank's (bucket, LoRA key) list equals rank 0's, order included."""
    mine = describe_graphs(graphs)
    every = tp.gather_objects(mine)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            raise RuntimeError(
                f"CUDA graphs under tensor parallelism: rank {rank} {what} {theirs}, rank 0 {every[0]} ((batch "
                "bucket, LoRA groups) in order); every rank must capture the same graphs in the same order (their "
                "collectives pair up): give every rank the same cuda_graph_max_batch, max_num_seqs and LoRA pools, "
                "or set cuda_graphs false")
