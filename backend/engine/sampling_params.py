"""Per-request sampling parameters, validated at construction so bad input never reaches a step."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from loom.engine.sample.structured_output import StructuredOutputsParams
from loom.errors import RequestError

# Bounds a production server wants to enforce; the Triton glue may tighten them from config.pbtxt.
MAX_LOGPROBS = 20
MAX_STOP_ITEMS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 64  # completions per request (vLLM allows more; each one is a running sequence here)
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
MAX_BAD_WORDS = 128  # entries in bad_words (vLLM's VLLM_MAX_NUM_BAD_WORDS)
LOGIT_BIAS_BOUND = 100.0  # biases are clamped to [-100, 100], as vLLM does


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
    # vLLM's other SamplingParams, with vLLM's meaning:
    n: int = 1  # completions for the prompt; they share its KV blocks (seed: completion i uses seed + i)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these ids can be sampled
    bad_words: list[str] = field(default_factory=list)  # the last token of each word's tokens is banned
    # when the tokens before it were just generated (the word tokenized with and without a leading space)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens (-1: the engine's limit)
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-n (first token: None)
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / regex / choice / grammar
    # Not a vLLM parameter: report the cumulative logprob without asking for `logprobs` (Triton's
    # return_cumulative_logprob sets it). Without either, no logprob is computed and it is reported as None.
    cumulative_logprob: bool = False
    # Not a vLLM parameter: false opts this request out of speculative decoding (EngineConfig.speculative_config)
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _clamped_bias(self.logit_bias)
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

        check(is_int(self.max_tokens) and self.max_tokens >= 1,
              "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
              "temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        check(is_int(self.top_k) and self.top_k >= 0,
              "top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
              "top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
              "min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        check(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
              f"must be a number in (0, 10], got {self.repetition_penalty!r}")
        check(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"must be a number in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"must be a number in [-2, 2], got {self.frequency_penalty!r}")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
              "seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        check(isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_ITEMS
              and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
              "stop", f"must be a list of at most {MAX_STOP_ITEMS} non-empty strings "
                      f"of at most {MAX_STOP_STRING_CHARS} characters")
        check(isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_ITEMS
              and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", f"must be a list of at most {MAX_STOP_ITEMS} non-negative token ids")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        check(isinstance(self.cumulative_logprob, bool), "cumulative_logprob", "must be true or false")
        check(isinstance(self.speculative, bool), "speculative", "must be true or false")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= max_logprobs), "logprobs",
              f"must be an integer in [0, {max_logprobs}], got {self.logprobs!r}")
        check(self.prompt_logprobs is None
              or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= max_logprobs),
              "prompt_logprobs", f"must be an integer in [0, {max_logprobs}], got {self.prompt_logprobs!r}")
        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        check(self.n == 1 or self.temperature >= 1e-5, "n",
              f"must be 1 when using greedy sampling (temperature 0), got {self.n!r}")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS),
              "logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to numbers")
        check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                 and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)),
              "allowed_token_ids", "must be a non-empty list of non-negative token ids")
        check(isinstance(self.bad_words, list) and len(self.bad_words) <= MAX_BAD_WORDS
              and all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_STRING_CHARS for w in self.bad_words),
              "bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                           f"{MAX_STOP_STRING_CHARS} characters")
        check(self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens)
                                                      and (self.truncate_prompt_tokens == -1
                                                           or self.truncate_prompt_tokens >= 1)),
              "truncate_prompt_tokens", f"must be -1 or an integer >= 1, got {self.truncate_prompt_tokens!r}")
        check(isinstance(self.spaces_between_special_tokens, bool), "spaces_between_special_tokens",
              "must be true or false")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _clamped_bias(bias: dict) -> dict[int, float]:
    """vLLM's conversion: keys to int token ids, values clamped to [-100, 100]; anything else is refused."""
    out: dict[int, float] = {}
    for k, v in bias.items():
        if isinstance(k, int) and not isinstance(k, bool):
            tid = k
        elif isinstance(k, str) and k.strip().isdigit():
            tid = int(k)
        else:
            tid = -1
        if tid < 0:
            raise SamplingParamsError("logit_bias", f"keys must be token ids (integers >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SamplingParamsError("logit_bias", f"values must be finite numbers, got {v!r} for token {k!r}")
        out[tid] = min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, float(v)))
    return out
