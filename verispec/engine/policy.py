"""How far to speculate: choosing k each step.

The ``cost`` policy follows Leviathan et al. (2023): with per-token acceptance rate a, a
step that drafts k tokens yields E[k] = (1 - a^(k+1)) / (1 - a) tokens and costs
k * t_draft + t_verify(k + 1), so the best k maximises E[k] / cost; k = 0 (plain decoding)
wins whenever no k beats 1 / t_verify(1). Costs are profiled at start and refreshed online
from the step timings; a is tracked per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from verispec.config import SpecConfig


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens from one step drafting k tokens with acceptance rate a (bonus included)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class CostModel:
    """Measured seconds: one draft token, and a target forward scoring m tokens (index m - 1)."""

    draft_s: float
    verify_s: list[float]
    smoothing: float = 0.1  # weight of a new observation in the running averages

    def step_s(self, k: int) -> float:
        """Predicted seconds of one step drafting k tokens (k + 1 <= len(verify_s))."""
        return k * self.draft_s + self.verify_s[k]

    def speed(self, a: float, k: int, hit: float = 1.0) -> float:
        """Predicted tokens per second at acceptance a and k drafts per step.

        ``hit`` is the share of steps on which the drafter proposes at all (lookup drafters
        often find no match; such a step is a plain decoding step).
        """
        if k == 0:
            return 1.0 / self.verify_s[0]
        tokens = hit * expected_tokens(a, k) + (1.0 - hit)
        return tokens / (k * self.draft_s + hit * self.verify_s[k] + (1.0 - hit) * self.verify_s[0])

    def speedup(self, a: float, k: int, hit: float = 1.0) -> float:
        """Predicted speedup over plain decoding."""
        return self.speed(a, k, hit) * self.verify_s[0]

    def best_k(self, a: float, k_max: int) -> int:
        return max(range(k_max + 1), key=lambda k: (self.speed(a, k), -k))

    def observe(self, k: int, drafted: int, propose_s: float, score_s: float) -> None:
        """Fold one step's timings in. The verification curve keeps its profiled shape and only
        its level follows what steps measure: a policy sticking to one k would otherwise never
        correct the entries of the k it does not try."""
        w = self.smoothing
        if drafted:
            self.draft_s += w * (propose_s / drafted - self.draft_s)
        scale = 1.0 + w * (score_s / self.verify_s[k] - 1.0)
        self.verify_s = [t * scale for t in self.verify_s]


class KPolicy(ABC):
    """Chooses k before each step and learns from what the step accepted."""

    @abstractmethod
    def choose(self, k_cap: int) -> int:
        """k for the next step, at most ``k_cap``."""

    def update(self, k: int, drafted: int, accepted: int, propose_s: float, score_s: float) -> None:  # noqa: B027
        """What the last step drafted, accepted and cost."""


@dataclass
class FixedK(KPolicy):
    k: int

    def choose(self, k_cap: int) -> int:
        return min(self.k, k_cap)


@dataclass
class HeuristicK(KPolicy):
    """Grow k after a fully accepted step, shrink it after a rejection (as transformers' assisted generation)."""

    k: int
    k_max: int
    k_min: int = 1

    def choose(self, k_cap: int) -> int:
        return min(self.k, k_cap)

    def update(self, k: int, drafted: int, accepted: int, propose_s: float, score_s: float) -> None:
        if drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(self.k_min, self.k - 1)


@dataclass
class CostK(KPolicy):
    """Pick the k that maximises predicted tokens/s; k = 0 when speculation does not pay.

    Acceptance is estimated with a prior worth ``prior_weight`` draft tokens, so the first
    steps neither trust one lucky step nor give up after one bad one. While k = 0 nothing is
    learned about acceptance, so every ``probe_every`` plain steps one small probe step runs.
    """

    costs: CostModel
    k_max: int
    prior_a: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.9  # per step: recent behaviour matters more than the prompt's start
    probe_every: int = 8
    probe_k: int = 2
    _drafted: float = 0.0
    _accepted: float = 0.0
    _plain_streak: int = 0
    chosen: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return (self._accepted + self.prior_a * self.prior_weight) / (self._drafted + self.prior_weight)

    def choose(self, k_cap: int) -> int:
        k = self.costs.best_k(self.acceptance, min(self.k_max, k_cap))
        if k == 0:
            self._plain_streak += 1
            if self._plain_streak >= self.probe_every:
                self._plain_streak = 0
                k = min(self.probe_k, k_cap)
        else:
            self._plain_streak = 0
        self.chosen.append(k)
        return k

    def update(self, k: int, drafted: int, accepted: int, propose_s: float, score_s: float) -> None:
        if drafted:
            self._drafted = self.decay * self._drafted + drafted
            self._accepted = self.decay * self._accepted + accepted
        self.costs.observe(k, drafted, propose_s, score_s)


def make_policy(spec: SpecConfig, costs: CostModel | None) -> KPolicy:
    """The policy ``spec.k_policy`` names; ``spec.k`` is the fixed k or the upper bound."""
    if spec.k_policy == "heuristic":
        return HeuristicK(k=min(spec.k, 4), k_max=spec.k)
    if spec.k_policy == "cost" and costs is not None:
        return CostK(costs, k_max=spec.k)
    return FixedK(spec.k)  # "fixed" and "confidence" (the drafter stops early by itself)
