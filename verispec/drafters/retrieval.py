"""Retrieval drafting (after REST, He et al. 2023): continue the context the way a corpus continues it.

The corpus lives in a :class:`~verispec.drafters.datastore.Datastore` (token ids plus their
suffix array, memory-mapped). Each step finds the longest suffix of the context (:data:`MAX_MATCH`
down to :data:`MIN_MATCH` tokens) that occurs in the corpus and proposes the most frequent
continuation among its occurrences, chosen token by token. Proposals are deterministic.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.datastore import SEPARATOR, BuildSummary, Datastore, build_datastore
from verispec.drafters.suffix_array import longest_match
from verispec.sampling import SamplingParams

__all__ = ["BuildSummary", "Datastore", "RetrievalDrafter", "build_datastore", "continuation_tree"]

MAX_MATCH, MIN_MATCH = 16, 2  # the context suffixes looked up, longest first


def continuation_tree(continuations: np.ndarray, k: int, min_prob: float = 0.0,
                      width: int = 1) -> tuple[list[int], list[int]]:
    """The most probable continuations in ``continuations`` ``[N, >= depth]`` (negative ids end a row) as
    a token tree of at most ``k`` nodes: (tokens, parents), parents before children, -1 for the root.

    A node's probability is its path's empirical probability: the product, over its tokens, of each
    token's share of the rows that agree so far and go on. Each node offers its ``width`` most frequent
    next tokens (ties: the smaller id), and the tree grows best first by probability, keeping nodes of
    probability ``min_prob`` or more. ``width`` 1 gives the greedy most frequent path: the most
    frequent first token, the most frequent second among rows starting with it, and so on.
    """
    tokens: list[int] = []
    parents: list[int] = []
    depth_max = continuations.shape[1] if continuations.ndim == 2 else 0
    order = itertools.count()  # equal probabilities: the node offered first
    heap: list[tuple[float, int, int, int, int, np.ndarray]] = []

    def offer(parent: int, depth: int, alive: np.ndarray, prob: float) -> None:
        if depth >= depth_max:
            return
        col = continuations[alive, depth]
        col = col[col >= 0]
        if len(col) == 0:
            return
        values, counts = np.unique(col, return_counts=True)
        for best in np.argsort(-counts, kind="stable")[:width]:  # stable: ties keep unique's ascending ids
            p = prob * int(counts[best]) / len(col)
            if p < min_prob:
                break
            tok = int(values[best])
            heapq.heappush(heap, (-p, next(order), parent, depth, tok, alive & (continuations[:, depth] == tok)))

    if k > 0:
        offer(-1, 0, np.ones(len(continuations), dtype=bool), 1.0)
    while heap and len(tokens) < k:
        neg_p, _, parent, depth, tok, alive = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        offer(len(tokens) - 1, depth + 1, alive, -neg_p)
    return tokens, parents


class RetrievalDrafter(Drafter):
    """Proposes what most often follows the longest matching context suffix in ``store``.

    ``max_candidates`` bounds the work per step: a suffix with more occurrences is sampled at
    evenly spaced points of its suffix-array range. Occurrences there are sorted by what follows
    them, so the sample keeps each continuation's share to within one stride.
    """

    name = "retrieval"

    def __init__(self, store: Datastore, max_candidates: int = 256) -> None:
        # Plain ndarray views of the maps: slicing a np.memmap costs a subclass round trip per slice.
        self._tokens, self._sa = np.asarray(store.tokens), np.asarray(store.sa)
        self.max_candidates = max_candidates
        self.last_match = 0  # length of the suffix the latest proposal matched (0: none)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        tokens, sa = self._tokens, self._sa
        m, lo, hi = longest_match(tokens, sa, seq, MAX_MATCH, MIN_MATCH)
        self.last_match = m
        if m == 0 or k <= 0:
            return Proposal([])
        count = hi - lo
        n_take = min(count, self.max_candidates)
        rows = lo + (np.arange(n_take, dtype=np.int64) * count) // n_take
        starts = sa[rows].astype(np.int64) + m
        offsets = starts[:, None] + np.arange(k, dtype=np.int64)
        n = len(tokens)
        conts = np.where(offsets < n, tokens[np.minimum(offsets, n - 1)], SEPARATOR)
        return Proposal(continuation_tree(conts, k)[0])
