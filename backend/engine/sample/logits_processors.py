"""vLLM's request-level logits processors, batched: allowed_token_ids, bad_words, logit_bias and the structured
output (grammar) mask.

Per request, :func:`build_constraints` turns the parameters into tensors once (at add_request). Per step,
:meth:`ProcessorBatch.build` concatenates the rows that use them, and the sampler applies each kind with one
vectorised operation over all its rows:

* grammar: every matcher fills its row of one int32 bitmask (xgrammar), applied to all rows in one call. The
  sampler applies it before computing logprobs, as vLLM applies the bitmask before its sampler;
* allowed_token_ids: one boolean mask [rows, V] built by one scatter; every other token becomes -inf;
* bad_words: vLLM's rule - a bad word's last token is banned when the tokens generated just before match the
  word's other tokens (single-token words are always banned); one index_put of -inf for all (row, token) pairs;
* logit_bias: one index_put with accumulate for all (row, token, bias) triples.

Order (vLLM's): grammar, allowed, bad words, logit bias; the sampler then applies penalties and min_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from loom.engine.sampling_params import SamplingParams
from loom.errors import RequestError

NEG_INF = float("-inf")


@dataclass
class RequestConstraints:
    """What one request's processors need, built once; None fields are unused."""
    bias_ids: Tensor | None = None  # int64 [B]
    bias_values: Tensor | None = None  # float32 [B]
    allowed_ids: Tensor | None = None  # int64 [A]
    bad_words: list[list[int]] | None = None  # token-id sequences (vLLM: with and without a leading space)
    grammar: Any = None  # xgrammar CompiledGrammar; each sequence gets its own matcher
    _drop: dict = field(default_factory=dict, repr=False)  # device -> bool [V]: True where not allowed

    def allowed_drop(self, vocab_size: int, device: torch.device) -> Tensor:
        """The allowed_token_ids mask as a row (built once per device, not every step)."""
        mask = self._drop.get(device)
        if mask is None:
            mask = torch.ones(vocab_size, dtype=torch.bool)
            mask[self.allowed_ids] = False
            mask = self._drop[device] = mask.to(device)
        return mask


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word without and with a leading space (the spaced form only when
    it is a different token sequence of the same length)."""
    out: list[list[int]] = []
    for word in words:
        plain: list[int] | None = None
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise RequestError("bad_words", f"{word!r} tokenizes to no tokens")
                continue
            if not prefix:
                plain = ids
                out.append(ids)
            elif ids[0] != plain[0] and len(ids) == len(plain):
                out.append(ids)
    return out


def build_constraints(params: SamplingParams, vocab_size: int, tokenizer=None,
                      grammars=None) -> RequestConstraints | None:
    """Validate token ids against the vocabulary and build the request's tensors (None: nothing to apply)."""
    c = RequestConstraints()
    V = int(vocab_size)
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= t < V]
        if bad:
            raise RequestError("logit_bias", f"token ids must be in [0, {V}), got {bad[:8]}")
        c.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        c.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if not 0 <= t < V]
        if bad:
            raise RequestError("allowed_token_ids", f"token ids must be in [0, {V}), got {bad[:8]}")
        c.allowed_ids = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.int64)
    if params.bad_words:
        if tokenizer is None:
            raise RequestError("bad_words", "needs a tokenizer (this engine has none)")
        c.bad_words = bad_words_token_ids(tokenizer, params.bad_words)
        bad = sorted({t for w in c.bad_words for t in w if not 0 <= t < V})
        if bad:
            raise RequestError("bad_words", f"token ids {bad[:8]} are outside the model's vocabulary of {V}")
    if params.structured_outputs is not None:
        if grammars is None:
            raise RequestError("structured_outputs", "needs a tokenizer (this engine has none)")
        c.grammar = grammars.compile(params.structured_outputs)
    if c.bias_ids is None and c.allowed_ids is None and not c.bad_words and c.grammar is None:
        return None
    return c


def banned_by_bad_words(words: list[list[int]], output_ids: Sequence[int]) -> list[int]:
    """Tokens that would complete a bad word now (vLLM's rule over the generated tokens only)."""
    out = []
    n = len(output_ids)
    for w in words:
        k = len(w) - 1
        if k > n:
            continue
        if k == 0 or list(output_ids[n - k:]) == w[:k]:
            out.append(w[-1])
    return out


@dataclass
class ProcessorBatch:
    """One step's processor tensors (row indices are into the sampler's rows, on the logits' device)."""
    rows: Tensor | None  # rows that can end up with every token masked (grammar, allowed_token_ids)
    any_dense: bool  # allowed / bad words / bias present (apply() has work)
    grammar_rows: list[int] | None
    matchers: list | None
    allowed_rows: Tensor | None
    allowed_drop: Tensor | None  # bool [len(allowed_rows), V]: True where a token is not allowed
    ban_rows: Tensor | None
    ban_cols: Tensor | None
    bias_rows: Tensor | None
    bias_cols: Tensor | None
    bias_values: Tensor | None
    # grammar rows whose matcher raised while filling its mask: that request ends with an error, not the whole step
    broken: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, constraints: Sequence[RequestConstraints | None], matchers: Sequence[Any] | None,
              output_token_ids: Sequence[Sequence[int]], vocab_size: int,
              device: torch.device | str, rows: Sequence[int] | None = None) -> "ProcessorBatch | None":
        """`rows`: the sampler rows the lists describe (None: row i is entry i), so a caller can pass only the
        rows that have constraints."""
        V = int(vocab_size)
        dev = torch.device(device)
        g_rows, g_matchers = [], []
        a_rows, a_masks = [], []
        ban_r, ban_c = [], []
        b_rows, b_ids, b_vals = [], [], []
        for j, c in enumerate(constraints):
            r = rows[j] if rows is not None else j
            m = matchers[j] if matchers is not None else None
            if m is not None:
                g_rows.append(r)
                g_matchers.append(m)
            if c is None:
                continue
            if c.allowed_ids is not None:
                a_rows.append(r)
                a_masks.append(c.allowed_drop(V, dev))
            if c.bad_words:
                banned = banned_by_bad_words(c.bad_words, output_token_ids[j])
                ban_r += [r] * len(banned)
                ban_c += banned
            if c.bias_ids is not None:
                b_rows.append(torch.full((len(c.bias_ids),), r, dtype=torch.int64))
                b_ids.append(c.bias_ids)
                b_vals.append(c.bias_values)
        if not (g_rows or a_rows or ban_r or b_rows):
            return None
        maskers = sorted(set(g_rows) | set(a_rows))
        drop = torch.stack(a_masks) if a_rows else None

        def d(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(dev, non_blocking=True)

        return cls(
            rows=d(torch.tensor(maskers, dtype=torch.int64)) if maskers else None,
            any_dense=bool(a_rows or ban_r or b_rows),
            grammar_rows=g_rows or None, matchers=g_matchers or None,
            allowed_rows=d(torch.tensor(a_rows, dtype=torch.int64)) if a_rows else None, allowed_drop=d(drop),
            ban_rows=d(torch.tensor(ban_r, dtype=torch.int64)) if ban_r else None,
            ban_cols=d(torch.tensor(ban_c, dtype=torch.int64)) if ban_c else None,
            bias_rows=d(torch.cat(b_rows)) if b_rows else None, bias_cols=d(torch.cat(b_ids)) if b_ids else None,
            bias_values=d(torch.cat(b_vals)) if b_vals else None,
        )

    def apply_grammar(self, logits: Tensor) -> Tensor:
        """Every grammar row's disallowed tokens to -inf, in place (one bitmask for all rows, applied in one call)."""
        if self.matchers is None:
            return logits
        import xgrammar as xgr

        V = logits.shape[1]
        rows = self.grammar_rows
        # xgrammar's `indices` name rows of the logits and of the bitmask alike: row r's mask is bitmask row r
        bitmask = xgr.allocate_token_bitmask(max(rows) + 1, V)
        for r, m in zip(rows, self.matchers):
            try:
                m.fill_next_token_bitmask(bitmask, r)
            except Exception:  # xgrammar refuses the matcher's state: accept() reports the row, the others go on
                self.broken.add(r)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=V, indices=rows)
        return logits

    def apply(self, x: Tensor) -> Tensor:
        """allowed_token_ids, bad_words, logit_bias (a new tensor; the input is not modified)."""
        if not self.any_dense:
            return x
        x = x.clone()
        if self.allowed_rows is not None:
            sub = x.index_select(0, self.allowed_rows)
            x.index_copy_(0, self.allowed_rows, sub.masked_fill_(self.allowed_drop, NEG_INF))
        if self.ban_rows is not None:
            x.index_put_((self.ban_rows, self.ban_cols), torch.tensor(NEG_INF, device=x.device))
        if self.bias_rows is not None:
            x.index_put_((self.bias_rows, self.bias_cols), self.bias_values, accumulate=True)
        return x

    def accept(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Advance every grammar row's matcher by its sampled token: (rows whose token was refused or whose matcher
        failed, rows whose grammar is now complete, its stop token accepted, so that no further token may follow)."""
        if self.matchers is None:
            return [], []
        refused, complete = [], []
        for r, m in zip(self.grammar_rows, self.matchers):
            try:
                ok = r not in self.broken and m.accept_token(int(tokens[r]))
            except Exception:  # as in apply_grammar: this request ends, the step goes on
                ok = False
            if not ok:
                refused.append(r)
            elif m.is_terminated():
                complete.append(r)
        return refused, complete
