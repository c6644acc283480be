"""Retrieval drafting (after REST, He et al. 2023): continue the context the way a corpus continues it.

The corpus lives in a :class:`~verispec.drafters.datastore.Datastore` (token ids plus their
suffix array, memory-mapped). Each step finds the longest suffix of the context (``max_match``
down to ``min_match`` tokens) that occurs in the corpus and proposes the most frequent
continuation among its occurrences, chosen token by token. Proposals are deterministic.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.datastore import SEPARATOR, BuildSummary, Datastore, build_datastore
from verispec.drafters.suffix_array import longest_match
from verispec.sampling import SamplingParams

__all__ = ["BuildSummary", "Datastore", "RetrievalDrafter", "build_datastore", "most_frequent_continuation"]


def most_frequent_continuation(continuations: np.ndarray, k: int, min_prob: float = 0.0) -> list[int]:
    """Greedy most-frequent path through ``continuations`` ``[N, >= k]`` (negative ids end a row).

    The first token is the most frequent first token; the second the most frequent among rows
    that start with it; and so on. Ties go to the smallest id, so the result is deterministic.
    With ``min_prob`` the path stops before the token that would bring its empirical probability
    below it: the product, over its tokens, of each token's share of the rows that agree so far
    and go on.
    """
    out: list[int] = []
    alive = np.ones(len(continuations), dtype=bool)
    prob = 1.0
    for j in range(min(k, continuations.shape[1] if continuations.ndim == 2 else 0)):
        col = continuations[alive, j]
        col = col[col >= 0]
        if len(col) == 0:
            break
        values, counts = np.unique(col, return_counts=True)
        best = int(np.argmax(counts))  # argmax takes the first maximum: the smallest id
        prob *= int(counts[best]) / len(col)
        if prob < min_prob:
            break
        tok = int(values[best])
        out.append(tok)
        alive &= continuations[:, j] == tok
    return out


class RetrievalDrafter(Drafter):
    """Proposes what most often follows the longest matching context suffix in ``store``.

    ``max_candidates`` bounds the work per step: a suffix with more occurrences is sampled at
    evenly spaced points of its suffix-array range. Occurrences there are sorted by what follows
    them, so the sample keeps each continuation's share to within one stride.
    """

    name = "retrieval"

    def __init__(self, store: Datastore, max_match: int = 16, min_match: int = 2, max_candidates: int = 256) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError("need 1 <= min_match <= max_match")
        self.store = store
        # Plain ndarray views of the maps: slicing a np.memmap costs a subclass round trip per slice.
        self._tokens, self._sa = np.asarray(store.tokens), np.asarray(store.sa)
        self.max_match, self.min_match, self.max_candidates = max_match, min_match, max_candidates
        self.last_match = 0  # length of the suffix the latest proposal matched (0: none)

    def lookup(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """(proposed tokens, matched suffix length) for ``seq``; ([], 0) when nothing matches."""
        tokens, sa = self._tokens, self._sa
        m, lo, hi = longest_match(tokens, sa, seq, self.max_match, self.min_match)
        if m == 0 or k <= 0:
            return [], m
        count = hi - lo
        n_take = min(count, self.max_candidates)
        rows = lo + (np.arange(n_take, dtype=np.int64) * count) // n_take
        starts = sa[rows].astype(np.int64) + m
        offsets = starts[:, None] + np.arange(k, dtype=np.int64)
        n = len(tokens)
        conts = np.where(offsets < n, tokens[np.minimum(offsets, n - 1)], SEPARATOR)
        return most_frequent_continuation(conts, k), m

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        tokens, self.last_match = self.lookup(seq, k)
        return Proposal(tokens)
