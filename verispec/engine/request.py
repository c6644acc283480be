"""A request's life in the engine: its handle for the caller, its state for the engine, its result."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.config import PLAIN, SpecConfig
from verispec.constraints import RowLogits
from verispec.drafters.base import Drafter
from verispec.drafters.prediction import PredictionDrafter
from verispec.engine.metrics import Metrics
from verispec.engine.policy import Acceptance, ProbeSchedule
from verispec.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from verispec.engine.engine import Engine

OnTokens = Callable[[list[int]], bool | None]


@dataclass
class GenerationResult:
    """One request's output: text (when a tokenizer is present), token ids and what it measured."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    # "stop" (EOS, a stop string, a complete grammar), "length", "cancelled", "error" or "constraint_dead_end"
    finish_reason: str
    metrics: Metrics = field(repr=False)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # one per token, when asked for


class RequestHandle:
    """A submitted request: wait for its result, stream its tokens, or cancel it.

    The engine runs no thread of its own: :meth:`result` and iterating the handle (``for chunk in
    handle``: the token lists each step adds) run the engine's steps, which advance every running
    request, until this one is done. ``submitted_at``, ``admitted_at``, ``first_token_at`` and
    ``finished_at`` are ``time.perf_counter()`` stamps.
    """

    def __init__(self, engine: Engine, request_id: int, prompt: list[int]) -> None:
        self._engine, self.id, self.prompt_token_ids = engine, request_id, prompt
        self._chunks: deque[list[int]] = deque()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    @property
    def finish_reason(self) -> str | None:
        return self._result.finish_reason if self._result is not None else None

    def cancel(self) -> bool:
        """Stop the request now (finish reason ``"cancelled"``); False if it had already finished."""
        return self._engine.cancel(self)

    def result(self) -> GenerationResult:
        """The finished request's result, stepping the engine until it is done; raises the request's error."""
        while not self.done:
            self._step()
        return self._outcome()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            if self._chunks:
                yield self._chunks.popleft()
            elif self.done:
                self._outcome()  # raises the request's error, if any
                return
            else:
                self._step()

    def _step(self) -> None:
        if not self._engine.step() and not self.done:
            raise RuntimeError(f"request {self.id} is neither done nor queued in its engine")

    def _outcome(self) -> GenerationResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- called by the engine ------------------------------------------------------------

    def _push(self, tokens: list[int]) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self._chunks.append(tokens)

    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        self.finished_at = time.perf_counter()
        self._result, self._error = result, error


@dataclass
class FixedK:
    """k per request: ``spec.k`` every step (the ``fixed`` and ``confidence`` policies)."""

    k: int

    def choose(self, cap: int) -> int:
        return min(self.k, cap)

    def update(self, drafted: int, accepted: int) -> None:  # noqa: B027 (a fixed k learns nothing)
        """What the last step drafted and accepted."""


@dataclass
class HeuristicK(FixedK):
    """Grow k by 2 after a fully accepted step, shrink it by 1 after a rejection (transformers' assisted generation)."""

    k_max: int = 8
    k_min: int = 1

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(self.k_min, self.k - 1)


def request_policy(spec: SpecConfig) -> FixedK | None:
    """A request's own k policy, or None where the engine's :class:`CostPolicy` governs it (``cost``)."""
    if spec.k_policy == "cost":
        return None
    return HeuristicK(k=min(spec.k, 4), k_max=spec.k) if spec.k_policy == "heuristic" else FixedK(spec.k)


@dataclass(eq=False)
class Request:
    """One request as the engine, the scheduler, the step, the draft runner and the policy see it.

    ``seq`` is the prompt, then the output (``out``); while the request holds a slot, ``slot`` is
    its row of every KV cache and ``generator`` samples it. ``drafter`` is the row's drafter (the draft
    model's, n-gram, retrieval, layer-skip, hybrid, a prediction's; None: plain decoding); before each
    step the engine sets ``k``, and ``drafter.drafting()`` says which drafter drafts it.

    ``kpolicy`` is its own k policy (fixed, heuristic), or None where the engine's cost policy governs
    it from ``acceptance`` and ``probes``; ``lookup_acceptance`` is what its trusted lookups (hybrid)
    reach and ``prediction_acceptance`` what its prediction's runs reach, learned whatever policy sizes
    them. ``own_drafter`` is the caller's own drafter, if any; ``prediction`` the predicted output's
    tokens and ``predictor`` the drafter that drafts them. ``processor`` changes its target (and draft)
    logits: penalties, logit bias, a grammar (:mod:`verispec.constraints`); ``logprobs`` collects its
    tokens' log-probabilities when its params ask for them.
    """

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecConfig = PLAIN
    handle: RequestHandle | None = None
    on_tokens: OnTokens | None = None
    metrics: Metrics = field(default_factory=Metrics)
    own_drafter: Drafter | None = None
    prediction: list[int] | None = None
    processor: RowLogits | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # The row, while the request holds a slot.
    slot: int | None = None
    generator: torch.Generator | None = None
    drafter: Drafter | None = None
    min_confidence: float = 0.0
    k: int = 0
    # What the k policy knows of it.
    kpolicy: FixedK | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    lookup_acceptance: Acceptance = field(default_factory=Acceptance)
    prediction_acceptance: Acceptance = field(default_factory=Acceptance)
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    governed: bool = False  # the cost policy chose this step's k
    lookup: Acceptance | None = None  # this step's draft is a trusted lookup: what learns from it
    predictor: PredictionDrafter | None = None
    prefilled: bool = False
    done: bool = False
    seq: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.seq = list(self.prompt)

    @property
    def out(self) -> list[int]:
        """The output so far (a copy)."""
        return self.seq[len(self.prompt):]

    @property
    def n_out(self) -> int:
        return len(self.seq) - len(self.prompt)

    @property
    def speculates(self) -> bool:
        return self.drafter is not None
