"""Per-request sampling parameters, validated at construction so bad input never reaches a step."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from loom.errors import RequestError

# Bounds a production server wants to enforce; the Triton glue may tighten them from config.pbtxt.
MAX_LOGPROBS = 20
MAX_STOP_ITEMS = 16
MAX_STOP_STRING_CHARS = 256


class SamplingParamsError(RequestError):
    """A sampling parameter is invalid; the message names the field and what is allowed."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: sampled token plus top n
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(name, msg)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        check(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
              f"must be a number in (0, 10], got {self.repetition_penalty!r}")
        check(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"must be a number in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"must be a number in [-2, 2], got {self.frequency_penalty!r}")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        check(isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_ITEMS
              and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
              "stop", f"must be a list of at most {MAX_STOP_ITEMS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        check(isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_ITEMS
              and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", f"must be a list of at most {MAX_STOP_ITEMS} non-negative token ids")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= max_logprobs), "logprobs",
              f"must be an integer in [0, {max_logprobs}], got {self.logprobs!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
