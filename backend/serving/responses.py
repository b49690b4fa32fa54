"""vllm_backend's response outputs, built from a request's deltas as plain numpy arrays (backend/model.py wraps
them into Triton tensors): one element per completion (n) for text_output, finish_reason, cumulative_logprob,
logprobs and num_output_tokens; output_ids and num_input_tokens; prompt_logprobs once, with the first token.
Logprobs are vLLM's JSON: per token {token_id: {logprob, rank, decoded_token}}."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import numpy as np

from loom.serving.async_engine import RequestDelta
from loom.serving.request_parser import ParsedRequest


@dataclass
class ResponseState:
    """What one request's responses need across deltas (touched by its sender thread only)."""
    parsed: ParsedRequest
    prompt_ids: list[int]
    reasons: dict = field(default_factory=dict)  # completion index -> its finish reason once it ended
    cumulative: dict = field(default_factory=dict)  # completion index -> latest cumulative logprob
    # the TTFT waterfall (time.monotonic()): request id, arrival in execute(), inputs read and parsed, tokenized,
    # submitted; the rest comes with the first delta
    request_id: str = ""
    t_arrival: float = 0.0
    t_parsed: float = 0.0
    t_tokenized: float = 0.0
    t_submitted: float = 0.0
    timing_logged: bool = False


class ResponseBuilder:
    """Builds the outputs of a response; decodes tokens with its own tokenizer copy (fast tokenizers are not
    safe to share across threads), single tokens cached."""

    def __init__(self, tokenizer):
        self._decoder = tokenizer
        self._token_cache: dict[int, str] = {}
        self._lock = threading.Lock()  # sender threads share this builder

    def outputs(self, state: ResponseState, ds: list[RequestDelta]) -> list[tuple[str, np.ndarray]]:
        """(output name, array) for the deltas since the last response (the whole text when not streaming)."""
        p = state.parsed
        n = p.params.n
        by_index = {d.index: d for d in ds}
        deltas = [by_index.get(i) for i in range(n)]
        for i, d in enumerate(deltas):
            if d is not None:
                state.cumulative[i] = d.cumulative_logprob
                if d.finish_reason is not None:
                    state.reasons[i] = d.finish_reason
        prefix = ""
        if not p.exclude_input_in_output:  # only non-streamed requests get here (vllm_backend semantics)
            prefix = p.prompt if p.prompt is not None else self._decode(state.prompt_ids)
        texts = [(prefix + (d.text if d is not None else "")).encode("utf-8") for d in deltas]
        out = [("text_output", np.array(texts, dtype=np.object_))]
        if p.ids_mode:  # n == 1 here
            ids = deltas[0].token_ids if deltas[0] is not None else []
            if not p.exclude_input_in_output:
                ids = state.prompt_ids + ids
            out.append(("output_ids", np.array(ids, dtype=np.int32)))
        r = p.returns
        if r.finish_reason:
            reasons = [str(state.reasons.get(i)).encode() for i in range(n)]
            out.append(("finish_reason", np.array(reasons, dtype=np.object_)))
        if r.cumulative_logprob:
            cum = [state.cumulative.get(i, 0.0) for i in range(n)]
            out.append(("cumulative_logprob", np.array(cum, dtype=np.float32)))
        if r.logprobs:
            empty = [] if p.params.logprobs is not None else None
            lps = [self.logprobs_json(d.logprobs if d is not None else empty).encode() for d in deltas]
            out.append(("logprobs", np.array(lps, dtype=np.object_)))
        if r.num_input_tokens:
            num_in = next((d.num_prompt_tokens for d in ds), 0)
            out.append(("num_input_tokens", np.array([num_in], dtype=np.uint32)))
        if r.num_output_tokens:
            counts = [len(d.token_ids) if d is not None else 0 for d in deltas]
            out.append(("num_output_tokens", np.array(counts, dtype=np.uint32)))
        plp = next((d.prompt_logprobs for d in ds if d.prompt_logprobs is not None), None)
        if plp is not None:  # asked for with prompt_logprobs; sent once, with the first token
            out.append(("prompt_logprobs", np.array([self.prompt_logprobs_json(plp).encode()], dtype=np.object_)))
        return out

    def logprobs_json(self, logprobs) -> str:
        """One {token_id: {logprob, rank, decoded_token}} per generated token: the sampled token and the top-n."""
        if logprobs is None:
            return "null"
        items = []
        for tl in logprobs:
            entry = {str(tid): self._entry(tid, lp, rank) for rank, (tid, lp) in enumerate(tl.top, start=1)}
            if str(tl.token_id) not in entry:  # sampled token outside the top-n: rank is a lower bound
                rank = 1 + sum(1 for _, lp in tl.top if lp > tl.logprob)
                entry = {str(tl.token_id): self._entry(tl.token_id, tl.logprob, rank), **entry}
            items.append(entry)
        return json.dumps(items)

    def prompt_logprobs_json(self, entries) -> str:
        """vLLM's prompt_logprobs: per prompt token null (the first) or {token_id: {logprob, rank,
        decoded_token}} with the prompt token (its exact rank) and the top-n."""
        items = []
        for tl in entries:
            if tl is None:
                items.append(None)
                continue
            entry = {str(tl.token_id): self._entry(tl.token_id, tl.logprob, tl.rank)}
            for rank, (tid, lp) in enumerate(tl.top, start=1):
                entry.setdefault(str(tid), self._entry(tid, lp, rank))
            items.append(entry)
        return json.dumps(items)

    def _entry(self, tid: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(tid)}

    def _token_text(self, tid: int) -> str:
        s = self._token_cache.get(tid)
        if s is None:
            s = self._token_cache[tid] = self._decode([tid])
        return s

    def _decode(self, ids: list[int]) -> str:
        with self._lock:
            return self._decoder.decode(ids)
