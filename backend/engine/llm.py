"""Offline Python API: `LLM(...).generate(prompts, params)` and a streaming iterator, over LLMEngine.

For tests, benchmarks and users who embed the engine without Triton.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator
from typing import Sequence as Seq

from loom.engine.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import TokenLogprob
from loom.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # with logprobs (or params.cumulative_logprob); else None, as vLLM
    num_cached_tokens: int = 0
    error: str | None = None
    # what the latest streaming update added
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    index: int = 0  # which of the request's n completions
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs (entry j: prompt token j)
    # generate() with n > 1: the n completions, by index (this object's own fields are completion 0's)
    samples: list["RequestOutput"] = field(default_factory=list)


class LLM:
    def __init__(self, model: str = "", **config_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def stream(self, prompts: Seq[str | list[int]] | str, params: SamplingParams | Seq[SamplingParams] | None = None,
               lora_names: Seq[str | None] | str | None = None) -> Iterator[RequestOutput]:
        """Yields a RequestOutput per completion per step with new tokens (delta_* set; text/token_ids cumulative);
        a request with n > 1 yields its completions' outputs with `index` 0..n-1."""
        from loom.engine.detokenizer import IncrementalDetokenizer

        if isinstance(prompts, str):
            prompts = [prompts]
        n = len(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        loras = list(lora_names) if isinstance(lora_names, (list, tuple)) else [lora_names] * n
        if len(params_list) != n or len(loras) != n:
            raise ValueError("params and lora_names must be given once or once per prompt")
        live: dict[tuple[str, int], tuple[RequestOutput, object]] = {}
        try:
            # inside the try: a prompt refused here (RequestError) ends the ones added before it, not left running
            for prompt, p, lora in zip(prompts, params_list, loras):
                rid = f"offline-{next(self._ids)}"
                ids = self._encode(prompt)
                self.engine.add_request(rid, ids, p, lora)
                for i in range(p.n):
                    detok = IncrementalDetokenizer(self.tokenizer, ids, p) if self.tokenizer is not None else None
                    live[(rid, i)] = (RequestOutput(rid, ids, logprobs=[] if p.logprobs is not None else None,
                                                    index=i), detok)
            while live:
                for so in self.engine.step():
                    key = (so.request_id, so.index)
                    if key not in live:
                        continue
                    out, detok = live[key]
                    if so.prompt_logprobs is not None:
                        out.prompt_logprobs = so.prompt_logprobs
                    out.delta_token_ids = so.new_token_ids
                    out.token_ids.extend(so.new_token_ids)
                    if so.new_logprobs and out.logprobs is not None:
                        out.logprobs.extend(so.new_logprobs)
                    out.cumulative_logprob, out.num_cached_tokens = so.cumulative_logprob, so.num_cached_tokens
                    out.finished, out.finish_reason, out.error = so.finished, so.finish_reason, so.error
                    out.delta_text = ""
                    if detok is not None:
                        u = detok.update(so.new_token_ids, so.finished, so.finish_reason)
                        out.delta_text = u.text
                        out.text += u.text
                        out.finished, out.finish_reason = u.finished, u.finish_reason
                        if u.abort_engine:
                            self.engine.abort_request(so.request_id, index=so.index)
                    if out.finished:
                        del live[key]
                    yield out
        finally:
            for rid, i in live:  # the caller stopped iterating early, or a prompt was refused
                self.engine.abort_request(rid, index=i)
            if live:
                self.engine.step()

    def generate(self, prompts: Seq[str | list[int]] | str, params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_names: Seq[str | None] | str | None = None) -> list[RequestOutput]:
        finals: dict[str, dict[int, RequestOutput]] = {}
        for out in self.stream(prompts, params, lora_names):
            if out.finished:
                finals.setdefault(out.request_id, {})[out.index] = out
        result = []
        for rid in sorted(finals, key=lambda r: int(r.rsplit("-", 1)[1])):
            by_index = finals[rid]
            first = by_index[0]
            if len(by_index) > 1:
                first.samples = [by_index[i] for i in sorted(by_index)]
            result.append(first)
        return result
