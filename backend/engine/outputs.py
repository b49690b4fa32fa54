"""What the engine hands back each step, and its counters."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    cumulative_logprob: float
    error: str | None = None  # set with finish_reason "error"


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    num_preemptions: int = 0
    resident_adapters: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
