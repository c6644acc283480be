"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.sampling import SamplingParams


class NgramDrafter(Drafter):
    """Matches the last n tokens (n from ``max_n`` down to ``min_n``) against the prompt and output.

    The index maps each n-gram to the position right after its most recent occurrence and is
    extended only with the tokens appended since the last call, so a step costs O(max_n + k)
    whatever the context length. Verified tokens never change, so rollbacks need no work.
    """

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.begin([])

    def begin(self, prompt: list[int]) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # positions i < indexed have their n-grams ending at i recorded
        self.last_match = 0  # n of the n-gram the latest proposal matched (0: none); the hybrid reads it

    def _extend(self, seq: list[int]) -> None:
        # An n-gram ending right before position i is followed by seq[i]; only i < len(seq) qualifies.
        for i in range(self.indexed, len(seq)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self.index[tuple(seq[i - n:i])] = i
        self.indexed = len(seq)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        if len(seq) < self.indexed:  # a different sequence than the one indexed
            self.begin(seq)
        self._extend(seq)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            pos = self.index.get(tuple(seq[-n:]))
            if pos is not None:
                self.last_match = n
                return Proposal(seq[pos:pos + k])
        self.last_match = 0
        return Proposal([])
