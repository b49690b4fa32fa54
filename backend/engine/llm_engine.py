"""The engine: requests in, one step at a time (schedule -> run -> sample -> outputs), token ids out.

Single-threaded by design: the serving layer calls it from one loop thread.

A request with n > 1 completions (vLLM's `n`) is n sequences. Only the first is scheduled at first; when its
prompt is computed, the others fork from it: they share its KV blocks (ref-counted; a partly filled last block
is copied) and sample their first token from the same logits row, each with its own seed (seed + index), so
the prompt is computed once.
"""
from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.engine.block_manager import BlockManager
from loom.engine.config import EngineConfig
from loom.engine.cpu import tune_mkl_for_amd
from loom.engine.faults import is_sticky_device_error
from loom.engine.logits_processors import build_constraints
from loom.engine.model_runner import ModelRunner, TokenFill
from loom.engine.outputs import EngineStats, StepOutput, TokenLogprob
from loom.engine.sampler import Sampler, SamplingBatch
from loom.engine.sampling_params import MAX_N, SamplingParams
from loom.engine.sampling_state import HOST_TOKENS, IGNORE_EOS, LOGPROBS, STOP_IDS, SamplingState
from loom.engine.scheduler import ScheduledBatch, Scheduler
from loom.engine.sequence import Sequence, SequenceStatus
from loom.errors import RequestError
from loom.lora.adapter_registry import AdapterRegistry

log = logging.getLogger("loom")

PLACEHOLDER = -1  # the id of a token a step in flight is still sampling (async scheduling; the device fills it in)


def seq_key(request_id: str, index: int) -> str:
    """Key of a sequence in LLMEngine.requests: the request id for completion 0 (so n = 1 is just the id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(eq=False)
class _Launched:
    """A step whose device work is queued: what waiting for it and making its outputs need."""
    batch: ScheduledBatch
    deferred_register: bool  # its computed range held placeholders: prefix-cache registration waits for them
    seqs: list = field(default_factory=list)  # the sampled sequences, in the logits' order
    tokens: torch.Tensor | None = None  # [S] sampled ids on the device (the next step's inputs, async)
    host: torch.Tensor | None = None  # the one host copy: tokens (int64), or tokens + logprobs (float64)
    event: object = None  # the end of its device work (CUDA), None where it is done already
    positions: list = field(default_factory=list)  # index of each sequence's new token in its token_ids
    lp_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rows with logprobs computed
    k: int = 0  # top logprobs per row in `host`
    nout: np.ndarray | None = None  # output count with this token
    max_out: np.ndarray | None = None  # output count that ends it by length
    min_tokens: np.ndarray | None = None
    ignore_eos: np.ndarray | None = None
    stop_ids: dict = field(default_factory=dict)  # row -> its stop_token_ids
    processors: object = None  # ProcessorBatch (grammar matchers accept the tokens)
    needs_host_tokens: bool = False  # grammar / bad_words rows: the next step samples after this one is done


def _eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    ids: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig, load_tokenizer: bool = True):
        tune_mkl_for_amd()  # before the first matmul (a Triton server does not run the benchmarks' harness)
        self.config = config
        model_dir = config.model
        if not model_dir:
            from loom.engine.default_model import resolve_default_model

            model_dir = resolve_default_model()
        self.model_dir = model_dir
        self.runner = ModelRunner(config, model_dir)
        self.tokenizer = None
        has_tokenizer = any(os.path.isfile(os.path.join(model_dir, f))
                            for f in ("tokenizer.json", "tokenizer_config.json"))
        if load_tokenizer and has_tokenizer:  # test models made without one take token ids only
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        self._eos_array = np.asarray(sorted(self.eos_token_ids), dtype=np.int64)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        kv_tokens = self.block_manager.capacity_tokens
        if kv_tokens < self.max_model_len:  # vLLM refuses to start here; loom serves, and says what it caps
            log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: a longer prompt is refused and a "
                        "request ends (finish_reason length) when its prompt and output fill the whole cache; raise "
                        "kv_cache_memory_bytes or lower max_model_len", kv_tokens, self.max_model_len)
        self.adapters = AdapterRegistry(config, self.runner.model, self.runner.device,
                                        config.resolve_lora_dtype(self.runner.dtype))
        self.runner.warm_up()  # with the LoRA pools attached: every kernel variant compiled, decode graphs captured
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   can_run=self._can_run, on_preempt=self._on_preempt)
        self.sampler = Sampler()
        # Per-request sampling state kept across steps; None = the simple path (SamplingBatch.build from the
        # sequences' lists every step; kept as the reference the tests compare with, synchronous only).
        self.sampling_state: SamplingState | None = SamplingState(self.runner.vocab_size, self.runner.device,
                                                                  self.runner.buffers)
        self.async_scheduling = bool(getattr(config, "async_scheduling", False))
        self._inflight: _Launched | None = None  # async scheduling: the step still running on the device
        self._num_adapter_seqs = 0  # unfinished sequences with an adapter (0: no step builds LoRA metadata)
        self._num_plp_seqs = 0  # unfinished sequences asking for prompt logprobs
        # loom.engine.structured_output.GrammarCompiler, made at the first structured request (the serving layer
        # sets it itself, made with its own tokenizer copy, and compiles in its own thread)
        self.grammar_compiler = None
        # Unfinished sequences by key: the request id for completion 0, "<request id>#<index>" for the others.
        self.requests: dict[str, Sequence] = {}
        self._alive: dict[str, int] = {}  # request id -> its unfinished sequences
        self._unforked: dict[str, list[Sequence]] = {}  # n > 1: completions waiting for the first one's prompt
        self._finished_outputs: list[StepOutput] = []  # aborts and refusals reported at the next step
        self._adapter_failed: list[Sequence] = []
        self._rng = random.Random(config.seed)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._last_batch: list[Sequence] = []
        self.failed_steps_in_a_row = 0
        self.fatal_error: str | None = None  # set by a sticky device error: the engine cannot serve any more

    # ---- adapters --------------------------------------------------------------------------------

    def _can_run(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        try:
            if seq.adapter.error is None:
                return self.adapters.activate(seq.adapter)
        except RequestError:  # the background load failed between the check and activate()
            pass
        self._adapter_failed.append(seq)  # its adapter failed to load: fail it after scheduling
        return False

    def _on_preempt(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self.adapters.deactivate(seq.adapter)

    # ---- requests --------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def grammars(self):
        """The structured-output compiler (thread-safe: the serving layer may compile ahead in its own thread)."""
        if self.grammar_compiler is None:
            if self.tokenizer is None:
                raise RequestError("structured_outputs", "needs a tokenizer (this engine has none)")
            from loom.engine.structured_output import GrammarCompiler

            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids))
        return self.grammar_compiler

    def prompt_limit(self) -> int:
        return self.config.max_prompt_tokens or self.max_model_len - 1

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if request_id in self._alive:
            raise RequestError("request_id", f"{request_id!r} is already in flight")
        limit = self.prompt_limit()
        if params.truncate_prompt_tokens is not None:  # vLLM: keep the last k tokens (-1: as many as allowed)
            k = limit if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            prompt_token_ids = prompt_token_ids[-k:]
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("prompt", "is empty")
        if n > limit:
            raise RequestError("prompt", f"has {n} tokens; the limit is {limit}")
        vocab = self.runner.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        cap_tokens = self.block_manager.capacity_tokens
        if n + 1 > cap_tokens:
            raise RequestError("prompt", f"has {n} tokens but the whole KV cache holds {cap_tokens}; "
                               "raise kv_cache_memory_bytes")
        constraints = build_constraints(params, vocab, self.tokenizer,
                                        self.grammars if params.structured_outputs is not None else None)
        # A request must be able to finish alone, or preemption could cycle forever.
        max_total = min(n + params.max_tokens, self.max_model_len, cap_tokens)
        refs = []
        try:
            for _ in range(params.n if lora_name else 0):
                refs.append(self.adapters.acquire(lora_name))
        except RequestError:
            for ref in refs:
                self.adapters.release(ref)
            raise
        seqs = {}
        for i in range(params.n):  # vLLM's child seeds: seed + index
            seed = (params.seed + i) % (1 << 63) if params.seed is not None else self._rng.getrandbits(63)
            seq = Sequence(request_id, list(prompt_token_ids), params, seed, adapter=refs[i] if refs else None,
                           max_total_tokens=max_total, index=i, constraints=constraints)
            if constraints is not None and constraints.grammar is not None:
                seq.matcher = self.grammars.matcher(constraints.grammar)
            seqs[i] = seq
        for i, seq in seqs.items():
            self.requests[seq_key(request_id, i)] = seq
        self._alive[request_id] = params.n
        if refs:
            self._num_adapter_seqs += params.n
        if params.prompt_logprobs is not None:
            self._num_plp_seqs += 1  # only the first completion computes them
        self.prompt_tokens += n
        self.scheduler.add(seqs[0])
        if params.n > 1:
            self._unforked[request_id] = [seqs[i] for i in range(1, params.n)]

    def abort_request(self, request_id: str, reason: str = "abort", error: str | None = None,
                      index: int | None = None) -> None:
        """Abort a request (all its completions), or with `index` only that completion."""
        if request_id not in self._alive:
            return
        keys = [seq_key(request_id, index)] if index is not None else [
            k for k in (seq_key(request_id, i) for i in range(MAX_N)) if k in self.requests]
        for k in keys:
            seq = self.requests.get(k)
            if seq is None:
                continue
            self._finish(seq, reason)
            self._finished_outputs.append(self._output(seq, [], None, error=error))

    @property
    def last_step_request_ids(self) -> list[str]:
        """The requests scheduled in the latest step (the serving layer fails these if step() itself raises)."""
        return [s.request_id for s in self._last_batch]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs) or self._inflight is not None

    def use_simple_sampling(self) -> None:
        """Rebuild the sampling tensors from the sequences' lists every step (the reference path; synchronous)."""
        if self.requests or self._inflight is not None:
            raise RuntimeError("switch the sampling path before adding requests")
        self.sampling_state = None
        self.async_scheduling = False

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is (running, waiting, not forked yet) and release what it holds."""
        self._release(seq)
        self.scheduler.finish(seq, reason)

    def _finish_many(self, ending: list[tuple[Sequence, str]]) -> None:
        """_finish for the sequences that ended in one step, with one pass over the scheduler's queues."""
        for seq, _ in ending:
            self._release(seq)
        self.scheduler.finish_many(ending)

    def _release(self, seq: Sequence) -> None:
        """The engine's side of finishing: request maps, unforked siblings, sampling row, adapter."""
        if self.sampling_state is not None:
            self.sampling_state.release(seq)
        key = seq_key(seq.request_id, seq.index)
        if self.requests.get(key) is seq:
            del self.requests[key]
            self._alive[seq.request_id] -= 1
            if not self._alive[seq.request_id]:
                del self._alive[seq.request_id]
        pending = self._unforked.get(seq.request_id)
        if pending is not None:
            if seq in pending:
                pending.remove(seq)
            elif seq.index == 0:  # it ends before its prompt was computed: the others prefill on their own
                for child in pending:
                    self.scheduler.add(child)
                pending.clear()
            if not pending:
                del self._unforked[seq.request_id]
        if seq.index == 0 and seq.params.prompt_logprobs is not None:
            self._num_plp_seqs -= 1
        if seq.adapter is not None:
            self._num_adapter_seqs -= 1
            self.adapters.deactivate(seq.adapter)
            self.adapters.release(seq.adapter)

    def _output(self, seq: Sequence, new_ids: list[int], logprobs, error: str | None = None,
                prompt_logprobs: list | None = None) -> StepOutput:
        return StepOutput(seq.request_id, new_ids, logprobs, seq.status == SequenceStatus.FINISHED, seq.finish_reason,
                          seq.num_prompt_tokens, seq.num_cached_tokens,
                          seq.cumulative_logprob if seq.wants_logprob else None, error, seq.index, prompt_logprobs)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step. Synchronous: schedule, launch, wait, outputs of this step. With async scheduling:
        schedule and launch step N+1 while step N still runs on the device, then wait for N and return its
        outputs (one step behind; a step whose sequences need their previous token on the host before sampling,
        i.e. grammar or bad_words, is waited for first)."""
        self._last_batch = []
        prev = self._inflight
        outputs: list[StepOutput] = []
        if prev is not None and (prev.needs_host_tokens or not self.async_scheduling):
            self._inflight = None
            outputs += self._finish_launched(prev)
            prev = None
        batch = self.scheduler.schedule()
        self._last_batch = batch.seqs
        failed, self._adapter_failed = self._adapter_failed, []
        for seq in failed:
            self.abort_request(seq.request_id, reason="error", error=f"lora_name: {seq.adapter.error}")
        launched = None
        if batch.seqs:
            try:
                launched = self._launch(batch)
            except Exception as e:  # fail only this step's requests; the engine keeps serving
                self._step_failed(batch.seqs, e)
        self._inflight = None
        if prev is not None:
            outputs += self._finish_launched(prev)
        if launched is not None:
            if self.async_scheduling:
                self._inflight = launched
            else:
                outputs += self._finish_launched(launched)
        elif prev is None and not batch.seqs and self.adapters.has_pending_loads():
            self.adapters.wait_for_loads(0.05)  # nothing runnable until an adapter arrives: don't spin
        outputs += self._finished_outputs
        self._finished_outputs = []
        return outputs

    def _step_failed(self, seqs: list[Sequence], e: Exception) -> None:
        log.error("engine step failed", exc_info=e)
        msg = f"engine step failed: {type(e).__name__}: {e}"
        self.failed_steps_in_a_row += 1
        if self.fatal_error is None and is_sticky_device_error(e):
            self.fatal_error = f"sticky device error: {type(e).__name__}: {e}"
        for seq in seqs:
            if seq.request_id in self._alive:
                self.abort_request(seq.request_id, reason="error", error=msg)

    def _finish_launched(self, launched: "_Launched") -> list[StepOutput]:
        try:
            out = self._finish_step(launched)
            self.failed_steps_in_a_row = 0
            return out
        except Exception as e:
            self._step_failed(launched.batch.seqs, e)
            return []

    def _token_fill(self, batch: ScheduledBatch) -> TokenFill | None:
        """Async scheduling: where this step's input ids are tokens the step in flight is still sampling
        (flat input positions, and those tokens on the device)."""
        prev = self._inflight
        if prev is None:
            return None
        pos, src = [], []
        off = 0
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            pend = seq.pending
            if pend is not None and pend[0] is prev:
                p = pend[2] - seq.num_computed_tokens
                if 0 <= p < n:
                    pos.append(off + p)
                    src.append(pend[1])
            off += n
        if not pos:
            return None
        return np.asarray(pos, np.int64), np.asarray(src, np.int64), prev.tokens

    def _launch(self, batch: ScheduledBatch) -> "_Launched":
        """Queue the step's device work (forward, sampling, the copy of its results to the host); no sync."""
        lora = None
        if self._num_adapter_seqs and any(s.adapter is not None for s in batch.seqs):
            lora = self.adapters.build_lora_meta([s.adapter for s in batch.seqs], batch.num_scheduled_tokens)
        plp_rows, plp_targets = self._prompt_logprob_rows(batch) if self._num_plp_seqs else ([], [])
        fill = self._token_fill(batch)
        extra = {"fill": fill} if fill is not None else {}
        if plp_rows:
            logits, sampled_idx = self.runner.run(batch, lora, [r for r, _, _ in plp_rows], **extra)
        else:
            logits, sampled_idx = self.runner.run(batch, lora, **extra)
        deferred = self._inflight is not None  # placeholders in the computed range: register blocks later
        if deferred:
            for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
                seq.num_computed_tokens += n
        else:
            bm = self.block_manager
            bs = bm.block_size
            for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
                c = seq.num_computed_tokens = seq.num_computed_tokens + n
                if c >= (seq.num_hashed_blocks + 1) * bs:  # a block filled up
                    bm.register_full_blocks(seq)
        if plp_rows:
            self._add_prompt_logprobs(logits[len(sampled_idx):], plp_rows, plp_targets)
            logits = logits[:len(sampled_idx)]
        launched = _Launched(batch, deferred)
        if not sampled_idx:
            return launched
        seqs = list(batch.seqs) if len(sampled_idx) == len(batch.seqs) else [batch.seqs[i] for i in sampled_idx]
        forked = False
        for i, seq in enumerate(list(seqs) if self._unforked else ()):
            if seq.index == 0 and seq.num_output_tokens == 0 and seq.request_id in self._unforked:
                children = self._fork(seq)  # they sample their first token from the parent's logits
                if children:
                    if not forked:
                        rows = list(range(len(seqs)))
                        forked = True
                    seqs += children
                    rows += [i] * len(children)
        if forked:
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        S = len(seqs)
        state = self.sampling_state
        if state is not None:
            rows_np = np.fromiter((s.sampling_row for s in seqs), dtype=np.int64, count=S)
            for i in np.nonzero(rows_np < 0)[0].tolist():
                rows_np[i] = state.join(seqs[i], self.eos_token_ids)
            sb, step_rows = state.batch(seqs, rows_np)
            out = self.sampler(logits, sb)
            state.after_sample(step_rows, out.token_ids)
            flags = step_rows.flags
            launched.nout = state.steps[rows_np]
            launched.max_out = state.max_out[rows_np]
            launched.min_tokens = state.min_tokens[rows_np]
            launched.ignore_eos = (flags & IGNORE_EOS) != 0
            stop_rows = np.nonzero(flags & STOP_IDS)[0].tolist()
            launched.stop_ids = {i: state.stop_token_ids[rows_np[i]] for i in stop_rows}
            lp_pos = np.nonzero(flags & LOGPROBS)[0]
            launched.needs_host_tokens = bool(np.bitwise_or.reduce(flags) & HOST_TOKENS)
        else:  # the simple path: everything rebuilt from the sequences' lists
            sb = SamplingBatch.build(
                [s.params for s in seqs], [s.seed for s in seqs], [s.prompt_token_ids for s in seqs],
                [s.output_token_ids for s in seqs], [self._stop_ids(s) for s in seqs], self.runner.vocab_size,
                logits.device, constraints=[s.constraints for s in seqs], matchers=[s.matcher for s in seqs],
                want_logprobs=[s.wants_logprob for s in seqs])
            out = self.sampler(logits, sb)
            ps = [s.params for s in seqs]
            launched.nout = np.asarray([s.num_output_tokens + 1 for s in seqs], dtype=np.int64)
            launched.max_out = np.asarray([min(p.max_tokens, s.max_total_tokens - s.num_prompt_tokens)
                                           for p, s in zip(ps, seqs)], dtype=np.int64)
            launched.min_tokens = np.asarray([p.min_tokens for p in ps], dtype=np.int64)
            launched.ignore_eos = np.asarray([p.ignore_eos for p in ps], dtype=bool)
            launched.stop_ids = {i: frozenset(p.stop_token_ids) for i, p in enumerate(ps) if p.stop_token_ids}
            lp_pos = np.asarray([i for i, s in enumerate(seqs) if s.wants_logprob], dtype=np.int64)
            launched.needs_host_tokens = any(s.matcher is not None or (s.constraints is not None and
                                                                        s.constraints.bad_words) for s in seqs)
        # everything the host needs from the step in one device-to-host copy
        tok = out.token_ids
        if out.logprobs is None:
            launched.host = self.runner.buffers.download(tok)
        else:
            parts = [tok.double(), out.logprobs.double()]
            if out.topk_ids is not None:
                parts += [out.topk_ids.double().flatten(), out.topk_logprobs.double().flatten()]
                launched.k = out.topk_ids.shape[1]
            launched.host = self.runner.buffers.download(torch.cat(parts))
        launched.event = self._new_event()
        launched.seqs, launched.tokens, launched.lp_pos = seqs, tok, lp_pos
        launched.processors = sb.processors
        if self.async_scheduling:  # a placeholder until the token reaches the host; the next step reads it
            positions = []
            for i, seq in enumerate(seqs):
                tl = seq.token_ids
                tl.append(PLACEHOLDER)
                p = len(tl) - 1
                positions.append(p)
                seq.pending = (launched, i, p)
            launched.positions = positions
            ending = np.nonzero(launched.nout >= launched.max_out)[0]
            if len(ending):  # they end with this token: keep them out of the next step
                gone = {id(seqs[i]) for i in ending.tolist()}
                self.scheduler.running[:] = [s for s in self.scheduler.running if id(s) not in gone]
        return launched

    def _new_event(self):
        """Marks the end of a step's device work (None on CPU, where the work is done when launch returns)."""
        if self.runner.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _finish_step(self, launched: "_Launched") -> list[StepOutput]:
        """Wait for a launched step, put its tokens in place, check stops, make the outputs."""
        if launched.deferred_register:
            bm = self.block_manager
            bs = bm.block_size
            for seq in launched.batch.seqs:
                if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * bs:
                    bm.register_full_blocks(seq)
        seqs = launched.seqs
        if not seqs:
            return []
        if launched.event is not None:
            launched.event.synchronize()
        S = len(seqs)
        host = launched.host.numpy()
        toks = host[:S].astype(np.int64) if host.dtype != np.int64 else host
        # token-level stops, vectorised: eos / stop_token_ids once min_tokens is reached, then length
        nout = launched.nout
        if len(self._eos_array) == 1:
            hit = (toks == self._eos_array[0]) & ~launched.ignore_eos
        elif len(self._eos_array):
            hit = np.isin(toks, self._eos_array) & ~launched.ignore_eos
        else:
            hit = np.zeros(S, dtype=bool)
        for i, ids in launched.stop_ids.items():
            hit[i] |= int(toks[i]) in ids
        hit &= nout >= launched.min_tokens
        done = np.nonzero(hit | (nout >= launched.max_out))[0].tolist()
        reasons = {i: ("stop" if hit[i] else "length") for i in done}
        tok_list = toks.tolist()
        first = np.nonzero(nout == 1)[0].tolist()  # first tokens: timing, prompt logprobs
        lps = {}
        L = len(launched.lp_pos)
        if L:
            pos = launched.lp_pos.tolist()
            vals = host[S:S + L].tolist()
            k = launched.k
            if k:
                ids_ = host[S + L:S + L + L * k].astype(np.int64).reshape(L, k).tolist()
                lps_ = host[S + L + L * k:S + L + 2 * L * k].reshape(L, k).tolist()
                lps = {p: (v, list(zip(a, b))) for p, v, a, b in zip(pos, vals, ids_, lps_)}
            else:
                lps = {p: (v, []) for p, v in zip(pos, vals)}
        refused, complete = launched.processors.accept(tok_list) if launched.processors is not None else ([], [])
        # the grammar took its stop token: the output is whole, even under ignore_eos / min_tokens
        reasons.update(dict.fromkeys(complete, "stop"))
        refused, first = set(refused), set(first)
        special = set(done) | first | set(lps) | refused | set(complete)  # rows that need more than a plain output
        self.generation_tokens += S
        ending: list[tuple[Sequence, str]] = []
        positions = launched.positions if self.async_scheduling else None
        now = time.monotonic()
        dropped: set[int] = set()  # async: rows aborted (or ended) after this step was launched get no output
        if positions is None:
            for seq, tok in zip(seqs, tok_list):
                seq.token_ids.append(tok)
        else:
            finished = SequenceStatus.FINISHED
            for i, seq in enumerate(seqs):
                seq.token_ids[positions[i]] = tok_list[i]
                pend = seq.pending
                if pend is not None and pend[0] is launched:
                    seq.pending = None
                if seq.status is finished:
                    self.generation_tokens -= 1
                    dropped.add(i)
        # a plain output for every row (one comprehension: this is the step's per-request cost), then the rows
        # that need more (ending, first token, logprobs) get theirs in place, in row order
        results = [StepOutput(seq.request_id, [tok], None, False, None, seq.num_prompt_tokens, seq.num_cached_tokens,
                              None, None, seq.index) for seq, tok in zip(seqs, tok_list)]
        for i in sorted(special - dropped):
            seq, tok = seqs[i], tok_list[i]
            lp = cum = plp = timing = error = None
            if i in lps:
                v, best = lps[i]
                seq.cumulative_logprob += v
                cum = seq.cumulative_logprob
                n = seq.params.logprobs
                if n is not None:
                    lp = [TokenLogprob(tok, v, best[:n])]
            if i in first:  # its first token
                timing = (seq.first_scheduled_time, now)
                if seq.index == 0 and seq.prompt_logprobs is not None:
                    plp = seq.prompt_logprobs
            reason = reasons.get(i)
            if i in refused:  # a refused token (cannot happen under the mask) or a failed matcher: never run on
                reason, error = "error", f"structured_outputs: the grammar cannot go on at token {tok}"
            if reason is not None:
                ending.append((seq, reason))
            results[i] = StepOutput(seq.request_id, [tok], lp, reason is not None, reason, seq.num_prompt_tokens,
                                    seq.num_cached_tokens, cum, error, seq.index, plp, timing)
        if dropped:
            results = [r for i, r in enumerate(results) if i not in dropped]
        if ending:
            self._finish_many(ending)
        return results

    # ---- n > 1 ---------------------------------------------------------------------------------------
    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's prompt is computed: its waiting siblings share its blocks and join the running batch.
        Those that cannot (no free block, or max_num_seqs reached) prefill on their own later (prefix cache)."""
        forked = []
        for child in self._unforked.pop(parent.request_id, []):
            ok = len(self.scheduler.running) < self.scheduler.max_num_seqs
            if ok and child.adapter is not None:
                ok = self.adapters.activate(child.adapter)
            copy = self.block_manager.fork(parent, child) if ok else False
            if copy is False:
                if child.adapter is not None:
                    self.adapters.deactivate(child.adapter)
                self.scheduler.add(child)
                continue
            if copy is not None:
                kv = self.runner.kv_cache  # [layers, 2, blocks, block_size, kv heads, head dim]
                kv[:, :, copy[1]].copy_(kv[:, :, copy[0]])
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            child.ever_scheduled = True
            self.scheduler.running.append(child)
            forked.append(child)
        return forked

    # ---- prompt logprobs -----------------------------------------------------------------------------
    def _prompt_logprob_rows(self, batch: ScheduledBatch) -> tuple[list[tuple[int, Sequence, int]], list[int]]:
        """(flat token row, sequence, prompt position) for every scheduled prompt position whose logits predict a
        prompt token not scored yet, and those tokens."""
        rows, targets = [], []
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            if seq.prompt_logprobs_pending:
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None]  # the first prompt token has no context
                start = seq.num_computed_tokens
                for pos in range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append((offset + pos - start, seq, pos))
                    targets.append(seq.prompt_token_ids[pos + 1])
            offset += n
        return rows, targets

    def _add_prompt_logprobs(self, logits: torch.Tensor, rows, targets: list[int], chunk: int = 256) -> None:
        """Raw-model logprob and exact rank of each scored prompt token, and the top-n (vLLM's prompt_logprobs).
        In chunks of rows, so a long prompt never holds a second [rows, vocab] tensor at once."""
        k = max(seq.params.prompt_logprobs for _, seq, _ in rows)
        for c in range(0, len(rows), chunk):
            lp = torch.log_softmax(logits[c:c + chunk].float(), dim=-1)
            tgt = torch.tensor(targets[c:c + chunk], dtype=torch.int64, device=lp.device)[:, None]
            tok_lp = lp.gather(1, tgt)
            ranks = (lp >= tok_lp).sum(dim=-1).tolist()  # vLLM's rank: how many tokens are at least as likely
            top_lp = top_ids = None
            if k > 0:
                top = lp.topk(k, dim=-1)
                top_lp, top_ids = top.values.tolist(), top.indices.tolist()
            for j, (_, seq, pos) in enumerate(rows[c:c + chunk]):
                if len(seq.prompt_logprobs) != pos + 1:
                    continue  # already scored (recomputed after a preemption)
                kk = seq.params.prompt_logprobs
                best = list(zip(top_ids[j][:kk], top_lp[j][:kk])) if kk else []
                seq.prompt_logprobs.append(TokenLogprob(targets[c + j], tok_lp[j, 0].item(), best, ranks[j]))

    def _stop_ids(self, seq: Sequence) -> list[int]:
        ids = list(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    # ---- counters --------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for seqs, counts in ((self.scheduler.running, running), (self.scheduler.waiting, waiting)):
            for s in seqs if self._num_adapter_seqs else ():  # O(1) without adapters (read every step)
                if s.adapter is not None:
                    counts[s.adapter.name] = counts.get(s.adapter.name, 0) + 1
        max_loras = self.adapters.capacity_rows // max(1, self.config.max_lora_rank)
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens, prefix_query_tokens=self.scheduler.prefix_query_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            resident_adapters=self.adapters.num_resident(),
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            running_adapters=running, waiting_adapters=waiting, max_loras=max_loras, block_size=bm.block_size)
