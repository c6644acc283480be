"""Hybrid drafting: copy when the context (or the datastore) has seen this before, else ask a model.

Lookup drafters are nearly free and, when their match is long, very accurate (code that repeats
identifiers, edits that quote their input); a model draft costs forwards but works everywhere.
Each step the hybrid takes the lookup proposal with the longest match if that match is at least
``min_match`` tokens long and proposes at least two tokens; otherwise the model drafts. Such a
lookup is offered to the engine as free (:meth:`Drafter.free_tokens`): it is drafted even when
the k policy finds the model not worth running, e.g. on a long prompt it would first have to read.
"""

from __future__ import annotations

from collections import Counter

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.retrieval import RetrievalDrafter
from verispec.sampling import SamplingParams

DEFAULT_MIN_MATCH = 3


class HybridDrafter(Drafter):
    """Routes each step to the n-gram, the retrieval or the ``model`` drafter.

    ``model`` is any drafter with a distribution (a draft model or layer-skip); None means
    lookup only. Every sub-drafter sees every :meth:`begin` and :meth:`commit`, drafted or not,
    so a model drafter's KV cache only ever lags the verified sequence and its propose catches up
    on the unseen suffix in one forward. ``counts`` tallies which source drafted each step.
    A reduced draft vocabulary (``SpecConfig.draft_vocab``, ``hybrid:vocab=N``) belongs to the model
    drafter (:class:`~verispec.drafters.model.ModelDrafter`), which gets its prompt from :meth:`begin`.
    """

    name = "hybrid"

    def __init__(self, ngram: NgramDrafter, model: Drafter | None, retrieval: RetrievalDrafter | None = None,
                 min_match: int = DEFAULT_MIN_MATCH) -> None:
        self.ngram, self.model, self.retrieval = ngram, model, retrieval
        self.min_match = min_match
        self.counts: Counter[str] = Counter()
        self._lookup: tuple[int, Proposal | None] | None = None  # (len(seq), lookup) from free_tokens

    def free_tokens(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> int:
        proposal = self._best_lookup(seq, k, params, generator)
        self._lookup = (len(seq), proposal)
        return 0 if proposal is None else len(proposal.tokens)

    def _subs(self) -> list[Drafter]:
        return [d for d in (self.ngram, self.retrieval, self.model) if d is not None]

    def begin(self, prompt: list[int]) -> None:
        self._lookup = None
        for d in self._subs():
            d.begin(prompt)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        cached, self._lookup = self._lookup, None
        lookup = cached[1] if cached is not None and cached[0] == len(seq) else \
            self._best_lookup(seq, k, params, generator)
        if lookup is not None:
            return Proposal(lookup.tokens[:k])  # lookups are deterministic: no distributions
        if self.model is None:
            self.counts["none"] += 1
            return Proposal([])
        self.counts[self.model.name] += 1
        return self.model.propose(seq, k, params, generator)

    def _best_lookup(self, seq: list[int], k: int, params: SamplingParams,
                     generator: torch.Generator | None) -> Proposal | None:
        """The lookup proposal with the longest trusted match (counted as drafting this step), or None."""
        best: tuple[int, str, Proposal] | None = None
        # The n-gram match cannot exceed its max_n, so hold it to at most that.
        lookups = [("ngram", self.ngram, min(self.min_match, self.ngram.max_n))]
        if self.retrieval is not None:
            lookups.append(("retrieval", self.retrieval, self.min_match))
        for name, drafter, threshold in lookups:
            proposal = drafter.propose(seq, k, params, generator)
            match = drafter.last_match
            # Strictly longer wins, so the context's own n-gram beats the datastore on a tie.
            if match >= threshold and len(proposal.tokens) >= min(2, k) and (best is None or match > best[0]):
                best = (match, name, proposal)
        if best is None:
            return None
        self.counts[best[1]] += 1
        return best[2]

    def commit(self, n_valid: int) -> None:
        for d in self._subs():
            d.commit(n_valid)

    def catch_up_tokens(self, seq: list[int]) -> int:
        # The model is the only sub-drafter that reads context with forwards (the prompt, and what
        # lookup steps added): a k policy must charge that, not book it as the cost of draft tokens.
        return self.model.catch_up_tokens(seq) if self.model is not None else 0
