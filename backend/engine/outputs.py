"""What the engine hands back each step, and its counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from loom.lora.lora_stats import LoraStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # exact rank of token_id (1 = most likely) where computed (prompt logprobs)


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    cumulative_logprob: float | None  # None unless logprobs or a cumulative logprob were asked for
    error: str | None = None  # set with finish_reason "error"
    index: int = 0  # which of the request's n completions
    # prompt logprobs (params.prompt_logprobs), once, with the request's first token: entry j is prompt token j
    # (None for the first token, which has no context)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with the first token: (first scheduled, first token on the host), time.monotonic() (the TTFT waterfall)
    timing: tuple[float | None, float] | None = None


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters since start (vLLM's vllm:spec_decode_* families)."""
    num_drafts: int = 0  # sequences verified (one draft = a sequence's proposals in a step)
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the target accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts whose token j was accepted

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


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
    # LoRA adapters of running / waiting sequences, {name: count} (the gateway's vllm:lora_requests_info)
    running_adapters: dict[str, int] = field(default_factory=dict)
    waiting_adapters: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0  # adapters of the largest allowed rank that fit the device pool at once
    block_size: int = 0
    lora: LoraStats = field(default_factory=LoraStats)  # the adapters' tiers, evictions and load latencies
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # speculative decoding counters

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
