"""Offline Python API: `LLM(...).generate(prompts, sampling_params)` and a streaming iterator, over LLMEngine.

For tests, benchmarks and users who embed the engine without Triton. Shaped like vLLM's offline API so code moves
across: `from loom import LLM, SamplingParams`, `llm.generate(prompts, sampling_params)` with prompts as a string,
token ids, `{"prompt": ...}` / `{"prompt_token_ids": ...}` or a list of those, and `out.outputs[i].text`.
One difference: logprobs are lists of `TokenLogprob` (token id, logprob, top), not vLLM's {token id: Logprob} dicts.
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

# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = str | list[int] | dict
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass
class CompletionOutput:
    """One completion of a request, as vLLM's CompletionOutput (`RequestOutput.outputs[i]`)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # None while the completion runs
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None: EOS, length)

    def finished(self) -> bool:
        return self.finish_reason is not None


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
    prompt: str | None = None  # the prompt when given as text
    stop_reason: int | str | None = None  # as CompletionOutput.stop_reason

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one CompletionOutput per completion, by index. Built on each access from this object (and
        `samples` for n > 1), so it cannot drift from them; token_ids and logprobs are the same lists."""
        return [CompletionOutput(s.index, s.text, s.token_ids, s.cumulative_logprob, s.logprobs, s.finish_reason,
                                 s.stop_reason) for s in (self.samples or [self])]


def _stop_reason(detok, params: SamplingParams, token_ids: list[int], eos_ids: set[int]) -> int | str | None:
    """What vLLM reports as stop_reason for a completion that finished with "stop": the matched stop string, or the
    stop_token_ids entry it ended on; None for EOS (which vLLM checks first unless ignore_eos)."""
    if detok is not None and detok.stop_reason is not None:
        return detok.stop_reason
    last = token_ids[-1] if token_ids else None
    if last in params.stop_token_ids and (params.ignore_eos or last not in eos_ids):
        return last
    return None


class LLM:
    def __init__(self, model: str = "", **config_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids)."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
            if unknown or not any(k in prompt for k in _PROMPT_KEYS):
                raise ValueError(f"prompts: a dict prompt takes {' or '.join(_PROMPT_KEYS)}; got keys {sorted(prompt)}")
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                return text, list(prompt["prompt_token_ids"])
            prompt = text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: this engine has no tokenizer: pass token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompts: a prompt is a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def stream(self, prompts: Seq[Prompt] | Prompt, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
               lora_names: Seq[str | None] | str | None = None) -> Iterator[RequestOutput]:
        """Yields a RequestOutput per completion per step with new tokens (delta_* set; text/token_ids cumulative);
        a request with n > 1 yields its completions' outputs with `index` 0..n-1."""
        from loom.engine.detokenizer import IncrementalDetokenizer

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        n = len(prompts)
        sp = sampling_params
        params_list = list(sp) if isinstance(sp, (list, tuple)) else [sp or SamplingParams()] * n
        loras = list(lora_names) if isinstance(lora_names, (list, tuple)) else [lora_names] * n
        if len(params_list) != n or len(loras) != n:
            raise ValueError("sampling_params and lora_names must be given once or once per prompt")
        live: dict[tuple[str, int], tuple[RequestOutput, object, SamplingParams]] = {}
        try:
            # inside the try: a prompt refused here (RequestError) ends the ones added before it, not left running
            for prompt, p, lora in zip(prompts, params_list, loras):
                rid = f"offline-{next(self._ids)}"
                text, ids = self._encode(prompt)
                self.engine.add_request(rid, ids, p, lora)
                for i in range(p.n):
                    detok = IncrementalDetokenizer(self.tokenizer, ids, p) if self.tokenizer is not None else None
                    out = RequestOutput(rid, ids, logprobs=[] if p.logprobs is not None else None, index=i, prompt=text)
                    live[(rid, i)] = (out, detok, p)
            while live:
                for so in self.engine.step():
                    key = (so.request_id, so.index)
                    if key not in live:
                        continue
                    out, detok, p = live[key]
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
                        if out.finish_reason == "stop":
                            out.stop_reason = _stop_reason(detok, p, out.token_ids, self.engine.eos_token_ids)
                        del live[key]
                    yield out
        finally:
            for rid, i in live:  # the caller stopped iterating early, or a prompt was refused
                self.engine.abort_request(rid, index=i)
            if live:
                self.engine.step()

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel workers); the LLM serves nothing after."""
        self.engine.close()

    def generate(self, prompts: Seq[Prompt] | Prompt,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_names: Seq[str | None] | str | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order (vLLM's `generate`)."""
        finals: dict[str, dict[int, RequestOutput]] = {}
        for out in self.stream(prompts, sampling_params, lora_names):
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
