"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the context's last n tokens.

n goes from prompt_lookup_max down to prompt_lookup_min; the first n with a match wins (a longer match predicts
better). The latest occurrence, not the first: text that repeats itself (lists, code, quoted input) most often
continues the way it did most recently. Plain numpy over the request's prompt + output, no model.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k proposed tokens after `tokens` (empty when no n-gram of the allowed sizes recurs)."""
    L = len(tokens)
    if k <= 0 or L < n_min + 1:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows a[i:i+n] with i + n <= L - 1: each is followed by a token, and the suffix itself is excluded
        hits = np.flatnonzero((sliding_window_view(a[:L - 1], n) == a[L - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return a[start:start + k].tolist()
    return []
