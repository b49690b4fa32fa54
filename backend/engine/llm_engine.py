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

import numpy as np
import torch

from loom.distributed.parallel_state import RankFailure
from loom.distributed.ranks import Ranks
from loom.engine.config import EngineConfig
from loom.engine.core.block_manager import BlockManager
from loom.engine.core.output_processor import (
    LaunchedStep,
    OutputProcessor,
    add_prompt_logprobs,
    final_output,
    prompt_logprob_rows,
)
from loom.engine.core.scheduler import ScheduledBatch, Scheduler
from loom.engine.core.sequence import Sequence, SequenceStatus
from loom.engine.faults import is_sticky_device_error
from loom.engine.outputs import EngineStats, SpecDecodingStats, StepOutput
from loom.engine.sample.logits_processors import build_constraints
from loom.engine.sample.sampler import Sampler, SamplerOutput
from loom.engine.sample.sampling_state import HOST_TOKENS, IGNORE_EOS, LOGPROBS, STOP_IDS, SamplingState
from loom.engine.sampling_params import MAX_N, SamplingParams
from loom.engine.spec_decode.decoder import SpecDecoder
from loom.engine.spec_decode.draft_model import DraftModel, check_vocabulary
from loom.engine.worker.cpu import tune_mkl_for_amd
from loom.engine.worker.model_runner import ModelRunner, TokenFill
from loom.errors import RequestError
from loom.lora.adapter_registry import AdapterRegistry

log = logging.getLogger("loom")

PLACEHOLDER = -1  # the id of a token a step in flight is still sampling (async scheduling; the device fills it in)


def seq_key(request_id: str, index: int) -> str:
    """Key of a sequence in LLMEngine.requests: the request id for completion 0 (so n = 1 is just the id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


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
        # tensor parallelism: this process is rank 0; the workers (ranks 1..N-1) start here and stop in close()
        self.ranks = Ranks(config, model_dir, ModelRunner) if config.tensor_parallel_size > 1 else None
        try:
            self._start(config, model_dir, load_tokenizer)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(orderly=False)
            raise
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   can_run=self._can_run, on_preempt=self._on_preempt,
                                   adapter_state=lambda seq, place: self.adapters.prefetch(seq.adapter, place),
                                   max_lora_wait_steps=config.max_lora_wait_steps)
        self.sampler = Sampler()
        self.sampling_state = SamplingState(self.runner.vocab_size, self.runner.device, self.runner.buffers)
        self.async_scheduling = config.resolve_async_scheduling(self.runner.device)
        # speculative decoding: the scheduler drafts through it, steps are synchronous (loom.engine.spec_decode)
        self.spec = SpecDecoder.attach(self) if config.speculative_config is not None else None
        self._inflight: LaunchedStep | None = None  # async scheduling: the step still running on the device
        self._num_adapter_seqs = 0  # unfinished sequences with an adapter (0: no step builds LoRA metadata)
        self._num_plp_seqs = 0  # unfinished sequences asking for prompt logprobs
        # loom.engine.sample.structured_output.GrammarCompiler, made at the first structured request (the serving layer
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

    def _start(self, config: EngineConfig, model_dir: str, load_tokenizer: bool) -> None:
        """The model runner (rank 0's with tensor parallelism), tokenizer, KV blocks, adapters, warm-up."""
        spec = config.speculative_config
        # a draft model first: the target's KV blocks are sized with the draft's share of each block
        self.draft = DraftModel.load(config, model_dir) if spec is not None and spec.method == "draft_model" else None
        self.runner = self._start_runner(config, model_dir,
                                         self.draft.runner.bytes_per_block if self.draft is not None else 0)
        if self.draft is not None:
            check_vocabulary(model_dir, spec.model, self.runner.vocab_size, self.draft.vocab_size)
            self.draft.runner.allocate_kv(self.runner.num_blocks)
        self.tokenizer = None
        has_tokenizer = any(os.path.isfile(os.path.join(model_dir, f))
                            for f in ("tokenizer.json", "tokenizer_config.json"))
        if load_tokenizer and has_tokenizer:  # test models made without one take token ids only
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        self.output_processor = OutputProcessor(self.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        kv_tokens = self.block_manager.capacity_tokens
        if kv_tokens < self.max_model_len:  # vLLM refuses to start here; loom serves, and says what it caps
            log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: a longer prompt is refused and a "
                        "request ends (finish_reason length) when its prompt and output fill the whole cache; raise "
                        "kv_cache_memory_bytes or lower max_model_len", kv_tokens, self.max_model_len)
        # under tensor parallelism the workers' pools follow these rows (loom.lora.tp_pools): the step carries them
        self.adapters = AdapterRegistry(config, self.runner.model, self.runner.device,
                                        config.resolve_lora_dtype(self.runner.dtype), tp=self.runner.tp)
        self.runner.peer_log = self.adapters.residency.peer_log
        self.runner.warm_up()  # with the LoRA pools attached: every kernel variant compiled, decode graphs captured
        if self.draft is not None:
            self.draft.runner.warm_up()

    def _start_runner(self, config: EngineConfig, model_dir: str, kv_share_bytes: int = 0) -> ModelRunner:
        try:
            return ModelRunner(config, model_dir, tp=self.ranks.group if self.ranks is not None else None,
                               kv_share_bytes=kv_share_bytes)
        except Exception as e:
            if self.ranks is not None and not isinstance(e, ValueError):  # a collective failed: name a dead worker
                try:
                    self.ranks.check(grace_s=2.0)
                except RankFailure as dead:
                    raise dead from e
            raise

    def check_health(self) -> str | None:
        """None while the engine can serve; else why not (for good). Between steps (the serving loop asks when
        idle): a tensor-parallel rank that died since the last step is found here, not at the next request."""
        if self.fatal_error is None and self.ranks is not None:
            try:
                self.ranks.check(remote=True)
            except RankFailure as e:
                self.fatal_error = str(e)
        return self.fatal_error

    def close(self) -> None:
        """Stop what the engine started: the adapter loader (thread and process), the tensor-parallel workers. No step
        runs after."""
        if self.adapters is not None:
            self.adapters.close()
        if getattr(self, "draft", None) is not None:
            self.draft.close()  # its adapters' loader
        if self.ranks is not None:
            self.ranks.close()

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
            from loom.engine.sample.structured_output import GrammarCompiler

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
        if refs:  # its adapter moves toward the device while it waits (acquire started the read from disk)
            self.adapters.prefetch(refs[0])
            if self.draft is not None:  # and the draft model's adapter of the same name, if it has one
                self.draft.prefetch(refs[0])
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
            self._finished_outputs.append(final_output(seq, error))

    @property
    def last_step_request_ids(self) -> list[str]:
        """The requests scheduled in the latest step (the serving layer fails these if step() itself raises)."""
        return [s.request_id for s in self._last_batch]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs) or self._inflight is not None

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

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine step. Synchronous: schedule, launch, wait, outputs of this step. With async scheduling:
        schedule and launch step N+1 while step N still runs on the device, then wait for N and return its
        outputs (one step behind; a step whose sequences need their previous token on the host before sampling,
        i.e. grammar or bad_words, is waited for first)."""
        self._last_batch = []
        prev = self._inflight
        outputs: list[StepOutput] = []
        generated = self.generation_tokens
        if prev is not None and (prev.needs_host_tokens or not self.async_scheduling):
            self._inflight = None
            outputs += self._finish_launched(prev)
            prev = None
        batch = self.scheduler.schedule()
        self._last_batch = batch.seqs
        if self.adapters is not None and self.adapters.paces_loads:  # CPU: the share loads may take until next step
            sched = self.scheduler
            self.adapters.pace_loads(len(batch.seqs), [(s.adapter, sched.age(s)) for s in sched.waiting
                                                       if s.adapter is not None], sched.max_lora_wait_steps)
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
        if self.spec is not None:  # the step's rate, for the measured back-off
            self.spec.end_step(self.generation_tokens - generated)
        return outputs

    def _step_failed(self, seqs: list[Sequence], e: Exception) -> None:
        log.error("engine step failed", exc_info=e)
        msg = f"engine step failed: {type(e).__name__}: {e}"
        self.failed_steps_in_a_row += 1
        if self.fatal_error is None and is_sticky_device_error(e):
            self.fatal_error = f"sticky device error: {type(e).__name__}: {e}"
        if self.fatal_error is None and isinstance(e, RankFailure):  # a dead rank is a dead engine
            self.fatal_error = str(e)
        for seq in seqs:
            if seq.request_id in self._alive:
                self.abort_request(seq.request_id, reason="error", error=msg)

    def _finish_launched(self, launched: LaunchedStep) -> list[StepOutput]:
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

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the step's device work (forward, sampling, the copy of its results to the host); no sync."""
        lora = None
        if self._num_adapter_seqs and any(s.adapter is not None for s in batch.seqs):
            lora = self.adapters.build_lora_meta([s.adapter for s in batch.seqs], batch.num_scheduled_tokens)
        plp_rows, plp_targets = prompt_logprob_rows(batch) if self._num_plp_seqs else ([], [])
        spec_rows = self.spec.logits_rows(batch) if self.spec is not None else []  # verify rows' other positions
        fill = self._token_fill(batch)
        extra = {"fill": fill} if fill is not None else {}
        if plp_rows or spec_rows:
            logits, sampled_idx = self.runner.run(batch, lora, [r for r, _, _ in plp_rows] + spec_rows, **extra)
        else:
            logits, sampled_idx = self.runner.run(batch, lora, **extra)
        if self.spec is not None:  # a draft model's KV follows every target forward
            self.spec.after_forward(batch)
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
        n_sampled = len(sampled_idx)
        if plp_rows:
            add_prompt_logprobs(logits[n_sampled:n_sampled + len(plp_rows)], plp_rows, plp_targets)
        launched = LaunchedStep(batch, deferred)
        if spec_rows:  # the drafted sequences are verified, not sampled
            logits, sampled_idx = self.spec.verify(launched, logits, sampled_idx, n_sampled + len(plp_rows))
        elif plp_rows:
            logits = logits[:n_sampled]
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
        launched.seqs = seqs
        out = self._sample(launched, logits)
        # everything the host needs from the step in one device-to-host copy
        tok = launched.tokens = out.token_ids
        if out.logprobs is None:
            launched.host = self.runner.buffers.download(tok)
        else:
            parts = [tok.double(), out.logprobs.double()]
            if out.topk_ids is not None:
                parts += [out.topk_ids.double().flatten(), out.topk_logprobs.double().flatten()]
                launched.k = out.topk_ids.shape[1]
            launched.host = self.runner.buffers.download(torch.cat(parts))
        launched.event = self._new_event()
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

    def _sample(self, launched: LaunchedStep, logits: torch.Tensor) -> SamplerOutput:
        """Sample the launched step's sequences (a gather from the persistent sampling state) and note in `launched`
        what making its outputs needs."""
        seqs, state = launched.seqs, self.sampling_state
        rows = np.fromiter((s.sampling_row for s in seqs), dtype=np.int64, count=len(seqs))
        for i in np.nonzero(rows < 0)[0].tolist():
            rows[i] = state.join(seqs[i], self.eos_token_ids)
        sb, step_rows = state.batch(seqs, rows)
        out = self.sampler(logits, sb)
        state.after_sample(step_rows, out.token_ids)
        flags = step_rows.flags
        launched.nout = state.steps[rows]
        launched.max_out = state.max_out[rows]
        launched.min_tokens = state.min_tokens[rows]
        launched.ignore_eos = (flags & IGNORE_EOS) != 0
        launched.stop_ids = {i: state.stop_token_ids[rows[i]] for i in np.nonzero(flags & STOP_IDS)[0].tolist()}
        launched.lp_pos = np.nonzero(flags & LOGPROBS)[0]
        launched.needs_host_tokens = bool(np.bitwise_or.reduce(flags) & HOST_TOKENS)
        launched.processors = sb.processors
        return out

    def _new_event(self):
        """Marks the end of a step's device work (None on CPU, where the work is done when launch returns)."""
        if self.runner.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _finish_step(self, launched: LaunchedStep) -> list[StepOutput]:
        """Wait for a launched step, register the blocks it filled, make its outputs, end the sequences that stop."""
        if launched.deferred_register:
            bm = self.block_manager
            bs = bm.block_size
            for seq in launched.batch.seqs:
                if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * bs:
                    bm.register_full_blocks(seq)
        if not launched.seqs and launched.spec is None:
            return []
        if launched.event is not None:
            launched.event.synchronize()
        results, ending, generated = self.output_processor.process(launched) if launched.seqs else ([], [], 0)
        if launched.spec is not None:  # the verified sequences' runs
            more = self.spec.finish(launched.spec)
            results, ending, generated = results + more[0], ending + more[1], generated + more[2]
        self.generation_tokens += generated
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
                self.runner.copy_blocks([copy])
                if self.draft is not None:
                    self.draft.runner.copy_blocks([copy])
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            child.ever_scheduled = True
            self.scheduler.running.append(child)
            forked.append(child)
        return forked

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
            running_adapters=running, waiting_adapters=waiting, max_loras=max_loras, block_size=bm.block_size,
            lora=self.adapters.stats(),
            spec_decoding=self.spec.stats.copy() if self.spec is not None else SpecDecodingStats())
