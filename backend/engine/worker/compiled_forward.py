"""The model's forward + logits as one callable for the model runner: eager, or compiled with torch.compile.

Eager: the model as written; on CPU float32 its linear layers run the C++ GEMM over packed weights
(kernels/cpu_linear.py, set up by engine/worker/cpu.py) and attention / LoRA the in-place C++ kernels
(kernels/cpu_*.py). With LOOM_CPU_KERNELS=0 it is the PyTorch reference path (F.linear, SDPA).

Compiled (`cpu_compile`, CPU only): inductor over the whole forward and the logits - the elementwise work
between the GEMMs (norms, residual adds, rotary, SiLU) is fused into generated C++ loops and the Python of
~30 layers becomes one call. The GEMMs (`loom::linear_packed`), attention (`loom::paged_attention`) and LoRA
(`loom::apply_lora`) stay opaque ops, the same kernels as eager; the last two read the per-step forward
context. Token and logits counts are unbacked dynamic sizes: one graph serves every step, sizes 0 and 1
included. Compiled once per start (minutes for a 30-layer model on one core); inductor's caches on disk
(its FX graph and compiled C++ kernels) shorten later starts.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger("loom")

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _forward(model) -> Forward:
    def forward(input_ids, positions, logits_indices):
        return model.compute_logits(model(input_ids, positions)[logits_indices])

    return forward


def logits_of(model, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
    """Float32 logits [S, vocab] of the rows logits_indices picks out of hidden [T, H]: lm_head runs over those rows
    only (a graph batch's padded rows never reach it). The eager forward and the decode-graph path both end here."""
    if logits_indices.shape[0] == 0:  # a step that samples nothing (a prefill chunk): no GEMM of 0 rows
        return hidden.new_empty((0, model.config.vocab_size), dtype=torch.float32)
    return model.compute_logits(hidden.index_select(0, logits_indices))


class EagerForward:
    """forward(input_ids [T], positions [T], logits_indices [S]) -> logits [S, vocab] float32: the model as written."""

    compile_s = 0.0

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, positions, logits_indices):
        return logits_of(self.model, self.model(input_ids, positions), logits_indices)

    def warm_up(self, block_size: int) -> None:
        pass


def build_forward(runner) -> EagerForward | CompiledForward:
    """The runner's forward (the CPU set-up it runs on is the runner's, engine/worker/cpu.py); with cpu_compile it
    compiles in warm_up() (called once the LoRA pools are attached) or else in the first step."""
    if runner.device.type == "cpu" and runner.config.cpu_compile:
        return CompiledForward(runner.model)
    return EagerForward(runner.model)


class CompiledForward:
    """forward(input_ids [T], positions [T], logits_indices [S]) -> logits [S, vocab] float32, compiled."""

    def __init__(self, model):
        self.model = model
        self.compile_s = 0.0
        # No guards: the graph holds for every step of this model (unbacked sizes; the model does not change after
        # warm_up, and the per-step state is read at run time by the opaque ops). Evaluating the guards on the
        # ~800 modules and tensors would cost ~10 ms a step.
        self._fn = torch.compile(_forward(model), dynamic=True, fullgraph=True,
                                 options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})

    def __call__(self, input_ids, positions, logits_indices):
        # Unbacked sizes: torch would otherwise specialise sizes 0 and 1 and compile again mid-run (a single
        # decode, a chunk that samples nothing).
        for t in (input_ids, positions, logits_indices):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        if self.compile_s:
            return self._fn(input_ids, positions, logits_indices)
        t0 = time.perf_counter()
        out = self._fn(input_ids, positions, logits_indices)
        self.compile_s = time.perf_counter() - t0
        log.info("compiled the CPU forward in %.1fs", self.compile_s)
        return out

    @torch.inference_mode()
    def warm_up(self, block_size: int) -> None:
        """Compile now with a dummy step: one 2-token prefill that stores nothing (slots -1) and reads block 0.
        Call it once the model is final (LoRA pools attached): attributes the graph reads are guarded."""
        if self.compile_s:
            return
        from loom.layers.forward_context import AttentionMeta, ForwardContext, forward_context

        i32 = dict(dtype=torch.int32)
        pre = AttentionMeta(torch.tensor([0, 2], **i32), torch.tensor([2], **i32), torch.zeros((1, 1), **i32), 2, 2)
        ctx = ForwardContext(positions=torch.arange(2), slot_mapping=torch.full((2,), -1), num_decode_seqs=0,
                             decode=None, prefill=pre, logits_indices=torch.tensor([1]))
        with forward_context(ctx):
            self(torch.zeros(2, dtype=torch.long), ctx.positions, ctx.logits_indices)
