"""What the serving layer hands out per request (deltas, timings) and what it keeps per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from loom.engine.outputs import EngineStats, TokenLogprob
from loom.engine.sampling_params import SamplingParams


@dataclass
class RequestDelta:
    """What one completion of a request produced since the last delta (or, merged, since the last send)."""
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False  # the whole request is finished (every completion)
    finish_reason: str | None = None  # this completion's, once it ended: stop | length | abort
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # total so far (the delta's own count is len(token_ids))
    cumulative_logprob: float | None = 0.0  # None when neither logprobs nor a cumulative logprob were asked for
    error: str | None = None  # "field: message" when the request failed
    error_kind: str | None = None  # invalid | unavailable | cancelled | timeout | internal
    index: int = 0  # which of the request's n completions
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the request's first token
    # with the request's first token: time.monotonic() of "first_scheduled", "first_token" (on the host),
    # "emitted" (detokenized and handed to on_output); the TTFT waterfall
    timing: dict | None = None

    def merge(self, later: "RequestDelta") -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.timing is not None:
            self.timing = later.timing
        if later.finish_reason is not None or self.finish_reason is None:
            self.finish_reason = later.finish_reason
        for name in ("finished", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens",
                     "cumulative_logprob", "error", "error_kind"):
            setattr(self, name, getattr(later, name))


@dataclass
class RequestTiming:
    """Handed to the observer when a request ends (metrics)."""
    request_id: str
    arrival: float
    first_token: float | None
    finished: float
    num_prompt_tokens: int
    num_output_tokens: int  # over all n completions
    finish_reason: str | None
    error_kind: str | None
    n: int = 1


class Observer(Protocol):
    def on_step(self, stats: EngineStats, prompt_tokens: int, generation_tokens: int,
                inter_token_latencies: list[float] = ...) -> None: ...
    def on_request_finished(self, timing: RequestTiming) -> None: ...


@dataclass(eq=False)
class ServingRequest:
    """One submitted request. The loop thread reads the first fields; the output worker owns the rest."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None
    on_output: Callable[[RequestDelta], None]
    is_cancelled: Callable[[], bool] | None
    deadline: float | None
    timeout_s: float | None
    arrival: float
    # output worker only:
    detoks: list = field(default_factory=list)  # one incremental detokenizer per completion
    first_token: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output: list[int] = field(default_factory=list)  # per completion
    cumulative: list = field(default_factory=list)  # per completion (None: not computed)
    last_token: list[float | None] = field(default_factory=list)  # per completion: when its latest token came
    done: dict[int, str | None] = field(default_factory=dict)  # finished completions -> finish reason
    closed: bool = False  # its final delta went out
