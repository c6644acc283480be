"""Predicted outputs: text the caller expects the answer to repeat (the code an edit quotes) drafts it.

OpenAI's ``prediction`` parameter: the answer's tokens that follow the prediction are proposed in long
runs and accepted in bulk; everything else drafts as the request's own method would. The drafter keeps a
cursor into the prediction's tokens that follows the output:

- while the output goes on as the prediction does, the cursor advances with it and the next run starts
  where the last accepted token left off;
- after a divergence it re-aligns: the output's last tokens are matched against the prediction, the
  longest match winning and, among equally long ones, the nearest at or after the cursor. After a deleted
  passage the match lies further on (it skips ahead); after an inserted one nothing matches until the
  output reaches text the prediction has again (it waits);
- a match shorter than ``min_match`` tokens is not trusted, so an unrelated prediction stops proposing
  after its first probe and costs only the lookups.

A run is offered to the engine as free (:meth:`Drafter.free_tokens`), up to the k it is allowed (the
widest the verify curve prices, under the cost policy, which cuts it where the step's goodput peaks). Where
the prediction offers nothing, ``inner`` (the drafter the request's method names, or None for plain
decoding) drafts as it would without a prediction. Proposals are deterministic, so greedy output is plain
decoding's and sampled output is distributed as the target's, whatever the prediction says.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Allowed, Drafter, Proposal
from verispec.drafters.suffix import ANCHOR, RequestIndex, _match_length
from verispec.sampling import SamplingParams

DEFAULT_MIN_MATCH = 3
MAX_ALIGN = 32  # the longest output suffix matched when re-aligning
_ALL = 1 << 30  # read every occurrence of an n-gram: a prediction is a few thousand tokens at most


class PredictionDrafter(Drafter):
    """Drafts runs of ``prediction`` (token ids) aligned with the output; ``inner`` drafts elsewhere.

    ``inner_k`` caps what ``inner`` is offered (its request's k), since the engine offers a prediction the
    widest k. ``accepted`` and ``rejected`` count the prediction's drafted tokens that verification kept and
    threw away (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``); ``offering`` is
    True while the latest offer came from the prediction.
    """

    name = "prediction"

    def __init__(self, prediction: list[int], inner: Drafter | None = None, inner_k: int = 0,
                 min_match: int = DEFAULT_MIN_MATCH) -> None:
        if not prediction:
            raise ValueError("a prediction needs at least one token")
        if min_match < 1:
            raise ValueError("min_match must be at least 1")
        self.reference, self.inner, self.inner_k, self.min_match = list(prediction), inner, inner_k, min_match
        self.index = RequestIndex()
        self.index.extend(self.reference)
        self.accepted = self.rejected = 0
        self.begin([])

    @property
    def forward_fraction(self) -> float:  # type: ignore[override]
        return self.inner.forward_fraction if self.inner is not None else 0.0

    @property
    def lookups_only(self) -> bool:  # type: ignore[override]
        return self.inner is None or self.inner.lookups_only

    def use_row(self, slot: int) -> None:
        if self.inner is not None:
            self.inner.use_row(slot)

    def begin(self, prompt: list[int]) -> None:
        self.prompt_len = len(prompt)
        self.cursor: int | None = None  # the prediction's position of the token expected at len(seq) == at
        self.at = 0
        self.last_match = 0
        self.offering = False
        self._offered: tuple[int, Proposal | None] | None = None  # (len(seq), prediction run or None: inner's)
        self._pending: tuple[int, int] | None = None  # (len(seq), run length) of the run being verified
        if self.inner is not None and prompt:
            self.inner.begin(prompt)

    def free_tokens(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                    allowed: Allowed | None = None) -> int:
        run = self._run(seq, k)
        if run is not None and allowed is not None:
            run = run.cut(allowed(run.tokens)) if run.tokens else run
            run = run if run.tokens else None
        self._offered, self.offering = (len(seq), run), run is not None
        if run is not None:
            return len(run.tokens)
        return (self.inner.free_tokens(seq, min(k, self.inner_k), params, generator, allowed)
                if self.inner is not None else 0)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        offered, self._offered = self._offered, None
        run = offered[1] if offered is not None and offered[0] == len(seq) else self._run(seq, k)
        if run is not None:
            run = run.cut(k)
            self._pending = (len(seq), len(run.tokens))
            return run
        return self.inner.propose(seq, k, params, generator) if self.inner is not None else Proposal([])

    def commit(self, n_valid: int) -> None:
        if self._pending is not None:
            start, n = self._pending
            kept = min(max(n_valid - start, 0), n)
            self.accepted += kept
            self.rejected += n - kept
            self._pending = None
        if self.inner is not None:
            self.inner.commit(n_valid)

    def end(self, seq: list[int]) -> None:
        if self.inner is not None:
            self.inner.end(seq)

    def drafting(self) -> Drafter:
        return self.inner.drafting() if self.inner is not None and not self.offering else self

    def model_drafted(self) -> None:
        if self.inner is not None:
            self.inner.model_drafted()

    def _run(self, seq: list[int], k: int) -> Proposal | None:
        """The prediction's tokens from the cursor aligned with ``seq`` (at most ``k``), or None: none trusted."""
        if k <= 0:
            return None
        cursor = self._align(seq)
        if cursor is None or cursor >= len(self.reference):
            return None
        return Proposal(self.reference[cursor:cursor + k])

    def _align(self, seq: list[int]) -> int | None:
        """Where in the prediction the token after ``seq`` is expected, or None where nothing trusted says."""
        out = len(seq) - self.prompt_len
        if self.cursor is not None and self.at <= len(seq):
            gained = len(seq) - self.at
            if seq[self.at:] == self.reference[self.cursor:self.cursor + gained]:  # the output followed it
                self.cursor, self.at = self.cursor + gained, len(seq)
                return self.cursor
        if out <= 0:  # nothing generated yet: an answer that repeats the prediction starts where it starts
            self.cursor, self.at, self.last_match = 0, len(seq), 0
            return 0
        self.cursor, self.at = self._realign(seq, min(out, MAX_ALIGN)), len(seq)
        return self.cursor

    def _realign(self, seq: list[int], longest: int) -> int | None:
        """The prediction position after the longest trusted match of ``seq``'s last tokens (at most ``longest``)."""
        self.last_match = 0
        for n in range(min(ANCHOR, longest), min(self.min_match, ANCHOR) - 1, -1):
            found = self.index.occurrences(tuple(seq[-n:]), _ALL)
            if found:
                break
        else:
            return None
        lengths = [n] * len(found) if n < ANCHOR else \
            [_match_length(self.reference, end, seq, n, longest) for end in found]
        m = max(lengths)
        if m < self.min_match:
            return None
        previous = self.cursor if self.cursor is not None else 0
        ends = [end for end, length in zip(found, lengths, strict=True) if length == m]
        ahead = [end for end in ends if end >= previous]
        self.last_match = m
        return min(ahead) if ahead else max(ends)
