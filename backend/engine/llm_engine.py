"""The engine: requests in, one step at a time (schedule -> run -> sample -> outputs), token ids out.

Single-threaded by design: the serving layer calls it from one loop thread.
"""
from __future__ import annotations

import json
import logging
import os
import random

from loom.engine.block_manager import BlockManager
from loom.engine.config import EngineConfig
from loom.engine.model_runner import ModelRunner
from loom.engine.outputs import EngineStats, StepOutput, TokenLogprob
from loom.engine.sampler import Sampler, SamplingBatch
from loom.engine.sampling_params import SamplingParams
from loom.engine.scheduler import ScheduledBatch, Scheduler
from loom.engine.sequence import Sequence, SequenceStatus
from loom.errors import RequestError
from loom.lora.adapter_registry import AdapterRegistry

log = logging.getLogger("loom")


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
        self.runner.forward.warm_up(config.block_size)  # compiles a compiled CPU forward now (pools attached)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   can_run=self._can_run, on_preempt=self._on_preempt)
        self.sampler = Sampler()
        self.requests: dict[str, Sequence] = {}
        self._finished_outputs: list[StepOutput] = []  # aborts and refusals reported at the next step
        self._adapter_failed: list[Sequence] = []
        self._rng = random.Random(config.seed)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_step_request_ids: list[str] = []  # the serving layer fails these if step() itself raises

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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if request_id in self.requests:
            raise RequestError("request_id", f"{request_id!r} is already in flight")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("prompt", "is empty")
        limit = self.config.max_prompt_tokens or self.max_model_len - 1
        if n > limit:
            raise RequestError("prompt", f"has {n} tokens; the limit is {limit}")
        vocab = self.runner.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        cap_tokens = self.block_manager.num_blocks * self.config.block_size
        if n + 1 > cap_tokens:
            raise RequestError("prompt", f"has {n} tokens but the whole KV cache holds {cap_tokens}; raise kv_cache_memory_bytes")
        # A request must be able to finish alone, or preemption could cycle forever.
        max_total = min(n + params.max_tokens, self.max_model_len, cap_tokens)
        ref = None
        if lora_name:
            ref = self.adapters.acquire(lora_name)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, adapter=ref, max_total_tokens=max_total)
        self.requests[request_id] = seq
        self.prompt_tokens += n
        self.scheduler.add(seq)

    def abort_request(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self._finish(seq, reason)
        self._finished_outputs.append(self._output(seq, [], None, error=error))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if seq.adapter is not None:
            self.adapters.deactivate(seq.adapter)
            self.adapters.release(seq.adapter)

    def _output(self, seq: Sequence, new_ids: list[int], logprobs, error: str | None = None) -> StepOutput:
        return StepOutput(seq.request_id, new_ids, logprobs, seq.status == SequenceStatus.FINISHED, seq.finish_reason,
                          seq.num_prompt_tokens, seq.num_cached_tokens, seq.cumulative_logprob, error)

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
        except Exception as e:  # fail only this step's requests; the engine keeps serving
            log.exception("engine step failed")
            msg = f"engine step failed: {type(e).__name__}: {e}"
            for seq in batch.seqs:
                if self.requests.pop(seq.request_id, None) is not None:
                    self._finish(seq, "error")
                    outputs.append(self._output(seq, [], None, error=msg))
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[StepOutput]:
        lora = None
        if any(s.adapter is not None for s in batch.seqs):
            lora = self.adapters.build_lora_meta([s.adapter for s in batch.seqs], batch.num_scheduled_tokens)
        logits, sampled_idx = self.runner.run(batch, lora)
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
        if not sampled_idx:
            return []
        seqs = [batch.seqs[i] for i in sampled_idx]
        sb = SamplingBatch.build(
            [s.params for s in seqs], [s.seed for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._stop_ids(s) for s in seqs], self.runner.vocab_size, logits.device)
        out = self.sampler(logits, sb)
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        top_ids = out.topk_ids.tolist() if out.topk_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
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
            reason = self._check_stop(seq, tok)
            if reason is not None:
                self.requests.pop(seq.request_id, None)
                self._finish(seq, reason)
            results.append(self._output(seq, [tok], lp))
        return results

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
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens, prefix_query_tokens=self.scheduler.prefix_query_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            resident_adapters=self.adapters.num_resident(),
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens)
