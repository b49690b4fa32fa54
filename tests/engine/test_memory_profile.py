"""KV sizing on CUDA (loom.engine.worker.memory_profile), its logic run on CPU with the CUDA memory counters faked.

- The budget's arithmetic: the profile forwards run (a prefill of max_num_batched_tokens split at max_model_len,
  the sampler's working set, the forward a capture of the largest graph bucket records) against a one-block
  stand-in cache, and the budget is the free memory left under gpu_memory_utilization after the measured peaks,
  the LoRA pools (dense and expert) and the margin.
- The accounting as a whole, against a fake caching allocator driven by the tensors the CPU run really creates:
  start-up as on CUDA (KV sizing, the cache and LoRA pools, every decode graph captured, for two LoRA keys), then
  the largest prefill and the largest graph decode step must never hold more than gpu_memory_utilization of the
  device (gpu_perf's memory section checks the same on a GPU)."""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.hf_models import make_hf_model
from loom.engine.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.worker import memory_plan
from loom.engine.worker.compiled_forward import logits_of
from loom.engine.worker.cuda_graphs import DecodeGraphs
from loom.engine.worker.memory_plan import MARGIN
from loom.engine.worker.memory_profile import kv_cache_budget
from loom.engine.worker.warmup import fake_batch
from loom.layers.forward_context import forward_context

GIB = 1 << 30
MIB = 1 << 20


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other) -> None:
        pass


def test_budget_from_free_memory_after_profiling(tmp_path, monkeypatch):
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=64)
    cfg = EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=150, max_num_seqs=6, cuda_graph_max_batch=4, gpu_memory_utilization=0.9)
    runner = LLMEngine(cfg, load_tokenizer=False).runner
    cfg.lora_memory_bytes, cfg.lora_expert_memory_bytes = 3 * GIB, GIB  # set aside, not allocated here
    peaks = iter([5 * GIB, 2 * GIB, GIB])  # prefill, sampler, graph forward (as the profile measures them)
    steps, graph_rows = [], []
    orig, orig_model = runner.prepare, runner.model.forward

    def spy(batch, lora, *a, **k):
        steps.append([n for n in batch.num_scheduled_tokens])
        return orig(batch, lora, *a, **k)

    def model_spy(ids, positions):
        assert all(layer.k_cache.shape[0] == 1 for layer in runner.model.attention_layers())  # the stand-in
        graph_rows.append(ids.shape[0])
        return orig_model(ids, positions)

    runner.prepare = spy
    runner.model.forward = model_spy
    fake = dict(synchronize=lambda *a: None, reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
                memory_allocated=lambda *a: 0, max_memory_allocated=lambda *a: next(peaks),
                mem_get_info=lambda *a: (70 * GIB, 80 * GIB), Stream=_Stream,
                stream=lambda s: contextlib.nullcontext())
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    kv = [(layer.k_cache, layer.v_cache) for layer in runner.model.attention_layers()]
    budget = kv_cache_budget(runner)
    used = 10 * GIB  # total - free
    # the graph forward twice: the capture pool, and the capture stream's cache of a graph's first run
    assert budget == int(80 * GIB * 0.9) - used - 5 * GIB - 2 * GIB - 4 * GIB - MARGIN
    assert steps == [[64, 64, 22]]  # the largest prefill (prompts of at most max_model_len) ...
    assert graph_rows == [150, 4, 4]  # ... and the largest graph bucket, an unmeasured run first
    assert [(layer.k_cache, layer.v_cache) for layer in runner.model.attention_layers()] == kv  # put back


# ---- the accounting against a fake caching allocator -------------------------------------------------------


class FakeCudaMemory:
    """The counters of CUDA's caching allocator, driven by the CPU tensors a run creates (a dispatch mode sees each
    new storage, a finalizer its free). Every allocation belongs to an owner: the current stream's cache, or the
    pool of the capture in progress. An owner holds reserved the peak of its live bytes (a stream's cache until
    empty_cache, which torch.cuda.graph calls before each capture; a graph pool for good), so memory freed in a
    pool serves later captures into it. cuBLAS allocates a workspace (kept for good) at a stream's first matmul,
    into the pool when that is during a capture. reserved = baseline (weights, context) + held + every owner's."""

    WORKSPACE = 256 << 10  # 32 MiB + 1 MiB per stream on an H100, scaled as the model is
    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "linear_packed"}

    def __init__(self, total: int, baseline: int):
        self.total, self.fixed = total, baseline
        self.owners: dict[tuple, list[int]] = {}  # owner -> [live, held]
        self.live: dict[int, tuple] = {}  # storage pointer -> owner
        self.allocated = self.max_allocated = self.max_reserved = 0
        self.ids = itertools.count(1)
        self.default = self.current = self.Stream()
        self.capture_stream = None
        self.pool = None  # the pool of the capture in progress
        self.workspaces: set = set()
        self.streams_used: set = set()

    # -- the allocator
    def reserved(self) -> int:
        return self.fixed + sum(held for _, held in self.owners.values())

    def _owner(self) -> tuple:
        return ("pool", self.pool) if self.pool is not None else ("stream", self.current.id)

    def alloc(self, nbytes: int, owner: tuple) -> None:
        o = self.owners.setdefault(owner, [0, 0])
        o[0] += nbytes
        o[1] = max(o[1], o[0])
        self.allocated += nbytes
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_reserved = max(self.max_reserved, self.reserved())

    def free(self, ptr: int, nbytes: int, owner: tuple) -> None:
        self.live.pop(ptr, None)
        self.owners[owner][0] -= nbytes
        self.allocated -= nbytes

    def hold(self, nbytes: int) -> None:
        """Memory allocated outside the tracked run (the KV cache, the LoRA pools)."""
        self.fixed += nbytes
        self.allocated += nbytes
        self.max_reserved = max(self.max_reserved, self.reserved())

    def op(self, func, args, kwargs):
        if func._schema.name.split("::")[-1] in self.MATMULS:
            self.streams_used.add(self.current.id)
            if self.current.id not in self.workspaces:
                self.workspaces.add(self.current.id)
                self.alloc(self.WORKSPACE, self._owner())  # never freed
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes and ptr not in inputs and ptr not in self.live:
                owner = self.live[ptr] = self._owner()
                self.alloc(nbytes, owner)
                weakref.finalize(st, self.free, ptr, nbytes, owner)
        return out

    # -- torch.cuda
    def Stream(self, *a, **k):  # noqa: N802 (torch's name)
        mem = self

        class Stream:
            id = next(mem.ids)

            def wait_stream(self, other) -> None:
                pass

        return Stream()

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.empty_cache()
        if stream is None:
            if self.capture_stream is None:
                self.capture_stream = self.Stream()
            stream = self.capture_stream
        prev_pool, self.pool = self.pool, pool if pool is not None else self.graph_pool_handle()
        try:
            with self.stream(stream):
                yield
        finally:
            self.pool = prev_pool

    def graph_pool_handle(self):
        return (0, next(self.ids))

    def empty_cache(self) -> None:
        for (kind, _), o in self.owners.items():
            if kind == "stream":
                o[1] = o[0]

    def reset_peak_memory_stats(self, *a) -> None:
        self.max_allocated, self.max_reserved = self.allocated, self.reserved()

    def install(self, monkeypatch) -> None:
        class CUDAGraph:
            def replay(self) -> None:
                pass

        fns = dict(Stream=self.Stream, stream=self.stream, current_stream=lambda *a: self.current, graph=self.graph,
                   graph_pool_handle=self.graph_pool_handle, CUDAGraph=CUDAGraph, empty_cache=self.empty_cache,
                   synchronize=lambda *a: None, reset_peak_memory_stats=self.reset_peak_memory_stats,
                   memory_allocated=lambda *a: self.allocated, max_memory_allocated=lambda *a: self.max_allocated,
                   memory_reserved=lambda *a: self.reserved(), max_memory_reserved=lambda *a: self.max_reserved,
                   mem_get_info=lambda *a: (self.total - self.reserved(), self.total))
        for name, fn in fns.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def tracking(self):
        mem = self

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return mem.op(func, args, kwargs or {})

        return Track()


def test_capture_and_serving_stay_within_gpu_memory_utilization(tmp_path, monkeypatch):
    """What capture keeps is counted: the old accounting (one eager forward with its logits for the graph pool)
    planned a KV cache that this overran, since every graph kept its own [b, vocab] float32 logits in the pool,
    for every bucket and both LoRA keys, and each capture warmed up on a new stream with a workspace of its own."""
    monkeypatch.setenv("LOOM_CPU_KERNELS", "0")  # the PyTorch references: every op through the dispatcher
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=64, vocab_size=4096)
    cfg = EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=150, max_num_seqs=8, cuda_graph_max_batch=8, lora_memory_bytes=1 << 20,
                       gpu_memory_utilization=0.9)
    runner = LLMEngine(cfg, load_tokenizer=False).runner  # LoRA pools attached: graphs with and without LoRA
    mem = FakeCudaMemory(total=64 * MIB, baseline=4 * MIB)
    mem.install(monkeypatch)
    monkeypatch.setattr(memory_plan, "MARGIN", 0)  # the fake allocator neither fragments nor grows the context
    limit = cfg.gpu_memory_utilization * mem.total
    with torch.inference_mode(), mem.tracking():
        budget = kv_cache_budget(runner)
        assert 0 < budget < limit - 4 * MIB
        mem.hold(budget)  # the KV cache (the CPU runner has its own; the fake device holds what CUDA would)
        mem.hold(cfg.lora_memory_bytes)  # the LoRA pools, made after it
        graphs = runner.graphs = DecodeGraphs(runner, capture=True)  # warm_up() on CUDA
        assert graphs.lora_groups and graphs.capture_all() == 2 * len(graphs.buckets) == 8
        ids, ctx, _ = runner.prepare(fake_batch([64, 64, 22], block_size=runner.block_size), None)
        with forward_context(ctx):  # the largest prefill step (a fresh cache on the serving stream)
            logits_of(runner.model, runner.model(ids, ctx.positions), ctx.logits_indices)
        logits, sampled = graphs.run(fake_batch([], decode=8, block_size=runner.block_size, computed=1), None)
        assert logits.shape == (8, 4096) and sampled == list(range(8))
    assert mem.streams_used and mem.max_reserved > mem.fixed  # the run was tracked
    assert mem.max_reserved <= limit, f"{(mem.max_reserved - limit) / MIB:.2f} MiB over gpu_memory_utilization"
