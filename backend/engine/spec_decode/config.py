"""SpeculativeConfig: vLLM's names (method, num_speculative_tokens, prompt_lookup_min / _max, model,
disable_by_batch_size) and loom's backoff, validated at construction with errors naming the field."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

from loom.errors import ConfigError


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model" (a small model with the target's tokenizer)
    num_speculative_tokens: int = 4  # k: tokens proposed, and verified in one target forward, per sequence
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up in the request's prompt and output
    prompt_lookup_min: int = 2  # shortest one tried (n from max down to min; the first n that matches wins)
    model: str = ""  # the draft model of method draft_model
    # No speculation in a step whose decode rows exceed this (0: no such cap).
    disable_by_batch_size: int = 0
    # Not vLLM's: "measured" speculates in a step only where speculative steps of its batch size have been measured
    # to generate tokens faster than plain ones (loom.engine.spec_decode.backoff); "off" speculates in every step the
    # cap allows.
    backoff: str = "measured"
    # Not vLLM's: folders of the draft model's own PEFT adapters. A request with adapter `name` runs the draft with
    # `<root>/<name>` (its "twin") where one exists, else without an adapter (loom.engine.spec_decode.draft_adapters).
    draft_adapter_roots: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"speculative_config.{name}", msg)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        check(self.method in ("ngram", "draft_model"), "method", f"must be ngram or draft_model, got {self.method!r}")
        check(isinstance(self.model, str), "model", f"must be a path (a string), got {type(self.model).__name__}")
        if self.method == "draft_model":
            check(bool(self.model), "model", "is required with method draft_model: the draft model's directory (a "
                                             "smaller model with the target's tokenizer)")
        else:
            check(not self.model, "model", "is only for method draft_model; leave it empty for ngram")
        check(is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
              "num_speculative_tokens", f"must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        check(is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, "prompt_lookup_min",
              f"must be an integer >= 1, got {self.prompt_lookup_min!r}")
        check(is_int(self.prompt_lookup_max) and self.prompt_lookup_min <= self.prompt_lookup_max <= 64,
              "prompt_lookup_max", f"must be an integer in [prompt_lookup_min={self.prompt_lookup_min}, 64], "
                                   f"got {self.prompt_lookup_max!r}")
        roots = self.draft_adapter_roots
        check(isinstance(roots, list) and all(isinstance(r, str) and r for r in roots), "draft_adapter_roots",
              f"must be a list of directory paths, got {roots!r}")
        for r in roots:
            check(os.path.isdir(r), "draft_adapter_roots", f"{r!r} is not an existing directory")
        check(not roots or self.method == "draft_model", "draft_adapter_roots",
              "is only for method draft_model (the draft model's adapters); leave it empty for ngram")
        check(self.backoff in ("measured", "off"), "backoff", f"must be measured or off, got {self.backoff!r}")
        check(is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 0, "disable_by_batch_size",
              f"must be an integer >= 0 (0 = never), got {self.disable_by_batch_size!r}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig from itself, a dict (the offline API's keyword, as vLLM takes it), a JSON object string
        (config.pbtxt) or None / "" (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError("speculative_config", f"must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config", f"must be an object such as {{\"method\": \"ngram\", "
                              f"\"num_speculative_tokens\": 4}}, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                raise ConfigError(f"speculative_config.{key}", f"unknown key; known: {', '.join(known)}")
        return cls(**value)
