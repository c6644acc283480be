"""Suffix decoding (after SuffixDecoding, Oliaro et al. 2024): draft what most often followed the context's suffix.

Two indexes are searched for the longest suffix of the context that occurred before: the request's
own prompt and output (:class:`RequestIndex`), and, for matches of at least ``ANCHOR`` tokens, the
outputs of earlier requests of the same engine (:class:`OutputIndex`, shared by its suffix drafters,
bounded in tokens). The drafter reads what followed every occurrence of that longest match in both
and proposes the most frequent continuation token by token, as long as the path's empirical
probability stays at or above ``min_prob`` and the draft is no longer than ``factor`` times the
match (and ``MAX_DRAFT`` tokens, and k): a long match with one agreed continuation drafts far, a
short or ambiguous one little or nothing. With ``width`` above 1 the draft is a token tree of the
most probable continuations (up to ``width`` per node, grown best first, as many nodes as a chain
would have tokens): where earlier occurrences disagree, each way is drafted. No model runs;
proposals are deterministic (``probs`` None), so verification stays exact.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from verispec.config import SpecConfig
from verispec.drafters.base import Allowed, Drafter, Proposal
from verispec.drafters.retrieval import continuation_tree
from verispec.sampling import SamplingParams

__all__ = ["OutputIndex", "RequestIndex", "SuffixDrafter"]

ANCHOR = 4  # a request's n-grams of 1 to ANCHOR tokens are indexed (earlier outputs': ANCHOR only); longer
# matches extend an occurrence of an ANCHOR-gram
MAX_MATCH = 32  # the longest context suffix matched
MAX_DRAFT = 32  # the most tokens one proposal drafts
MAX_CANDIDATES = 64  # occurrences read per index and step, the most recent first
_DEFAULTS = SpecConfig()  # suffix_global, suffix_min_prob and suffix_factor: the defaults of the options


def _grams_before(tokens: Sequence[int], i: int) -> Iterable[tuple[int, ...]]:
    """The n-grams (1 to ANCHOR tokens) that end right before position ``i`` of ``tokens``."""
    return (tuple(tokens[i - n:i]) for n in range(1, min(ANCHOR, i) + 1))


class RequestIndex:
    """One request's tokens (prompt and output) and, per n-gram, the positions that follow its occurrences.

    Position ``i`` is recorded for the n-grams ending right before it once ``tokens[i]`` is known,
    so the positions of every n-gram are increasing and the current suffix itself is never among
    them. Appending costs O(ANCHOR) per token; cutting back pops the same entries.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.grams: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, seq: Sequence[int]) -> None:
        """Index the tokens of ``seq`` past the ones indexed (``seq`` starts with them)."""
        tokens, grams = self.tokens, self.grams
        for i in range(len(tokens), len(seq)):
            for gram in _grams_before(seq, i):
                grams.setdefault(gram, []).append(i)
            tokens.append(seq[i])

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens only, as if nothing past them had been indexed."""
        tokens, grams = self.tokens, self.grams
        for i in range(len(tokens) - 1, n - 1, -1):
            for gram in _grams_before(tokens, i):
                positions = grams[gram]
                positions.pop()  # i is the last position recorded for it
                if not positions:
                    del grams[gram]
        del tokens[n:]

    def occurrences(self, gram: tuple[int, ...], limit: int) -> list[int]:
        """Up to ``limit`` positions that follow ``gram``, the most recent ones."""
        positions = self.grams.get(gram)
        return positions[-limit:] if positions else []


class OutputIndex:
    """Earlier requests' outputs, shared by the suffix drafters of one engine; at most ``budget`` tokens.

    A document is a finished request's output after the last ``MAX_MATCH`` tokens of its prompt (the
    context its first tokens are matched in; a prompt is indexed by its own request). Only matches of
    at least ``ANCHOR`` tokens are looked up here: shorter ones across unrelated requests are noise,
    and indexing one n-gram length keeps the index near 200 bytes per token. Adding a document past
    the budget evicts the least recently used ones first, where a document is used when the
    context's longest match occurs in it; one longer than the whole budget keeps its last ``budget``
    tokens.
    """

    def __init__(self, budget: int = _DEFAULTS.suffix_global) -> None:
        if not 1 <= budget < 2**32:  # positions are kept in 32 bits
            raise ValueError("an output index needs a budget of 1 to 2**32 - 1 tokens")
        self.budget = budget
        self.docs: OrderedDict[int, array[int]] = OrderedDict()  # least recently used first
        # hash of an ANCHOR-gram -> (document << 32 | the position following it), oldest first; a hash
        # collision only costs a comparison (occurrences checks the tokens).
        self.grams: dict[int, list[int]] = {}
        self.n_tokens = 0
        self._ids = itertools.count()

    @classmethod
    def shared(cls, registry: dict, budget: int, owner: str) -> OutputIndex:
        """The index of ``budget`` tokens that ``registry`` (an engine's :attr:`DraftContext.shared`) holds
        for ``owner`` (the speculation settings of the requests that share it)."""
        return registry.setdefault((cls.__name__, budget, owner), cls(budget))

    @staticmethod
    def _keys(tokens: Sequence[int]) -> Iterable[tuple[int, int]]:
        """(position, hash of the ANCHOR-gram right before it) for each position that follows one."""
        return ((i, hash(tuple(tokens[i - ANCHOR:i]))) for i in range(ANCHOR, len(tokens)))

    def add(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` as a new document, then evict until the budget holds."""
        kept = array("i", tokens[-self.budget:])
        if len(kept) <= ANCHOR:  # no ANCHOR-gram is followed by anything
            return
        doc = next(self._ids)
        self.docs[doc] = kept
        self.n_tokens += len(kept)
        for i, key in self._keys(kept):
            self.grams.setdefault(key, []).append(doc << 32 | i)
        while self.n_tokens > self.budget:
            self._evict(next(iter(self.docs)))

    def _evict(self, doc: int) -> None:
        tokens = self.docs.pop(doc)
        self.n_tokens -= len(tokens)
        for i, key in self._keys(tokens):
            postings = self.grams[key]
            postings.remove(doc << 32 | i)
            if not postings:
                del self.grams[key]

    def occurrences(self, gram: tuple[int, ...], limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` (document, position following ``gram``) pairs, the newest first (none unless
        ``gram`` has ANCHOR tokens)."""
        out: list[tuple[int, int]] = []
        if len(gram) != ANCHOR:
            return out
        for code in reversed(self.grams.get(hash(gram), ())):
            doc, end = code >> 32, code & 0xFFFFFFFF
            if tuple(self.docs[doc][end - ANCHOR:end]) == gram:
                out.append((doc, end))
                if len(out) == limit:
                    break
        return out

    def touch(self, docs: Iterable[int]) -> None:
        """Mark ``docs`` as just used: they are evicted last."""
        for doc in docs:
            if doc in self.docs:
                self.docs.move_to_end(doc)


def _match_length(tokens: Sequence[int], end: int, seq: Sequence[int], known: int, limit: int) -> int:
    """How many tokens before ``end`` in ``tokens`` equal the last ones of ``seq`` (at least ``known``, at
    most ``limit``)."""
    m, n = known, len(seq)
    while m < limit and m < end and m < n and tokens[end - 1 - m] == seq[n - 1 - m]:
        m += 1
    return m


class SuffixDrafter(Drafter):
    """Proposes the most frequent continuation of the context's longest earlier match (see the module).

    ``outputs`` is the engine's index of earlier outputs (None: the request's own tokens only);
    :meth:`end` adds the request's output to it. ``min_prob`` is the lowest empirical probability a
    drafted path may have, ``factor`` the longest draft per matched token. ``last_match`` is the
    length of the latest proposal's match (0: none) and ``max_n`` the longest match it looks for,
    as for :class:`~verispec.drafters.ngram.NgramDrafter`: the hybrid reads both.
    """

    name = "suffix"

    def __init__(self, outputs: OutputIndex | None = None, min_prob: float = _DEFAULTS.suffix_min_prob,
                 factor: float = _DEFAULTS.suffix_factor, max_match: int = MAX_MATCH,
                 width: int = _DEFAULTS.suffix_width) -> None:
        if not 0.0 <= min_prob <= 1.0 or factor <= 0 or max_match < 1 or width < 1:
            raise ValueError("need 0 <= min_prob <= 1, factor > 0, max_match >= 1 and width >= 1")
        self.outputs = outputs
        self.min_prob, self.factor, self.max_n, self.width = min_prob, factor, max_match, width
        self.begin([])

    def begin(self, prompt: list[int]) -> None:
        self.index = RequestIndex()
        self.prompt_len = len(prompt)
        self.last_match = 0
        self._offered: tuple[int, Proposal] | None = None  # (len(seq), draft) from free_tokens

    def commit(self, n_valid: int) -> None:
        self._offered = None
        if n_valid < len(self.index):
            self.index.truncate(n_valid)

    def end(self, seq: list[int]) -> None:
        if self.outputs is not None:
            self.outputs.add(seq[max(0, self.prompt_len - self.max_n):])
        self.begin([])  # the request's index is not needed past its end

    def free_tokens(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                    allowed: Allowed | None = None) -> int:
        # The draft's length already follows its confidence: the engine drafts it whatever its k policy says.
        proposal, _ = self._draft(seq, k)
        if allowed is not None and proposal.parents is None and proposal.tokens:
            proposal = proposal.cut(allowed(proposal.tokens))  # a tree's refused nodes are pruned by the step
        self._offered = (len(seq), proposal)
        return len(proposal.tokens)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        offered, self._offered = self._offered, None
        if offered is not None and offered[0] == len(seq):
            return offered[1].cut(k)  # a smaller budget keeps the same tree's first nodes
        return self._draft(seq, k)[0]

    def lookup(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """(draft of at most ``k`` tokens, length of the match it continues) for ``seq``; ([], 0) when none."""
        proposal, m = self._draft(seq, k)
        return proposal.tokens, m

    def _draft(self, seq: list[int], k: int) -> tuple[Proposal, int]:
        """(draft of at most ``k`` tokens, a tree if ``width`` > 1, and the match length) for ``seq``."""
        if len(seq) < len(self.index):  # a different sequence than the one indexed
            self.index = RequestIndex()
        self.index.extend(seq)
        self.last_match = 0
        if k <= 0:
            return Proposal([]), 0
        outputs = self.outputs
        for n in range(min(ANCHOR, len(seq)), 0, -1):
            gram = tuple(seq[-n:])
            mine = self.index.occurrences(gram, MAX_CANDIDATES)
            theirs = outputs.occurrences(gram, MAX_CANDIDATES) if outputs is not None else []
            if mine or theirs:
                break
        else:
            return Proposal([]), 0
        found: list[tuple[Sequence[int], int, int | None]] = [(seq, end, None) for end in mine]
        found += [(outputs.docs[doc], end, doc) for doc, end in theirs]
        # Below ANCHOR tokens the (n + 1)-gram occurs nowhere, so every occurrence matches exactly n.
        lengths = [n] * len(found) if n < ANCHOR else \
            [_match_length(tokens, end, seq, n, self.max_n) for tokens, end, _ in found]
        m = max(lengths)
        best = [f for f, length in zip(found, lengths, strict=True) if length == m]
        limit = min(k, MAX_DRAFT, math.ceil(self.factor * m))
        conts = np.full((len(best), limit), -1, dtype=np.int64)
        for row, (tokens, end, _) in zip(conts, best, strict=True):
            part = tokens[end:end + limit]
            row[:len(part)] = part
        if outputs is not None:
            outputs.touch(doc for _, _, doc in best if doc is not None)
        self.last_match = m
        tokens, parents = continuation_tree(conts, limit, self.min_prob, self.width)
        branches = len(set(parents)) < len(parents)  # a node with two children: else the tree is a chain
        return Proposal(tokens, parents=parents if branches else None), m
