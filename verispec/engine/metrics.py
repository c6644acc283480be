"""What a generation measured: acceptance, steps and time per stage."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from verispec.engine.step import StepReport

STAGES = ("prefill", "propose", "score", "verify")


def sync(device: torch.device | None = None) -> None:
    """Wait for queued GPU work, so a host clock charges it to the stage that launched it.

    Kernel launches return at once on CUDA: without this, a forward's time would land in
    whichever later stage first reads its result. A no-op where CUDA was never used.
    """
    if torch.cuda.is_initialized() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)


def seconds_of(run: Callable[[], object], device: torch.device, reps: int, warmup: int = 1,
               budget_s: float | None = None) -> list[float]:
    """Seconds of each of ``reps`` calls of ``run`` (GPU work included), after ``warmup`` untimed ones.

    With ``budget_s``, timing stops early once the timed calls add up to that many seconds (one is
    always timed): on a slow host a shape's first runs already say what it costs, and profiling at
    full repetition would keep a server from ready for minutes.
    """
    times: list[float] = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
        if budget_s is not None and i >= warmup and sum(times[warmup:]) >= budget_s:
            break
    return times[warmup:]


def mean_accepted_length(steps: int, accepted: int) -> float:
    """Tokens per target forward over ``steps`` steps that accepted ``accepted`` drafts (0 without steps).

    Each step yields its accepted drafts and one token of the target's, whatever a stop condition
    then cuts (see :class:`Metrics`).
    """
    return (steps + accepted) / steps if steps else 0.0


@dataclass
class Metrics:
    """Counters of one request, or of many merged with :meth:`merge`.

    ``steps`` counts target forwards after prefill; ``mean_accepted_length`` is Spec-Bench's
    "mean accepted tokens": tokens produced per target forward, bonus token included, so plain
    decoding scores exactly 1.0. Every step produces its accepted drafts plus one token of the
    target's, including a step whose token is the EOS (which is not output, so not counted in
    ``generated_tokens``) or whose tokens run past a stop string: hence ``1 + accepted / steps``,
    not ``generated_tokens / steps``. ``prefix_reused_tokens`` are prompt tokens whose target K/V an
    earlier request left in the cache, so they were not prefilled (:mod:`verispec.engine.prefix`).
    """

    requests: int = 0
    prompt_tokens: int = 0
    prefix_reused_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    k_chosen: dict[int, int] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    total_s: float = 0.0
    ttft_s: float = 0.0  # summed over requests; see mean_ttft_s
    # Predicted outputs: drafted tokens of the prediction that verification kept / threw away.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Seconds spent processing logits (grammar masks, penalties; part of the stages' time, not beside it).
    constrain_s: float = 0.0

    def record_step(self, k: int, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.k_chosen[k] = self.k_chosen.get(k, 0) + 1
        # Both lists cover every drafted position, so they always have the same length.
        for counts in (self.drafted_by_position, self.accepted_by_position):
            counts.extend([0] * (drafted - len(counts)))
        for i in range(drafted):
            self.drafted_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.steps, self.accepted)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second outside the prompt's prefill (what a decoding method changes)."""
        rest = self.total_s - self.stage_s["prefill"]
        return self.generated_tokens / rest if rest > 0 else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return self.ttft_s / self.requests if self.requests else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)]

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - sum(self.stage_s.values()))

    def merge(self, other: Metrics) -> Metrics:
        """Add ``other``'s counts into this one (returns self)."""
        for name in ("requests", "prompt_tokens", "prefix_reused_tokens", "generated_tokens", "steps", "drafted",
                     "accepted", "total_s", "ttft_s", "accepted_prediction_tokens", "rejected_prediction_tokens",
                     "constrain_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_by_position, other.drafted_by_position),
                             (self.accepted_by_position, other.accepted_by_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, c in enumerate(theirs):
                mine[i] += c
        for k, c in other.k_chosen.items():
            self.k_chosen[k] = self.k_chosen.get(k, 0) + c
        for s, t in other.stage_s.items():
            self.stage_s[s] = self.stage_s.get(s, 0.0) + t
        return self

    def summary(self) -> dict[str, Any]:
        """All counters plus the derived rates, as plain JSON-able values."""
        d = asdict(self)
        d["stage_s"]["other"] = self.other_s
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 tokens_per_s=self.tokens_per_s, mean_ttft_s=self.mean_ttft_s,
                 acceptance_by_position=self.acceptance_by_position)
        return d


@dataclass
class EngineStats:
    """Engine-wide counters of an :class:`~verispec.engine.engine.Engine`: what its steps did.

    ``width_steps`` counts steps by padded width (k + 1 of the widest row), ``policy_k`` the k the
    concurrency-aware policy chose, ``rows_steps`` steps by number of rows. ``prefix_hits`` counts
    admitted requests that kept part of their slot's cached KV, ``prefix_reused_tokens`` the prompt
    positions of the target they did not prefill, ``prefix_draft_reused_tokens`` those the draft
    model did not read (:mod:`verispec.engine.prefix`). Finished requests' own :class:`Metrics` are
    merged into ``requests``.
    """

    steps: int = 0
    step_s: float = 0.0
    scored_tokens: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    catch_up_tokens: int = 0  # context the draft model read on its own (new rows' prompts, plain stretches)
    catch_up_s: float = 0.0
    prefix_hits: int = 0
    prefix_reused_tokens: int = 0
    prefix_draft_reused_tokens: int = 0
    rows_steps: dict[int, int] = field(default_factory=dict)
    width_steps: dict[int, int] = field(default_factory=dict)
    policy_k: dict[int, int] = field(default_factory=dict)
    requests: Metrics = field(default_factory=Metrics)

    def record(self, report: StepReport, policy_k: int | None) -> None:
        self.steps += 1
        self.step_s += report.propose_s + report.score_s + report.verify_s
        self.scored_tokens += report.scored_tokens
        self.catch_up_tokens += report.catch_up_tokens
        self.catch_up_s += report.catch_up_s
        self.rows_steps[report.rows] = self.rows_steps.get(report.rows, 0) + 1
        self.width_steps[report.width] = self.width_steps.get(report.width, 0) + 1
        if policy_k is not None:
            self.policy_k[policy_k] = self.policy_k.get(policy_k, 0) + 1

    @property
    def mean_rows(self) -> float:
        """Rows per step, over all steps (0 without steps)."""
        return sum(b * c for b, c in self.rows_steps.items()) / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, Any]:
        """Plain JSON-able counters (the merged request metrics under ``requests``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"}
        d["mean_rows"] = self.mean_rows
        d["requests"] = self.requests.summary()
        return d
