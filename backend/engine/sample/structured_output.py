"""Structured outputs (vLLM's `structured_outputs`, formerly `guided_decoding`) with the xgrammar engine.

A request names one constraint: a JSON schema (`json`), any JSON object (`json_object`), a regular expression
(`regex`), one of several strings (`choice`) or an EBNF grammar (`grammar`, xgrammar's dialect; a Lark grammar
is tried when the text is not valid EBNF). :class:`GrammarCompiler` turns it into an xgrammar
``CompiledGrammar`` once (cached by the constraint's text; thread-safe, so the serving layer can compile in
Triton's execute thread and the engine loop then finds it cached); each sequence gets its own
``GrammarMatcher`` that follows the tokens it accepts. The sampler applies all matchers' masks in one batched
call (:mod:`loom.engine.sample.logits_processors`).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

from loom.errors import RequestError

FIELD = "structured_outputs"
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SPEC_CHARS = 1 << 16
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json / regex / choice / grammar / json_object."""
    json: Any = None  # a JSON schema: dict, or its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise RequestError(FIELD, f"must set exactly one of {', '.join(_KINDS[:5])}; got {given or 'none'}")
        if self.structural_tag is not None:
            raise RequestError(FIELD, "structural_tag is not supported; use json, regex, choice, grammar or "
                                      "json_object")
        if self.whitespace_pattern is not None:
            raise RequestError(FIELD, "whitespace_pattern is not supported by the xgrammar engine; use "
                                      "disable_any_whitespace")
        if self.json_object is not None and self.json_object is not True:
            raise RequestError(FIELD, "json_object must be true when given")
        if self.choice is not None:
            if (not isinstance(self.choice, tuple) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError(FIELD, f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise RequestError(FIELD, f"{k} must be a non-empty string")
        for k in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, k), bool):
                raise RequestError(FIELD, f"{k} must be true or false")
        if len(self.key()) > MAX_SPEC_CHARS:
            raise RequestError(FIELD, f"the constraint is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    def schema_text(self) -> str:
        """The JSON schema as canonical text (with additionalProperties: false on objects if asked)."""
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(FIELD, f"json is not a valid JSON schema text ({e.msg})") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(FIELD, "json must be a JSON schema (an object)")
        if self.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return json.dumps(schema, sort_keys=True)

    def key(self) -> str:
        """Cache key: everything that changes the compiled grammar."""
        body = self.schema_text() if self.json is not None else getattr(self, self.kind)
        if self.choice is not None:
            body = json.dumps(list(self.choice))
        return f"{self.kind}|{int(self.disable_any_whitespace)}|{body}"

    @classmethod
    def parse(cls, value: Any, name: str = FIELD) -> "StructuredOutputsParams":
        """From what a client sends: a JSON object, or its text (vllm_backend passes a JSON string). Null fields
        and `backend` (old `guided_decoding`: the engine is always xgrammar here) are ignored."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise RequestError(name, f"is not valid JSON ({e.msg} at position {e.pos})") from None
        if not isinstance(value, dict):
            raise RequestError(name, 'must be a JSON object such as {"json": {...}}, {"regex": "..."}, '
                                     '{"choice": [...]} or {"grammar": "..."}')
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in value.items():
            if v is None or k == "backend":
                continue
            if k not in known:
                raise RequestError(name, f"unknown key {k!r}; allowed: {', '.join(sorted(known))}")
            kw[k] = tuple(v) if k == "choice" and isinstance(v, list) else v
        try:
            return cls(**kw)
        except RequestError as e:
            if name == FIELD:
                raise
            raise RequestError(name, str(e).split(": ", 1)[1]) from None


def _no_additional_properties(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for "one of these strings" (vLLM builds the same for xgrammar)."""
    return "root ::= " + " | ".join('"' + re.sub(r'(["\\])', r"\\\1", c) + '"' for c in choices)


class GrammarCompiler:
    """Per-engine xgrammar compiler (tokenizer info built once) with an LRU of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        import xgrammar as xgr  # imported here: only engines that see a structured request pay for it

        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, spec: StructuredOutputsParams):
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)  # outside the lock: xgrammar's compiler is thread-safe
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        c = self._compiler
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.schema_text(), any_whitespace=not spec.disable_any_whitespace)
            if spec.json_object:
                return c.compile_builtin_json_grammar()
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                return c.compile_grammar(choice_grammar(spec.choice))
            try:
                return c.compile_grammar(spec.grammar)
            except RuntimeError as ebnf_error:
                try:
                    return c.compile_lark(spec.grammar)
                except RuntimeError:
                    raise ebnf_error from None
        except (RuntimeError, ValueError, TypeError) as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            msg = re.sub(r"^\[[0-9:]+\] \S+: ", "", msg)  # drop xgrammar's "[time] file.cc:line: " prefix
            raise RequestError(FIELD, f"invalid {spec.kind}: {msg}") from None

    def matcher(self, compiled):
        """A fresh matcher for one sequence; it ends on one of the engine's stop (eos) tokens."""
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
