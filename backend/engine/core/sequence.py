"""Per-request state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from loom.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    adapter: Any = None  # AdapterRef from the adapter registry, or None (the base model)
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    # Names this block table's contents for the model runner, which keeps the step's tables written from step to
    # step: the block manager gives a new number whenever entries are set or replaced rather than appended
    # (0: none yet, the runner writes the whole row).
    table_epoch: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    ever_scheduled: bool = False
    max_total_tokens: int = 1 << 62  # prompt + output cap (max_model_len, KV capacity)
    index: int = 0  # which of the request's n completions (n > 1: all share the prompt's KV blocks)
    constraints: Any = None  # loom.engine.sample.logits_processors.RequestConstraints (shared by the n completions)
    matcher: Any = None  # this sequence's grammar matcher (structured outputs)
    prompt_logprobs: list | None = None  # entries computed so far (params.prompt_logprobs)
    sampling_row: int = -1  # its row in the engine's SamplingState once it sampled (-1: none)
    # async scheduling: (step in flight, its row there, position in token_ids) of the token that step is sampling
    pending: Any = None
    # speculative decoding: the last num_draft_tokens of token_ids are proposals being verified this step (only
    # between the scheduler drafting them and the step's verification; loom.engine.spec_decode)
    num_draft_tokens: int = 0
    # ... and its own back-off: after a verification that accepted none of its proposals (or a search that found no
    # n-gram) it proposes again only once it has this many output tokens (2, 4, ..., 32 more after each such miss
    # in a row; an accepted proposal resets it)
    spec_quiet_until: int = 0
    spec_misses: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first scheduled (TTFT waterfall)
    num_prompt_tokens: int = field(init=False)  # the prompt never changes: a plain attribute (read every step)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def wants_logprob(self) -> bool:
        """Whether the sampled tokens' logprobs are computed (logprobs, or a cumulative logprob asked for)."""
        return self.params.logprobs is not None or self.params.cumulative_logprob

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs asked for and not all computed (only the first of n completions computes them)."""
        return (self.index == 0 and self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs or ()) < self.num_prompt_tokens)

    @property
    def adapter_version(self) -> int:
        """Distinguishes prefix-cache entries computed with different adapter weights (0 = base model)."""
        return self.adapter.version if self.adapter is not None else 0
