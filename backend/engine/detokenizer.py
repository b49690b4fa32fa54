"""Incremental detokenization and stop-string matching, the layer above the engine.

The engine produces token ids; this layer turns them into text deltas for streaming clients.

Detokenization uses the prefix/read offset technique: each step decodes only a short window of
tokens (the tokens of the last emitted chunk, as context, plus the tokens not yet emitted) and emits
the difference between the window's text and the context's text. Decoding the context together
with the new tokens gives SentencePiece-style tokenizers (Llama/Mistral: "\u2581" word prefix whose
space is stripped at the start of a decode) and byte-level BPE (GPT-2/SmolLM2) the right spacing,
and keeps every step O(new tokens) instead of re-decoding the whole output.

A decoded window that ends in U+FFFD means "an incomplete UTF-8 character": nothing is emitted and
the tokens stay pending until later tokens complete it (or the request finishes, when whatever is
there is flushed). Concatenating all deltas of a request gives
``tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens,
clean_up_tokenization_spaces=False)``; the prompt is *not* used as context, so the first output
token is decoded as the first token of a text (Llama's leading "\u2581" is stripped, as in
``decode(output_ids)``). One known exception, shared with vLLM / tokenizers' DecodeStream: with
SentencePiece byte-fallback tokens, a run of <0xNN> tokens whose bytes end up invalid UTF-8 (the
model emitted bad bytes, or the request ended mid-character) decodes *as a whole* to U+FFFD in
``decode(output_ids)``, while the stream has already sent the valid characters at the start of the
run; the stream then continues with the new tokens' own text (see ``_detokenize``).

Stop strings are matched on the decoded text across token boundaries. Text that could be the start
of a stop string is held back until it is known not to be one, so a streaming client never sees a
partial stop string that is later retracted. When a stop string completes, the text up to it (and
including it when ``include_stop_str_in_output``) is emitted, nothing after it, and the delta says
``stopped=True``; the caller then aborts the request and reports finish reason "stop". Among stop
strings, the one that completes first in the text wins (ties: the longest), so the result does not
depend on how the text was split into tokens or steps. As in vLLM, stop strings are only looked
for once more than ``params.min_tokens`` output tokens exist; a stop string that ends in text
checked before that point is ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from loom.engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerDelta:
    text: str  # new text to send to the client ("" when nothing is ready)
    stopped: bool = False  # a stop string matched; the caller aborts the request (finish reason "stop")
    stop_reason: str | None = None  # the matched stop string when stopped


@dataclass(frozen=True)
class TextUpdate:
    """One engine output seen through the detokenizer: what to send and how the request now stands."""
    text: str
    finished: bool
    finish_reason: str | None
    abort_engine: bool  # a stop string ended the request before the engine did: abort it there


def _skippable_special_ids(tokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: added tokens flagged special.

    Dropping them before they enter the decode window is equivalent (decode would skip them) and
    keeps the window short when a model emits many of them. Missing one only costs speed.
    """
    ids: set[int] = set()
    try:
        for tid, tok in tokenizer.added_tokens_decoder.items():
            if getattr(tok, "special", False):
                ids.add(int(tid))
    except Exception:  # not a transformers tokenizer, or an older API: decode still skips them
        pass
    return frozenset(ids)


class IncrementalDetokenizer:
    """Per-request incremental detokenizer with stop-string handling.

    ``step(new_token_ids, finished)`` is called once per engine step with the request's new token ids;
    ``finished`` is True on the request's last step (engine-side stop, length, abort), which flushes
    everything held back. After a stop string matched, or after a finished step, further calls
    return an empty delta (``stopped``/``stop_reason`` keep reporting the stop, if any).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = bool(params.skip_special_tokens)
        # vLLM's spaces_between_special_tokens goes to the tokenizer's decode (slow tokenizers join special tokens
        # with spaces unless it is false; fast ones decode special tokens without separators either way).
        self._decode_kwargs = {} if params.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        self._drop_ids = _skippable_special_ids(tokenizer) if self._skip_special else frozenset()
        # The prompt is deliberately not decoding context (see module docstring); kept for callers.
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0

        # Decode window: window[:read] are the tokens of the last emitted chunk (context whose text
        # is already out), window[read:] are tokens whose text is not emitted yet.
        self._window: list[int] = []
        self._read = 0
        self._context_text: str | None = ""  # decode(window[:read]); None = not computed yet

        # Stop strings.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(params.stop or ()))
        self._include_stop = bool(params.include_stop_str_in_output)
        self._min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._stop_first_chars = frozenset(s[0] for s in self._stops)
        # include_stop_str_in_output=False: text held back (not emitted; it could start a stop string).
        # include_stop_str_in_output=True: nothing is held back (the text is output either way); this
        # is the tail of the emitted text kept to find stop strings that span a step boundary.
        self._tail = ""

        self._output_text = ""
        self._stop_reason: str | None = None
        self._done = False

    # ------------------------------------------------------------------ public API
    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return self._output_text

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def update(self, new_token_ids: Iterable[int], finished: bool, finish_reason: str | None) -> TextUpdate:
        """step() plus what it means for the request: a matched stop string finishes it with reason "stop"
        (the engine, which knows only token ids, must then be told to abort it)."""
        d = self.step(new_token_ids, finished)
        if d.stopped:
            return TextUpdate(d.text, True, "stop", not finished)
        return TextUpdate(d.text, finished, finish_reason, False)

    def step(self, new_token_ids: Iterable[int], finished: bool) -> DetokenizerDelta:
        if self._done:
            return DetokenizerDelta("", self.stopped, self._stop_reason)
        new_ids = list(new_token_ids)
        self.num_output_tokens += len(new_ids)
        if self._drop_ids:
            new_ids = [t for t in new_ids if t not in self._drop_ids]
        self._window.extend(new_ids)

        text = self._detokenize(finished)
        if self._stops:
            text, stop = self._match_stops(text, finished)
        else:
            stop = None
        self._output_text += text
        if stop is not None:
            self._stop_reason = stop
            self._done = True
            return DetokenizerDelta(text, True, stop)
        if finished:
            self._done = True
        return DetokenizerDelta(text, False, None)

    # ------------------------------------------------------------------ detokenization
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False, **self._decode_kwargs
        )

    def _detokenize(self, finished: bool) -> str:
        """Text of the pending tokens that is ready to be emitted (all of it when finished)."""
        window = self._window
        if len(window) == self._read:
            return ""
        if self._context_text is None:
            self._context_text = self._decode(window[: self._read])
        context = self._context_text
        text = self._decode(window)
        if len(text) <= len(context):
            # Nothing new yet (e.g. only tokens that decode to nothing); keep them pending.
            return ""
        if not finished and text.endswith(REPLACEMENT_CHAR):
            # Probably an incomplete UTF-8 character: wait for the tokens that complete it.
            return ""
        if text.startswith(context):
            delta = text[len(context):]
        else:
            # Decoding more tokens changed text that is already out. Byte-fallback decoders
            # (SentencePiece <0xNN> tokens) do this when a run of byte tokens that spelled valid
            # characters is continued by bytes that make the run invalid UTF-8: the whole run then
            # decodes to U+FFFD. What was sent cannot be retracted; send the new tokens' own text.
            delta = self._decode(window[self._read:])
        # The tokens just emitted become the context of the next window.
        del window[: self._read]
        self._read = len(window)
        self._context_text = None  # decoded lazily, only if another step comes
        return delta

    # ------------------------------------------------------------------ stop strings
    def _match_stops(self, new_text: str, finished: bool) -> tuple[str, str | None]:
        """Apply stop strings to newly decoded text; returns (text to emit, matched stop or None)."""
        region = self._tail + new_text
        checked = len(self._tail)  # matches ending at or before this were already considered
        if new_text and self.num_output_tokens > self._min_tokens:
            best_start = best_end = -1
            best = None
            for s in self._stops:
                i = region.find(s, max(0, checked - len(s) + 1))
                if i < 0:
                    continue
                end = i + len(s)
                if best is None or end < best_end or (end == best_end and len(s) > len(best)):
                    best, best_start, best_end = s, i, end
            if best is not None:
                cut = best_end if self._include_stop else best_start
                start = len(self._tail) if self._include_stop else 0
                self._tail = ""
                return region[start:cut], best

        if self._include_stop:
            keep = self._max_stop_len - 1
            self._tail = region[-keep:] if keep > 0 else ""
            return new_text, None
        if finished:
            self._tail = ""
            return region, None
        hold = self._held_suffix_len(region)
        self._tail = region[len(region) - hold:] if hold else ""
        return region[: len(region) - hold], None

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        n = len(text)
        first_chars = self._stop_first_chars
        for i in range(max(0, n - self._max_stop_len + 1), n):
            if text[i] in first_chars:
                suffix = text[i:]
                for s in self._stops:
                    if len(s) > n - i and s.startswith(suffix):
                        return n - i
        return 0
