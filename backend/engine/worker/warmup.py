"""Start-up warm-up: launch every Triton kernel variant the configuration can need, so serving never compiles.

A variant is a kernel's compiled specialisation: its constexprs (tile sizes chosen from the step's shape, flags)
and the attributes Triton specialises plain arguments on (integers equal to 1 or divisible by 16, pointers
aligned to 16 bytes). The kernels take whatever changes from step to step - split counts, rank tiles, strides of
per-step buffers, token-expert pair counts, offsets of the prefill part - as unspecialised arguments (see their
`do_not_specialize`), and the model runner keeps every per-step input at a fixed, aligned place with a fixed
table width. What is left varies with the step's size only in tile choices, each a step function of one count
with classes (a, 2a], (2a, 4a], ...: running steps of every power of two up to the limit, and the limit itself,
lands in every class a step can reach. So the warm-up runs synthetic steps through the model runner's own
preparation and forward:
- prefill steps of 2, 4, 8, ... up to max_num_batched_tokens tokens (prefill attention tiles, fused-MoE tiles);
- decode steps of 1, 2, 4, ... up to max_num_seqs sequences (the decode split / no split, MoE tiles);
- mixed steps (a prefill part at an odd row offset);
- with LoRA pools attached: steps whose adapter groups reach every token-tile and rank-tile class up to
  max_lora_rank, and the shrink kernel with and without a split reduction for every LoRA module shape;
- with CUDA graphs: the capture of every batch-size bucket (loom.engine.worker.cuda_graphs), and with speculative
  decoding of every verify bucket (loom.engine.worker.verify_graphs).
The synthetic steps read and write block 0 of the (still empty) KV cache. Under TRITON_INTERPRET or on CPU
nothing is compiled and nothing runs. tests/engine/test_warmup.py checks the claim: it records each launch's
specialisation key for sm_90 and compares serving's keys with the warm-up's.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from loom.engine.core.scheduler import ScheduledBatch
from loom.engine.worker.compiled_forward import logits_of
from loom.kernels.lora import FUSED_MAX_TOKENS, block_r_for, lora_shrink_triton
from loom.kernels.policy import TRITON
from loom.layers.forward_context import LoraBatchMeta, forward_context

log = logging.getLogger("loom")


class _FakeSeq:
    """What ModelRunner.prepare reads of a sequence."""

    def __init__(self, n: int, num_computed: int = 0, block: int = 0, blocks: int = 1):
        self.token_ids = [0] * n
        self.num_computed_tokens = num_computed
        self.block_table = [block] * blocks
        self.table_epoch = 0  # never cached by the runner: its row is written whole

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def fake_batch(lengths: list[int], decode: int = 0, block_size: int = 16, computed: int = 0):
    """A ScheduledBatch of `decode` one-token decodes (contexts of computed + 1) then prefills of `lengths` tokens,
    every block-table entry 0 (reads and writes go to block 0)."""
    seqs = [_FakeSeq(computed + 1, computed, 0, -(-(computed + 1) // block_size)) for _ in range(decode)]
    seqs += [_FakeSeq(n, 0, 0, -(-n // block_size)) for n in lengths]
    return ScheduledBatch(seqs, [1] * decode + list(lengths), decode)


@dataclass
class WarmupReport:
    steps: int = 0  # synthetic steps run
    lora_launches: int = 0  # direct LoRA shrink launches (split variants)
    graphs: int = 0  # decode (and verify) graphs captured
    compiles: int | None = None  # Triton JIT compiles during the warm-up (None: not counted)
    seconds: float = 0.0


def compiles_kernels(runner) -> bool:
    """True when the runner's steps launch compiled Triton kernels (not the references, not the interpreter)."""
    return runner.kernels.ops == TRITON and os.environ.get("TRITON_INTERPRET") != "1"


def powers_up_to(n: int, lo: int = 1) -> list[int]:
    out, p = [], lo
    while p < n:
        out.append(p)
        p *= 2
    return out + [n] if n >= lo else out


def prefill_sizes(runner) -> list[list[int]]:
    """Per synthetic prefill step, its prompt lengths: one prompt per power of two of the token budget (split into
    several prompts past max_model_len)."""
    steps, n = [], runner.max_model_len
    for t in powers_up_to(runner.max_num_tokens, 2):
        step = ([n] * (t // n) + ([t % n] if t % n else []))[:runner.max_num_seqs]
        steps.append([x for x in step if x >= 2] or [2])
    return steps


def decode_sizes(runner) -> list[int]:
    return powers_up_to(min(runner.max_num_seqs, runner.max_num_tokens))


def _lora_modules(runner) -> dict[str, torch.nn.Module]:
    """One dense LoRA module per group with pools attached (every layer's module of a group has the same shapes)."""
    out: dict[str, torch.nn.Module] = {}
    for (_, group), mod in runner.model.lora_modules().items():
        if getattr(mod, "lora_a", None) is not None and not group.startswith("experts"):
            out.setdefault(group, mod)
    return out


def _meta(n: int, rank: int, device) -> LoraBatchMeta:
    """One adapter group over tokens [0, n) with rows [0, rank) and scaling 0 (the pools hold zeros anyway)."""
    i32 = dict(dtype=torch.int32, device=device)
    return LoraBatchMeta(token_indices=torch.arange(n, device=device), seg_starts=torch.tensor([0, n], **i32),
                         row_start=torch.zeros(1, **i32), ranks=torch.tensor([rank], **i32),
                         scalings=torch.zeros(1, dtype=torch.float32, device=device), max_rank=rank, max_seg_len=n,
                         seg_starts_cpu=[0, n], row_start_cpu=[0], ranks_cpu=[rank], scalings_cpu=[0.0])


def lora_classes(runner, capacity: int) -> tuple[list[int], list[int]]:
    """Representatives of the LoRA token-tile classes (group sizes) and rank-tile classes (ranks) reachable."""
    sizes = sorted({min(x, runner.max_num_tokens) for x in (1, 17, 33)})
    top = min(runner.config.max_lora_rank, capacity)
    ranks = sorted({r for r in range(1, top + 1) if r == top or block_r_for(r) != block_r_for(r + 1)})
    return sizes, ranks


def _forward(runner, batch, lora=None) -> None:
    ids, ctx, _ = runner.prepare(batch, lora)
    with forward_context(ctx):
        logits_of(runner.model, runner.model(ids, ctx.positions), ctx.logits_indices)


@torch.inference_mode()
def run_steps(runner) -> WarmupReport:
    """The synthetic steps and LoRA launches (no graphs, no counting): what warm_up() runs, and what the
    coverage test records."""
    rep = WarmupReport()
    bs = runner.block_size
    for lengths in prefill_sizes(runner):
        _forward(runner, fake_batch(lengths, block_size=bs))
        rep.steps += 1
    for b in decode_sizes(runner):
        _forward(runner, fake_batch([], decode=b, block_size=bs, computed=1))
        rep.steps += 1
    for d in (1, 3):  # the prefill part at an odd and an even row offset
        if d + 2 <= runner.max_num_tokens and d + 1 <= runner.max_num_seqs:
            _forward(runner, fake_batch([2], decode=d, block_size=bs, computed=1))
            rep.steps += 1
    mods = _lora_modules(runner)
    if mods:
        capacity = min(m.lora_a.shape[-2] for m in mods.values())
        sizes, ranks = lora_classes(runner, capacity)
        dev = runner.device
        for n in sizes:
            for r in ranks:  # a group of n tokens: a prefill of n, or one decode
                batch = fake_batch([n], block_size=bs) if n > 1 else fake_batch([], decode=1, block_size=bs)
                _forward(runner, batch, _meta(n, r, dev))
                rep.steps += 1
                if n <= FUSED_MAX_TOKENS:  # the fused shrink + expand, which the step above ran
                    continue
                for mod in mods.values():  # the split reduction on and off, whichever the step chose
                    x = torch.empty((n, mod.in_features), dtype=runner.dtype, device=dev)
                    for split in (1, 2):
                        lora_shrink_triton(x, mod.lora_a, _meta(n, r, dev), split_k=split)
                        rep.lora_launches += 1
    return rep


def warm_up(runner) -> WarmupReport:
    """Run at engine start, once the LoRA pools are attached. Captures the decode graphs on CUDA."""
    if not compiles_kernels(runner):
        return WarmupReport()
    from loom.kernels.compile_counter import JitCompileCounter, is_supported

    t0 = time.perf_counter()
    counter = JitCompileCounter() if is_supported() else None
    if counter is not None:
        counter.__enter__()
    try:
        rep = run_steps(runner)
        if runner.config.cuda_graphs:  # off CUDA (forced Triton: the coverage test) the same path, not captured
            from loom.engine.worker.cuda_graphs import DecodeGraphs

            runner.graphs = DecodeGraphs(runner, capture=runner.device.type == "cuda")
            rep.graphs = runner.graphs.capture_all()
            if runner.verify_hidden is not None:  # speculative decoding's verify steps (their own buckets)
                from loom.engine.worker.verify_graphs import VerifyGraphs

                runner.verify_graphs = VerifyGraphs(runner, runner.graphs.capture, pool=runner.graphs._pool)
                rep.graphs += runner.verify_graphs.capture_all()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    finally:
        if counter is not None:
            counter.__exit__(None, None, None)
    rep.compiles = counter.count if counter is not None else None
    rep.seconds = time.perf_counter() - t0
    log.info("warm-up: %d steps, %d LoRA launches, %d CUDA graphs, %s Triton compiles in %.1fs", rep.steps,
             rep.lora_launches, rep.graphs, rep.compiles, rep.seconds)
    return rep
