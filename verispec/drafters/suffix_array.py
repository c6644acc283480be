"""Suffix arrays over token ids, built with numpy, and binary search over them.

Kept apart from the drafter so the index can be tested (and reused) on plain arrays.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable

import numpy as np


def suffix_array(tokens: np.ndarray, on_round: Callable[[int], None] | None = None) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` in lexicographic order (int32, or int64 past 2**31).

    Prefix doubling: after round r every suffix is ranked by its first 2**r tokens; a round is one
    numpy argsort of (rank[i], rank[i + h]) packed into an int64, so 10M tokens take a few seconds
    per round and rounds stop as soon as all ranks are distinct (about log2 of the longest repeat).
    A suffix that is a prefix of another sorts first; negative ids (document separators) sort
    before every real token. ``on_round(h)`` is called after sorting by the first ``h`` tokens.
    """
    n = len(tokens)
    out_dtype = np.int32 if n < 2**31 else np.int64
    if n == 0:
        return np.zeros(0, dtype=out_dtype)
    # Dense ranks 0..m-1 keep the packed keys below n * (n + 1), well inside int64.
    _, rank = np.unique(np.asarray(tokens), return_inverse=True)
    rank = rank.astype(np.int64).reshape(-1)
    h = 1
    while int(rank.max()) < n - 1:  # some suffixes still tie on their first h tokens
        nxt = np.zeros(n, dtype=np.int64)  # 0: the suffix ends before i + h, which sorts first
        nxt[: n - h] = rank[h:] + 1
        key = rank * (n + 1) + nxt
        del nxt
        order = np.argsort(key)  # ties are suffixes equal on 2h tokens; their order is settled later
        sorted_key = key[order]
        del key
        rank[order] = np.concatenate(([0], np.cumsum(sorted_key[1:] != sorted_key[:-1])))
        del order, sorted_key
        h *= 2
        if on_round is not None:
            on_round(h)
    # Distinct ranks are the final order: invert them instead of sorting once more.
    sa = np.empty(n, dtype=out_dtype)
    sa[rank] = np.arange(n, dtype=out_dtype)
    return sa


def find_range(tokens: np.ndarray, sa: np.ndarray, pattern: list[int]) -> tuple[int, int]:
    """The range ``[lo, hi)`` of ``sa`` whose suffixes start with ``pattern`` (empty when none does)."""
    def window(start: np.integer) -> list[int]:  # the suffix cut to the pattern's length (int: no int32 overflow)
        return tokens[int(start):int(start) + len(pattern)].tolist()

    first = bisect_left(sa, pattern, key=window)
    return first, bisect_right(sa, pattern, first, key=window)


def longest_match(tokens: np.ndarray, sa: np.ndarray, context: list[int], max_len: int, min_len: int
                  ) -> tuple[int, int, int]:
    """The longest suffix of ``context`` (``min_len`` to ``max_len`` tokens) that occurs in ``tokens``.

    Returns (length, lo, hi) with ``sa[lo:hi]`` its occurrences, or (0, 0, 0). If a suffix occurs,
    so does every shorter one, so the length is found by binary search: about log2(max_len)
    lookups instead of one per length.
    """
    best = (0, 0, 0)
    a, b = min_len, min(max_len, len(context))
    while a <= b:
        m = (a + b) // 2
        lo, hi = find_range(tokens, sa, context[-m:])
        if hi > lo:
            best = (m, lo, hi)
            a = m + 1
        else:
            b = m - 1
    return best
