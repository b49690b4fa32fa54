"""CUDA only: how many bytes the KV cache may take, from the device's free memory after profiling the largest
steps the configuration allows (not from total memory and a partial forward).

With the weights loaded, three runs measure the transient peaks the cache must leave room for, each against a
one-block stand-in cache (every layer shares it; every table points at block 0, where the K/V are stored):
- a full forward of max_num_batched_tokens prompt tokens (the largest prefill step), with its logits;
- the sampler's working set at max_num_seqs rows (logits, softmax, a full sort for top-p/top-k);
- with CUDA graphs, the largest graph batch's forward: its activations stay allocated in the graph pool.
Then budget = gpu_memory_utilization x total - what the device already uses (weights, context, other
processes) - the larger transient peak - the graph pool - the LoRA pools (allocated after the cache) - a margin.
"""
from __future__ import annotations

import logging

import torch

from loom.engine.warmup import fake_batch
from loom.layers.forward_context import forward_context

log = logging.getLogger("loom")

MARGIN = 256 << 20  # allocator fragmentation, cuBLAS workspaces, small buffers made later


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@torch.inference_mode()
def kv_cache_budget(runner) -> int:
    cfg = runner.config
    attn = runner.model.attention_layers()
    stand_in = torch.zeros((2, 1, runner.block_size, runner.num_kv_heads, runner.head_dim), dtype=runner.dtype,
                           device=runner.device)
    for layer in attn:
        layer.k_cache, layer.v_cache = stand_in[0], stand_in[1]
    try:
        t, n = runner.max_num_tokens, runner.max_model_len
        chunks = ([n] * (t // n) + ([t % n] if t % n else []))[:runner.max_num_seqs]  # prompts of at most n tokens

        def forward(batch):
            def go():
                ids, ctx, _ = runner.prepare(batch, None)
                with forward_context(ctx):
                    hidden = runner.model(ids, ctx.positions)
                    runner.model.compute_logits(hidden[ctx.logits_indices])
            return go

        prefill = _peak(forward(fake_batch(chunks, block_size=runner.block_size)))
        rows = runner.max_num_seqs

        def sampler():
            logits = torch.randn((rows, runner.vocab_size), device=runner.device)
            probs = torch.softmax(logits, dim=-1)
            torch.sort(probs, dim=-1, descending=True)

        sampling = _peak(sampler)
        graphs = 0
        if cfg.cuda_graphs:
            graphs = _peak(forward(fake_batch([], decode=runner.graph_max_batch(), block_size=runner.block_size)))
    finally:
        for layer in attn:
            layer.k_cache = layer.v_cache = None
        del stand_in
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    used = total - free
    lora = cfg.lora_memory_bytes + cfg.lora_expert_memory_bytes
    budget = int(total * cfg.gpu_memory_utilization) - used - max(prefill, sampling) - graphs - lora - MARGIN
    log.info("KV cache budget %.2f GiB: %.2f GiB x %.2f, in use %.2f GiB, prefill peak %.2f GiB, sampler %.2f GiB, "
             "graph pool %.2f GiB, LoRA pools %.2f GiB", budget / 2**30, total / 2**30, cfg.gpu_memory_utilization,
             used / 2**30, prefill / 2**30, sampling / 2**30, graphs / 2**30, lora / 2**30)
    if budget <= 0:
        raise ValueError("no GPU memory left for the KV cache: lower max_num_batched_tokens, max_num_seqs or the LoRA "
                         "memory, or raise gpu_memory_utilization")
    return budget
