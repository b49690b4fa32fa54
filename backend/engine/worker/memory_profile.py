"""CUDA only: how many bytes the KV cache may take, from the device's free memory after profiling the largest
steps the configuration allows (not from total memory and a partial forward).

With the weights loaded, three runs measure the peaks the cache must leave room for, each against a one-block
stand-in cache (every layer shares it; every table points at block 0, where the K/V are stored):
- a full forward of max_num_batched_tokens prompt tokens (the largest prefill step), with its logits;
- the sampler's working set at max_num_seqs rows (logits, softmax, a full sort for top-p/top-k);
- with CUDA graphs, the forward a capture of the largest bucket records (loom.engine.worker.cuda_graphs), on the
  runner's capture stream, after one unmeasured run there that makes that stream's cuBLAS workspaces (kept for the
  process's life: in the memory in use below, like the step buffers and the graphs' output rows); with speculative
  decoding the larger of it and the largest verify bucket's forward (loom.engine.worker.verify_graphs: same pool).
What capture keeps is then known by construction (see cuda_graphs): one shared pool as large as that forward's
peak, since no capture keeps a tensor of its own and the largest is captured first; no logits (lm_head runs
after the replay, on the sampled rows, within the sampler's transient); no stream but the one already profiled.
The capture stream's allocator cache (each graph's first, uncaptured run) holds up to that peak again, beside
the serving stream's cache of the larger transient peak: a graph first needed while serving is captured then.
budget = gpu_memory_utilization x total - what the device already uses (weights, context, other processes, the
step buffers, the graphs' output rows, the capture stream's workspaces) - the larger transient peak - 2 x the
graph forward's peak (pool + capture stream cache) - the LoRA pools (allocated after the cache) - a margin.
"""
from __future__ import annotations

import logging

import torch

from loom.engine.worker.compiled_forward import logits_of
from loom.engine.worker.memory_plan import kv_budget, reserve_estimate
from loom.engine.worker.warmup import fake_batch
from loom.kernels.kv_layout import kv_cache_shape
from loom.layers.forward_context import forward_context

log = logging.getLogger("loom")


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
    stand_in = torch.zeros((2,) + kv_cache_shape(1, runner.block_size, runner.num_kv_heads, runner.head_dim),
                           dtype=runner.kv_dtype, device=runner.device)
    before = [(layer.k_cache, layer.v_cache) for layer in attn]
    for layer in attn:
        layer.k_cache, layer.v_cache = stand_in[0], stand_in[1]
    try:
        t, n = runner.max_num_tokens, runner.max_model_len
        chunks = ([n] * (t // n) + ([t % n] if t % n else []))[:runner.max_num_seqs]  # prompts of at most n tokens

        def forward(batch):
            def go():
                ids, ctx, _ = runner.prepare(batch, None)
                with forward_context(ctx):
                    logits_of(runner.model, runner.model(ids, ctx.positions), ctx.logits_indices)
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
            from loom.engine.worker.cuda_graphs import DecodeGraphs

            dg = DecodeGraphs(runner, capture=False)
            with torch.cuda.stream(runner.capture_stream()):
                dg.run_padding(dg.max_batch)  # the stream's lazy state: kept, so counted in `used` below
                graphs = _peak(lambda: dg.run_padding(dg.max_batch))
                if runner.verify_hidden is not None:  # the verify graphs share the pool: the larger forward sizes it
                    from loom.engine.worker.verify_graphs import VerifyGraphs

                    vg = VerifyGraphs(runner, capture=False)
                    graphs = max(graphs, _peak(lambda: vg.run_padding(vg.max_batch)))
    finally:
        for layer, kv in zip(attn, before):
            layer.k_cache, layer.v_cache = kv
        del stand_in
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    used = total - free
    lora = cfg.lora_memory_bytes + cfg.lora_expert_memory_bytes
    budget = kv_budget(total, cfg.gpu_memory_utilization, used, max(prefill, sampling), graphs, lora)
    world = runner.tp.world_size if runner.tp is not None else 1
    planned = reserve_estimate(runner.hf_config, cfg, runner.dtype, world)
    log.info("memory plan's estimates (scripts/plan_memory.py): transient peak %.2f GiB, graph forward %.2f GiB; "
             "measured %.2f GiB, %.2f GiB", planned[0] / 2**30, planned[1] / 2**30, max(prefill, sampling) / 2**30,
             graphs / 2**30)
    log.info("KV cache budget %.2f GiB: %.2f GiB x %.2f, in use %.2f GiB, prefill peak %.2f GiB, sampler %.2f GiB, "
             "graph forward %.2f GiB (x2), LoRA pools %.2f GiB", budget / 2**30, total / 2**30,
             cfg.gpu_memory_utilization,
             used / 2**30, prefill / 2**30, sampling / 2**30, graphs / 2**30, lora / 2**30)
    if budget <= 0:
        raise ValueError("no GPU memory left for the KV cache: lower max_num_batched_tokens, max_num_seqs or the LoRA "
                         "memory, or raise gpu_memory_utilization")
    return budget
