"""Owns the model and the KV cache; flattens a scheduled step into one batch and runs it.

Input preparation is vectorized with numpy over the step's tokens, written into persistent buffers
(loom.engine.worker.step_buffers: pinned and copied once per dtype on CUDA); the only per-sequence Python work is
slicing each sequence's new token ids and block table. Block tables are as wide as max_model_len (so kernel
arguments never change with the step) and hold stale ids past each sequence's blocks, which are never read.

Decode-only steps replay CUDA graphs (loom.engine.worker.cuda_graphs) when they are on, and so do speculative
decoding's verify steps (loom.engine.worker.verify_graphs); prefills, mixed steps and anything else run eagerly here,
which is also the reference the graph paths are tested against.

With tensor parallelism (`tp`, loom.distributed) every rank runs this runner over its shard: rank 0 (the engine's)
prepares each step, broadcasts its inputs and gets the gathered logits; the workers run the same forward on what
they receive (loom.distributed.worker). Decode graphs are per rank, their collectives captured: rank 0 picks each
step's graph and the workers replay the same one (loom.engine.worker.cuda_graphs).
"""
from __future__ import annotations

import itertools
import logging
from contextlib import nullcontext

import numpy as np
import torch

from loom.device import bind_thread, resolve_device
from loom.distributed.step_broadcast import send_capture, send_step
from loom.engine.config import EngineConfig
from loom.engine.core.scheduler import ScheduledBatch
from loom.engine.worker import cpu
from loom.engine.worker.compiled_forward import build_forward
from loom.engine.worker.memory_plan import CPU_KV_BYTES, kv_blocks, kv_bytes_per_token, model_bytes
from loom.kernels.cpu_memory import large_zeros
from loom.kernels.kv_layout import kv_cache_shape
from loom.kernels.paged_decode_attention import make_split_counters
from loom.kernels.policy import decide
from loom.layers.forward_context import AttentionMeta, ForwardContext, LoraBatchMeta, forward_context
from loom.models.kv_scales import read_kv_scales
from loom.models.loader import checkpoint_dtype, load_hf_config, load_model, safetensors_files

# async scheduling: (flat input positions, rows of the tokens tensor, the step in flight's sampled tokens on the
# device): input ids that step is still sampling
TokenFill = tuple[np.ndarray, np.ndarray, torch.Tensor]

log = logging.getLogger("loom")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, tp=None, kv_share_bytes: int = 0,
                 defer_kv: bool = False):
        """tp: this rank's tensor-parallel group (loom.distributed.parallel_state.ParallelGroup), or None.
        kv_share_bytes: bytes per KV block that another model keeps beside this one's blocks (a draft model's share:
        the budget holds both). defer_kv: no KV cache yet (a draft model: allocate_kv() with the target's count)."""
        self.tp = tp
        self.kv_share_bytes = kv_share_bytes
        self._copies: list[tuple[int, int]] = []  # rank 0: KV block copies the other ranks make at the next step
        self.peer_log = None  # rank 0: LoRA rows written since the last step (loom.lora.tp_pools), set by the engine
        self.config = config
        self.device = resolve_device(config.torch_device)  # cuda -> cuda:<current>: other threads bind to it
        bind_thread(self.device)
        hf_cfg = load_hf_config(model_dir)
        self.dtype = config.resolve_dtype(checkpoint_dtype(hf_cfg))
        model_max = int(getattr(hf_cfg, "max_position_embeddings", 4096) or 4096)
        max_len = config.max_model_len or model_max  # sliding-window layers attend within their window
        self.max_model_len = max_len
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device, max_len, tp=tp)
        self.weight_bytes = model_bytes(self.model)  # as loaded (scripts/plan_memory.py predicts it)
        log.info("model: %.3f GiB%s as loaded (weights, rope tables)", self.weight_bytes / 2**30,
                 f" on rank {tp.rank}" if tp is not None else "")
        self.vocab_size = hf_cfg.vocab_size
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_len // self.block_size)
        attn = self.model.attention_layers()
        self.num_layers = len(attn)
        self.num_kv_heads, self.head_dim = attn[0].num_kv_heads, attn[0].head_dim
        self.max_num_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.buffers = self._make_buffers()
        # flash-decoding's ticket counters for a decode of up to max_num_seqs sequences, zeroed once here (each launch
        # leaves them zero): shared by every layer, the eager steps and the graphs, whose launches are stream-ordered
        self.split_counters = make_split_counters(self.max_num_seqs, max(a.num_kv_heads for a in attn), self.device)
        for a in attn:
            a.split_counters = self.split_counters
        # The decode graphs' output: the final hidden states of a bucket's rows (each graph writes its first b rows;
        # lm_head runs after the replay on the sampled rows only). Made before KV sizing, so the profile's free
        # memory already excludes it, as it excludes the step buffers.
        hidden = int(hf_cfg.hidden_size)
        self.graph_hidden = torch.empty((self.graph_max_batch(), hidden), dtype=self.dtype, device=self.device) \
            if config.cuda_graphs else None
        # ... and the verify graphs' (speculative decoding: 1 + k tokens per row)
        self.verify_hidden = torch.empty((self.verify_graph_max_batch() * self.verify_width(), hidden),
                                         dtype=self.dtype, device=self.device) \
            if config.cuda_graphs and self.verify_graph_max_batch() else None
        self._capture_stream = None
        self._table_rows: dict[int, np.ndarray] = {}  # host slot -> what its block-table rows hold
        self.graphs = None  # loom.engine.worker.cuda_graphs.DecodeGraphs, made by warm_up() (or for a CPU test)
        self.verify_graphs = None  # loom.engine.worker.verify_graphs.VerifyGraphs, likewise (speculative decoding)
        self.warmup = None  # loom.engine.worker.warmup.WarmupReport once warm_up() ran
        self.num_blocks = 0
        self.kv_cache = None
        self.kv_dtype = config.resolve_kv_cache_dtype(self.dtype)
        self.kv_scales = None if config.kv_cache_dtype == "auto" else \
            read_kv_scales(safetensors_files(model_dir), self.num_layers)
        if not defer_kv:
            self.allocate_kv(self._num_kv_blocks())
        if self.device.type == "cpu":  # tensor-parallel ranks share the cores unless told
            cpu.set_up_process(config.cpu_threads or (max(1, cpu.available_cores() // tp.world_size) if tp else 0))
        # where the ops run, decided once (kernels/policy.py): the C++ library is built or loaded here on CPU, not in
        # the first step
        self.kernels = decide(self.device, self.dtype, compiled=config.cpu_compile)
        log.info("%s", self.kernels.describe(self.dtype))
        cpu.apply_path(self.model, self.kernels)
        self.forward = build_forward(self)  # eager, or compiled on CPU (cpu_compile)

    def _make_buffers(self):
        from loom.engine.worker.step_buffers import StepBuffers

        t, s, lb = self.max_num_tokens, self.max_num_seqs, self.graph_max_batch()
        i64, i32 = torch.int64, torch.int32
        return StepBuffers({
            "input_ids": (i64, t), "positions": (i64, t), "slot_mapping": (i64, t),
            "fill_pos": (i64, s), "fill_src": (i64, s), "logits_indices": (i64, s + t),
            "lora_tokens": (i64, max(lb, self.verify_graph_max_batch() * self.verify_width())),
            "cu_seqlens": (i32, s + 1), "prefill_cu": (i32, s + 1), "seq_lens": (i32, s),
            "lora_seg": (i32, lb + 1), "lora_rows": (i32, lb), "lora_ranks": (i32, lb),
            "block_tables": (i32, s * self.max_blocks_per_seq),
            "lora_scalings": (torch.float32, lb),
        }, self.device)

    def graph_max_batch(self) -> int:
        """The largest decode batch replayed as a CUDA graph (cuda_graph_max_batch; 0 = up to 256)."""
        c = self.config
        cap = c.cuda_graph_max_batch or 256
        return max(1, min(cap, c.max_num_seqs, c.max_num_batched_tokens))

    def verify_width(self) -> int:
        """Query tokens of a verify row: 1 + num_speculative_tokens (1 without speculative decoding)."""
        spec = self.config.speculative_config
        return 1 + spec.num_speculative_tokens if spec is not None else 1

    def verify_graph_max_batch(self) -> int:
        """The most rows of a verify step replayed as a CUDA graph (its padded tokens fit one step's); 0 = none."""
        if self.config.speculative_config is None or self.tp is not None:
            return 0  # under tensor parallelism verify steps run eagerly: workers replay only rank 0's decode graphs
        return min(self.graph_max_batch(), self.config.max_num_batched_tokens // self.verify_width())

    def capture_stream(self):
        """CUDA: the one stream every decode graph is warmed up and captured on, and the memory profile runs the
        graph forward on: one set of cuBLAS workspaces (kept per stream for the process's life; made by the
        profile, so counted in its free memory) and one allocator cache, however many graphs are captured."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    # ---- KV sizing -----------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:
        """One preallocated tensor for the whole cache; each layer gets views of it. On the CPU it sits on huge pages
        (kernels/cpu_memory.py): attention reads it through the block table, a new page every few positions."""
        self.num_blocks = num_blocks
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = large_zeros((self.num_layers, 2) + shape, self.kv_dtype, self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[i]

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if not budget:
            if self.device.type == "cuda":
                from loom.engine.worker.memory_profile import kv_cache_budget

                budget = kv_cache_budget(self)
            else:
                budget = CPU_KV_BYTES
        n = kv_blocks(budget, self.bytes_per_block + self.kv_share_bytes)
        if self.tp is not None:  # every rank holds the same blocks: as many as the smallest rank's memory holds
            n = self.tp.min_int(n)
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of "
                             f"{self.bytes_per_block + self.kv_share_bytes} bytes")
        return int(n)

    # ---- start-up --------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile every Triton variant this configuration can launch and capture the decode graphs, so that
        serving never compiles; a compiled CPU forward (cpu_compile) compiles here. Call once the model is final
        (the adapter registry has attached its pools)."""
        from loom.engine.worker.warmup import warm_up

        self.forward.warm_up(self.block_size)
        self.warmup = warm_up(self)

    def enable_graph_emulation(self) -> None:
        """CPU (tests): decode steps take the graph path - static buffers, batch-size buckets, padded rows - and
        run it eagerly where CUDA would replay a captured graph."""
        from loom.engine.worker.cuda_graphs import DecodeGraphs
        from loom.engine.worker.verify_graphs import VerifyGraphs

        self.graphs = DecodeGraphs(self, capture=False)
        self.verify_graphs = VerifyGraphs(self, capture=False) if self.verify_hidden is not None else None
        if self.tp is not None:  # every rank sets its path up in the same order, as the CUDA warm-up captures
            if self.tp.rank == 0:
                send_capture(self.tp)  # the workers call this too
            self.graphs.capture_all()

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, lora: LoraBatchMeta | None,
                extra_rows: list[int] | None = None, pad_to: int | None = None, fill: TokenFill | None = None,
                pad_seqs: int | None = None) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        """Write the step into the persistent buffers; -> (input ids, forward context, sampled sequences).

        pad_to (decode-only steps, the graph path): rows past the batch up to pad_to are padding - token 0 at
        position 0, slot -1 (nothing stored), context length 0 (attention returns zeros) - and the context is
        left to the caller (a graph reads the buffers it was captured with). pad_seqs: the graph's sequence rows when
        they are not pad_to (a verify graph's b rows of 1 + k tokens). fill (async scheduling): input ids
        the step in flight is still sampling; staged here, written on the device by fill_ids() after the commit."""
        seqs, s, d = batch.seqs, len(batch.seqs), batch.num_decode_seqs
        decode_only = d == s  # one token per sequence (the usual decode step)
        counts = np.ones(s, np.int64) if decode_only else np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
        # one pass over the sequences for what the arrays need: computed tokens, known tokens, blocks, table epoch,
        # last known token (the input of a sequence that computes its last token)
        per_seq = np.fromiter(itertools.chain.from_iterable(
            (q.num_computed_tokens, len(tl := q.token_ids), len(q.block_table), q.table_epoch, tl[-1]) for q in seqs),
            dtype=np.int64, count=5 * s).reshape(s, 5)
        starts, lens = per_seq[:, 0], per_seq[:, 2]
        ends = starts + counts
        # Sample only sequences whose known tokens are all computed after this step.
        sampled_np = np.flatnonzero(ends == per_seq[:, 1])
        all_sampled = len(sampled_np) == s
        if decode_only:
            cu = np.arange(s + 1, dtype=np.int64)
        else:
            cu = np.zeros(s + 1, dtype=np.int64)
            np.cumsum(counts, out=cu[1:])
        t = int(cu[-1])
        rows = t if pad_to is None else pad_to
        seq_rows = 0 if pad_to is None else pad_seqs if pad_seqs is not None else pad_to
        buf = self.buffers
        buf.begin()
        ids = buf.host("input_ids", rows)
        positions = buf.host("positions", rows)
        st = starts.tolist()
        if t == s:  # one token per sequence: the token at its start, at that position
            if all_sampled:  # ... which is its last known token
                ids[:t] = per_seq[:, 4]
            else:
                ids[:t] = np.fromiter((q.token_ids[a] for q, a in zip(seqs, st)), dtype=np.int64, count=t)
            seq_of_token = np.arange(s)
            positions[:t] = starts
        else:  # decodes (one token each) first, then the prefill slices
            ids[:d] = np.fromiter((q.token_ids[a] for q, a in zip(seqs, st[:d])), dtype=np.int64, count=d)
            ids[d:t] = np.fromiter(itertools.chain.from_iterable(
                q.token_ids[a:b] for q, a, b in zip(seqs[d:], st[d:], ends[d:].tolist())), dtype=np.int64,
                count=t - d)
            seq_of_token = np.repeat(np.arange(s), counts)
            positions[:t] = np.arange(t, dtype=np.int64) - cu[:-1][seq_of_token] + starts[seq_of_token]
        width = self.max_blocks_per_seq
        tables = buf.host("block_tables", max(s, seq_rows), width)
        self._write_block_tables(tables, seqs, per_seq[:, 3], lens)
        bs = self.block_size
        slots = buf.host("slot_mapping", rows)
        slots[:t] = tables[seq_of_token, positions[:t] // bs].astype(np.int64) * bs + positions[:t] % bs
        seq_lens = buf.host("seq_lens", max(s, seq_rows))
        seq_lens[:s] = ends
        if pad_to is not None:  # padding rows of a graph batch
            ids[t:], positions[t:], slots[t:], seq_lens[s:] = 0, 0, -1, 0
        if fill is not None:
            k = len(fill[0])
            buf.host("fill_pos", k)[:] = fill[0]
            buf.host("fill_src", k)[:] = fill[1]

        sampled = sampled_np.tolist()
        n_rows = len(sampled) + (len(extra_rows) if extra_rows else 0)
        logits_idx = buf.host("logits_indices", n_rows)
        logits_idx[:len(sampled)] = (cu[1:] if all_sampled else cu[1:][sampled_np]) - 1
        if extra_rows:  # more rows of the step's flat tokens (prompt logprobs), after the sampled ones
            logits_idx[len(sampled):] = extra_rows
        if pad_to is not None:
            return None, None, sampled  # the caller stages its LoRA rows and commits
        cu_h = buf.host("cu_seqlens", d + 1)
        cu_h[:] = cu[:d + 1]
        if d < s:
            buf.host("prefill_cu", s - d + 1)[:] = cu[d:] - cu[d]
        buf.commit()

        dev = buf.device_view
        decode = prefill = None
        max_k = width * bs
        if d:
            decode = AttentionMeta(dev("cu_seqlens", d + 1), dev("seq_lens", d), dev("block_tables", d, width), 1,
                                   max_k)
        if d < s:
            prefill = AttentionMeta(dev("prefill_cu", s - d + 1), dev("seq_lens", s)[d:],
                                    dev("block_tables", s, width)[d:], int(counts[d:].max()), max_k)
        ctx = ForwardContext(positions=dev("positions", t), slot_mapping=dev("slot_mapping", t),
                             num_decode_seqs=d, decode=decode, prefill=prefill,
                             logits_indices=dev("logits_indices", n_rows), lora=lora)
        ids_dev = dev("input_ids", t)
        self.fill_ids(ids_dev, fill)
        return ids_dev, ctx, sampled

    def _write_block_tables(self, tables: np.ndarray, seqs, epochs: np.ndarray, lens: np.ndarray) -> None:
        """The step's block-table rows, kept from step to step: a row that held the same table (same epoch) when
        this host slot was last written gets only the blocks appended since; other rows are written whole. A
        decode step writes O(blocks added), not O(blocks), in one scatter."""
        s = len(seqs)
        cache = self._table_rows.get(self.buffers.slot)
        if cache is None:  # per slot: [epoch, entries written] of every row (epoch 0 never matches)
            cache = self._table_rows[self.buffers.slot] = np.zeros((2, self.max_num_seqs), np.int64)
        same = (cache[0, :s] == epochs) & (epochs != 0)
        have = np.where(same, np.minimum(cache[1, :s], lens), 0)
        todo = np.flatnonzero(lens > have)
        if len(todo):
            lo, hi = have[todo], lens[todo]
            cnt = hi - lo
            total = int(cnt.sum())
            first = np.zeros(len(todo), dtype=np.int64)
            np.cumsum(cnt[:-1], out=first[1:])
            vals = np.fromiter(itertools.chain.from_iterable(
                seqs[i].block_table[a:b] for i, a, b in zip(todo.tolist(), lo.tolist(), hi.tolist())),
                dtype=np.int64, count=total)
            tables[np.repeat(todo, cnt), np.arange(total) - np.repeat(first - lo, cnt)] = vals
        cache[0, :s] = epochs
        cache[1, :s] = lens

    def forget_block_tables(self) -> None:
        """Someone else wrote the block-table buffer (a graph capture's padding): rewrite every row next time."""
        self._table_rows.clear()

    def fill_ids(self, ids: torch.Tensor, fill: TokenFill | None) -> None:
        """Async scheduling: write the tokens the step in flight is sampling over their placeholders in the
        committed input ids, on the device (no host sync)."""
        if fill is not None:
            dev, k = self.buffers.device_view, len(fill[0])
            ids.index_copy_(0, dev("fill_pos", k), fill[2].index_select(0, dev("fill_src", k)))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, lora: LoraBatchMeta | None, extra_rows: list[int] | None = None,
            fill: TokenFill | None = None) -> tuple[torch.Tensor, list[int]]:
        """Returns float32 logits of the sampled sequences and their indices into batch.seqs; with `extra_rows`
        (indices into the step's flat tokens), the logits of those tokens follow the sampled rows. `fill` (async
        scheduling): input ids not known on the host yet, taken on the device from the step in flight.
        No host sync on CUDA: the logits come back as a device tensor still being computed."""
        if self.graphs is not None and not extra_rows:
            out = self.graphs.run(batch, lora, fill)
            if out is not None:
                return out
        if self.verify_graphs is not None:
            out = self.verify_graphs.run(batch, lora, extra_rows, fill)
            if out is not None:
                return out
        ids, ctx, sampled = self.prepare(batch, lora, extra_rows, fill=fill)
        with self.tp.step_guard() if self.tp is not None else nullcontext():  # a dead rank: an error naming it
            if self.tp is not None:
                self.send_step(ids, ctx)
            with forward_context(ctx):
                logits = self.forward(ids, ctx.positions, ctx.logits_indices)  # [0, vocab] when nothing is sampled
        return logits, sampled

    def send_step(self, ids: torch.Tensor, ctx: ForwardContext, graph=None) -> None:
        """Rank 0: the step to the workers, with the KV block copies and LoRA rows since the last one; graph: the
        (bucket, LoRA key) of the decode graph it replays (ctx: the bucket's rows)."""
        send_step(self.tp, ids, ctx, self._copies, self.peer_log.take() if self.peer_log is not None else None, graph)
        self._copies = []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """KV block src -> dst for each pair, every layer (n > 1 forks copy a partly filled block). With tensor
        parallelism each rank copies its own heads: rank 0 now, the others before the next step's forward."""
        kv = self.kv_cache  # [layers, 2, blocks, ...]: a block is whole at index 2 (kernels/kv_layout.py)
        for src, dst in copies:
            kv[:, :, dst].copy_(kv[:, :, src])
        if self.tp is not None and self.tp.rank == 0:
            self._copies += copies
