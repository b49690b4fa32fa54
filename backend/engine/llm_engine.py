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

import torch

from loom.engine.block_manager import BlockManager
from loom.engine.config import EngineConfig
from loom.engine.faults import is_sticky_device_error
from loom.engine.logits_processors import build_constraints
from loom.engine.model_runner import ModelRunner
from loom.engine.outputs import EngineStats, StepOutput, TokenLogprob
from loom.engine.sampler import Sampler, SamplingBatch
from loom.engine.sampling_params import MAX_N, SamplingParams
from loom.engine.scheduler import ScheduledBatch, Scheduler
from loom.engine.sequence import Sequence, SequenceStatus
from loom.errors import RequestError
from loom.lora.adapter_registry import AdapterRegistry

log = logging.getLogger("loom")

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
        self.config = config
        model_dir = config.model
        if not model_dir:
            from loom.engine.default_model import resolve_default_model

            model_dir = resolve_default_model()
        self.model_dir = model_dir
        self.runner = ModelRunner(config, model_dir)
        self.tokenizer = None
        has_tokenizer = any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        if load_tokenizer and has_tokenizer:  # test models made without one take token ids only
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.adapters = AdapterRegistry(config, self.runner.model, self.runner.device, self.runner.dtype)
        self.runner.warm_up()  # with the LoRA pools attached: every kernel variant compiled, decode graphs captured
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   can_run=self._can_run, on_preempt=self._on_preempt)
        self.sampler = Sampler()
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
        self.last_step_request_ids: list[str] = []  # the serving layer fails these if step() itself raises
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
        cap_tokens = self.block_manager.num_blocks * self.config.block_size
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is (running, waiting, not forked yet) and release what it holds."""
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
        self.scheduler.finish(seq, reason)
        if seq.adapter is not None:
            self.adapters.deactivate(seq.adapter)
            self.adapters.release(seq.adapter)

    def _output(self, seq: Sequence, new_ids: list[int], logprobs, error: str | None = None,
                prompt_logprobs: list | None = None) -> StepOutput:
        return StepOutput(seq.request_id, new_ids, logprobs, seq.status == SequenceStatus.FINISHED, seq.finish_reason,
                          seq.num_prompt_tokens, seq.num_cached_tokens, seq.cumulative_logprob, error, seq.index,
                          prompt_logprobs)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self.last_step_request_ids = []
        batch = self.scheduler.schedule()
        self.last_step_request_ids = [s.request_id for s in batch.seqs]
        failed, self._adapter_failed = self._adapter_failed, []
        for seq in failed:
            self.abort_request(seq.request_id, reason="error", error=f"lora_name: {seq.adapter.error}")
        outputs, self._finished_outputs = self._finished_outputs, []
        if not batch.seqs:
            if self.adapters.has_pending_loads():
                self.adapters.wait_for_loads(0.05)  # nothing runnable until an adapter arrives: don't spin
            return outputs
        try:
            outputs += self._run(batch)
            self.failed_steps_in_a_row = 0
        except Exception as e:  # fail only this step's requests; the engine keeps serving
            log.exception("engine step failed")
            msg = f"engine step failed: {type(e).__name__}: {e}"
            self.failed_steps_in_a_row += 1
            if self.fatal_error is None and is_sticky_device_error(e):
                self.fatal_error = f"sticky device error: {type(e).__name__}: {e}"
            for seq in batch.seqs:
                if seq.request_id in self._alive:
                    self.abort_request(seq.request_id, reason="error", error=msg)
            outputs += self._finished_outputs
            self._finished_outputs = []
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[StepOutput]:
        lora = None
        if any(s.adapter is not None for s in batch.seqs):
            lora = self.adapters.build_lora_meta([s.adapter for s in batch.seqs], batch.num_scheduled_tokens)
        plp_rows, plp_targets = self._prompt_logprob_rows(batch)
        if plp_rows:
            logits, sampled_idx = self.runner.run(batch, lora, [r for r, _, _ in plp_rows])
        else:
            logits, sampled_idx = self.runner.run(batch, lora)
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
        if plp_rows:
            self._add_prompt_logprobs(logits[len(sampled_idx):], plp_rows, plp_targets)
            logits = logits[:len(sampled_idx)]
        if not sampled_idx:
            return []
        seqs = [batch.seqs[i] for i in sampled_idx]
        rows = list(range(len(seqs)))
        for i, seq in enumerate(list(seqs)):
            if seq.index == 0 and seq.num_output_tokens == 0 and seq.request_id in self._unforked:
                for child in self._fork(seq):  # they sample their first token from the parent's logits
                    seqs.append(child)
                    rows.append(i)
        if len(rows) > len(sampled_idx):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        sb = SamplingBatch.build(
            [s.params for s in seqs], [s.seed for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._stop_ids(s) for s in seqs], self.runner.vocab_size, logits.device,
            constraints=[s.constraints for s in seqs], matchers=[s.matcher for s in seqs])
        out = self.sampler(logits, sb)
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        top_ids = out.topk_ids.tolist() if out.topk_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
        refused = set(sb.processors.accept(tokens)) if sb.processors is not None else set()
        results = []
        for i, seq in enumerate(seqs):
            tok = tokens[i]
            seq.token_ids.append(tok)
            seq.cumulative_logprob += lps[i]
            self.generation_tokens += 1
            lp = None
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = list(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None else []
                lp = [TokenLogprob(tok, lps[i], top)]
            plp = None
            if seq.num_output_tokens == 1 and seq.index == 0 and seq.prompt_logprobs is not None:
                plp = seq.prompt_logprobs
            if i in refused:  # cannot happen while the mask is applied; never let a broken grammar run on
                self._finish(seq, "error")
                results.append(self._output(seq, [tok], lp, error="structured_outputs: the grammar refused "
                                                                  f"token {tok}", prompt_logprobs=plp))
                continue
            reason = self._check_stop(seq, tok)
            if reason is not None:
                self._finish(seq, reason)
            results.append(self._output(seq, [tok], lp, prompt_logprobs=plp))
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

    def _check_stop(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            return "length"
        return None

    # ---- counters --------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for seqs, counts in ((self.scheduler.running, running), (self.scheduler.waiting, waiting)):
            for s in seqs:
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
