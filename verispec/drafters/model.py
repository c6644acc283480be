"""The draft model as a drafter: one row's view of the engine's lockstep draft runner.

Every row that drafts with the draft model has a :class:`ModelDrafter`; a step collects them and the
runner drafts all their rows in one forward per token (:class:`~verispec.drafters.base.Lockstep`). The
drafter tells the runner which row it drafts in, which prompt starts there (with a reduced draft
vocabulary or a draft window, if the spec asks for one), what is final after each step and when the
request ends.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verispec.drafters.base import Drafter, Lockstep, Proposal
from verispec.sampling import SamplingParams


class ModelDrafter(Drafter):
    """Drafts one row with the draft model through the shared ``lockstep`` runner."""

    name = "draft"

    def __init__(self, lockstep: Lockstep, draft_vocab: int | None = None, draft_window: int | None = None,
                 min_confidence: float = 0.0) -> None:
        self.lockstep = lockstep
        self.draft_vocab, self.draft_window, self.min_confidence = draft_vocab, draft_window, min_confidence
        self.slot = -1

    def use_row(self, slot: int) -> None:
        self.slot = slot

    def begin(self, prompt: list[int]) -> None:
        self.lockstep.begin(self.slot, prompt, self.draft_vocab, self.draft_window)

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """This row alone (a step drafts every lockstep row in one call instead)."""
        row = SimpleNamespace(slot=self.slot, seq=seq, k=k, params=params, generator=generator,
                              min_confidence=self.min_confidence, processor=None)
        return self.lockstep.propose([row])[0]

    def commit(self, n_valid: int) -> None:
        self.lockstep.commit(self.slot, n_valid)

    def end(self, seq: list[int]) -> None:
        self.lockstep.release(self.slot, seq)
