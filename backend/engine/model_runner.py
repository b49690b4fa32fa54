"""Owns the model and the KV cache; flattens a scheduled step into one batch and runs it.

Input preparation is vectorized with numpy over the step's tokens; the only per-sequence Python work
is slicing each sequence's new token ids and block table into the batch arrays.
"""
from __future__ import annotations

import numpy as np
import torch

from loom.engine.config import EngineConfig
from loom.engine.scheduler import ScheduledBatch
from loom.layers.forward_context import AttentionMeta, ForwardContext, LoraBatchMeta, forward_context
from loom.models.loader import checkpoint_dtype, load_hf_config, load_model


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str):
        self.config = config
        self.device = config.torch_device
        hf_cfg = load_hf_config(model_dir)
        self.dtype = config.resolve_dtype(checkpoint_dtype(hf_cfg))
        model_max = int(getattr(hf_cfg, "max_position_embeddings", 4096) or 4096)
        max_len = config.max_model_len or model_max  # sliding-window layers attend within their window
        self.max_model_len = max_len
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device, max_len)
        self.vocab_size = hf_cfg.vocab_size
        self.block_size = config.block_size
        attn = self.model.attention_layers()
        self.num_layers = len(attn)
        self.num_kv_heads, self.head_dim = attn[0].num_kv_heads, attn[0].head_dim
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # One preallocated tensor for the whole cache; each layer gets views of it.
        self.kv_cache = torch.zeros((self.num_layers, 2) + shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(attn):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    # ---- KV sizing -----------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if not budget:
            if self.device.type == "cuda":
                budget = self._profile_free_cuda_memory()
            else:
                budget = 1 << 30
        n = budget // self.bytes_per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {self.bytes_per_block} bytes")
        return int(n)

    def _profile_free_cuda_memory(self) -> int:
        """Run the largest step once without a cache to see the activation peak; the rest is KV."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        t = min(self.config.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(t, dtype=torch.long, device=self.device)
        pos = torch.arange(t, device=self.device)
        with torch.inference_mode():
            x = self.model.model.embed_tokens(ids)
            self.model.compute_logits(x[-min(t, self.config.max_num_seqs):])
            # Attention activations scale like the MLP's; approximate with one layer's MLP pass.
            self.model.model.layers[0].mlp(x)
        del ids, pos
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        # the adapter registry allocates its LoRA pools after the cache: keep room for them
        free = int(total * self.config.gpu_memory_utilization) - peak - (256 << 20) - self.config.lora_memory_bytes
        if free <= 0:
            raise ValueError("no GPU memory left for the KV cache: lower max_num_batched_tokens or raise "
                             "gpu_memory_utilization")
        return free

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, lora: LoraBatchMeta | None, extra_rows: list[int] | None = None,
                token_fill: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        seqs, counts = batch.seqs, np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
        s = len(seqs)
        starts = np.fromiter((q.num_computed_tokens for q in seqs), dtype=np.int64, count=s)
        ends = starts + counts
        cu = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        t = int(cu[-1])
        ids = np.fromiter((tok for q, a, b in zip(seqs, starts.tolist(), ends.tolist()) for tok in q.token_ids[a:b]),
                          dtype=np.int64, count=t)
        seq_of_token = np.repeat(np.arange(s), counts)
        positions = np.arange(t, dtype=np.int64) - cu[:-1][seq_of_token] + starts[seq_of_token]
        max_blocks = max(len(q.block_table) for q in seqs)
        tables = np.zeros((s, max_blocks), dtype=np.int32)
        for i, q in enumerate(seqs):
            tables[i, :len(q.block_table)] = q.block_table
        bs = self.block_size
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        # Sample only sequences whose known tokens are all computed after this step.
        sampled = [i for i, q in enumerate(seqs) if ends[i] == q.num_tokens]
        logits_idx = cu[1:][sampled] - 1
        if extra_rows:  # more rows of the step's flat tokens (prompt logprobs), after the sampled ones
            logits_idx = np.concatenate([logits_idx, np.asarray(extra_rows, dtype=np.int64)])

        dev = self.device
        to = lambda a, dt: torch.from_numpy(a).to(dev, dtype=dt, non_blocking=True)  # noqa: E731
        seq_lens = ends.astype(np.int32)
        d = batch.num_decode_seqs
        decode = prefill = None
        if d:
            decode = AttentionMeta(to(cu[:d + 1], torch.int32), to(seq_lens[:d], torch.int32),
                                   to(tables[:d], torch.int32), 1, int(seq_lens[:d].max()))
        if d < s:
            pcu = cu[d:] - cu[d]
            prefill = AttentionMeta(to(pcu, torch.int32), to(seq_lens[d:], torch.int32), to(tables[d:], torch.int32),
                                    int(counts[d:].max()), int(seq_lens[d:].max()))
        ctx = ForwardContext(positions=to(positions, torch.int64), slot_mapping=to(slots, torch.int64),
                             num_decode_seqs=d, decode=decode, prefill=prefill,
                             logits_indices=to(logits_idx, torch.int64), lora=lora)
        ids_t = to(ids, torch.int64)
        if token_fill is not None:  # async scheduling: ids the previous step is still sampling, on the device
            ids_t.index_copy_(0, token_fill[0], token_fill[1])
        return ids_t, ctx, sampled

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, lora: LoraBatchMeta | None, extra_rows: list[int] | None = None,
            token_fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Returns float32 logits of the sampled sequences and their indices into batch.seqs; with `extra_rows`
        (indices into the step's flat tokens), the logits of those tokens follow the sampled rows. `token_fill`
        (flat input positions, device token ids): input ids that are not known on the host yet (async
        scheduling), written over the uploaded ids on the device. Nothing here waits for the device."""
        ids, ctx, sampled = self.prepare(batch, lora, extra_rows, token_fill)
        with forward_context(ctx):
            hidden = self.model(ids, ctx.positions)
            logits = (self.model.compute_logits(hidden[ctx.logits_indices]) if sampled or extra_rows
                      else hidden.new_empty((0, self.vocab_size)))
        return logits, sampled
