"""Hybrid drafting: copy when the context (or the datastore) has seen this before, else ask the draft model.

The context lookup is the n-gram drafter (prompt lookup) or, with ``lookup="suffix"``, the suffix
drafter (the longest match in the request and in earlier outputs, drafted as far as it is confident).

Lookup drafters are nearly free and, when their match is long, very accurate (code that repeats
identifiers, edits that quote their input); a model draft costs forwards but works everywhere.
Each step the hybrid takes the lookup proposal with the longest match if that match is at least
``min_match`` tokens long and proposes at least two tokens. Such a lookup is offered to the engine
as free (:meth:`Drafter.free_tokens`): it is drafted even when the k policy finds the model not
worth running. Without one the row drafts with the draft model (:meth:`HybridDrafter.drafting` is
its :class:`~verispec.drafters.model.ModelDrafter`, which drafts in lockstep with the other rows),
or decodes plainly if there is none.
"""

from __future__ import annotations

from collections import Counter

import torch

from verispec.drafters.base import Allowed, Drafter, Proposal
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.retrieval import RetrievalDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.sampling import SamplingParams

DEFAULT_MIN_MATCH = 3


class HybridDrafter(Drafter):
    """Hybrid drafting: a context lookup (n-gram or suffix), if given the retrieval drafter, and the draft
    ``model`` for the steps no lookup is trusted on (without one those steps decode plainly).

    A lookup reports its match length in ``last_match`` and the longest it looks for in ``max_n``.
    Every sub-drafter sees every :meth:`begin`, :meth:`commit` and :meth:`end`, drafted or not.
    ``counts`` tallies which source drafted each step, by its name ("ngram" or "suffix",
    "retrieval", "draft").
    """

    name = "hybrid"

    def __init__(self, lookup: NgramDrafter | SuffixDrafter, retrieval: RetrievalDrafter | None = None,
                 min_match: int = DEFAULT_MIN_MATCH, model: Drafter | None = None) -> None:
        self.lookup, self.retrieval, self.model = lookup, retrieval, model
        self.lookups_only = model is None
        self.min_match = min_match
        self.counts: Counter[str] = Counter()
        # (len(seq), (source, lookup)) from free_tokens: offered, counted only once drafted
        self._offered: tuple[int, tuple[str, Proposal] | None] | None = None

    def free_tokens(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                    allowed: Allowed | None = None) -> int:
        best = self._best_lookup(seq, k, params, generator, allowed)
        self._offered = (len(seq), best)
        return 0 if best is None else len(best[1].tokens)

    def drafting(self) -> Drafter:
        offered = self._offered is not None and self._offered[1] is not None
        return self.model if self.model is not None and not offered else self

    def model_drafted(self) -> None:
        self.counts["draft"] += 1

    def _subs(self) -> list[Drafter]:
        return [d for d in (self.lookup, self.retrieval, self.model) if d is not None]

    def use_row(self, slot: int) -> None:
        if self.model is not None:
            self.model.use_row(slot)

    def begin(self, prompt: list[int]) -> None:
        self._offered = None
        for d in self._subs():
            d.begin(prompt)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        cached, self._offered = self._offered, None
        lookup = cached[1] if cached is not None and cached[0] == len(seq) else \
            self._best_lookup(seq, k, params, generator)
        if lookup is not None:
            self.counts[lookup[0]] += 1
            return lookup[1].cut(k)  # lookups are deterministic: no distributions
        if self.model is not None:
            self.counts["draft"] += 1
            return self.model.propose(seq, k, params, generator)
        self.counts["none"] += 1
        return Proposal([])

    def _best_lookup(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                     allowed: Allowed | None = None) -> tuple[str, Proposal] | None:
        """The lookup proposal with the longest trusted match and its source's name, or None; with ``allowed``
        (a grammar) each proposal holds only what the grammar accepts before it is weighed."""
        best: tuple[int, str, Proposal] | None = None
        # The context's match cannot exceed its lookup's max_n, so hold it to at most that.
        lookups: list[tuple[Drafter, int]] = [(self.lookup, min(self.min_match, self.lookup.max_n))]
        if self.retrieval is not None:
            lookups.append((self.retrieval, self.min_match))
        for drafter, threshold in lookups:
            proposal = drafter.propose(seq, k, params, generator)
            if allowed is not None and proposal.parents is None and proposal.tokens:
                proposal = proposal.cut(allowed(proposal.tokens))
            match = drafter.last_match
            # Strictly longer wins, so the context's own lookup beats the datastore on a tie.
            if match >= threshold and len(proposal.tokens) >= min(2, k) and (best is None or match > best[0]):
                best = (match, drafter.name, proposal)
        return None if best is None else (best[1], best[2])

    def commit(self, n_valid: int) -> None:
        for d in self._subs():
            d.commit(n_valid)

    def end(self, seq: list[int]) -> None:
        for d in self._subs():
            d.end(seq)
