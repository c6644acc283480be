"""How far to speculate: one k policy for one row or many.

With per-token acceptance a, a row drafting k tokens yields E[k] = (1 - a^(k+1)) / (1 - a) tokens
per step (Leviathan et al., 2023). A step of B rows padded to the widest k costs what the
measured curves say (:class:`~verispec.engine.costs.CostModel`: lockstep draft forwards, one
target forward scoring B x (k + 1) tokens, and the context they attend to). The ``cost`` policy
picks the k with the best expected goodput, sum of E[k] over rows / step seconds, and drafts only
where that beats plain decoding by :data:`MIN_GAIN`. One row is the B = 1 case of the same rule.

A free draft (a trusted prompt lookup) costs no draft time, but its row widens the step, and every
row of a padded forward is scored at the widest row's k + 1. Every prefix of a lookup is a draft
too, so a cost policy's lookups are cut where the step's goodput peaks, each valued at the
acceptance its request's lookups have reached (above 0.8 per token where an answer copies an
edited function, well above a draft model's): a 16-token lookup is drafted whole where it keeps
being accepted and the verify curve is flat, cut to a few tokens where scoring is steep, dropped
for a plain step among many rows on a compute-bound host.

One more rule, for what the goodput of one step does not show: while a row decodes plainly nothing
is learned about its acceptance, so every row has its own :class:`ProbeSchedule`: after a few plain
steps it drafts a short probe, if perfect acceptance could pay. Probes that change nothing come more
rarely, up to a bound, so no request is ever locked into plain decoding, and a new request starts
with a fresh schedule and the prior.

Each rule beyond the argmax of goodput stays because switching it off on the tune split cost more
than the run-to-run spread (``CostPolicy.off`` switches them off for that ablation; docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.config import SpecConfig
from verispec.engine.costs import CostModel

# Speculate only where the cost model predicts at least this gain over plain decoding: the model
# leaves out each step's bookkeeping and runs on a noisy acceptance estimate.
MIN_GAIN = 0.05
PROBE_EVERY = 8  # plain steps before a row's first probe
PROBE_MAX_EVERY = 64  # the longest wait a row's probes back off to
PROBE_K = 2
PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before a request has shown its own
# The policy's rules beyond the argmax of goodput, each of which an ablation can switch off
# (``CostPolicy.off``): probes of plain rows, cutting lookups at the goodput peak, the MIN_GAIN margin.
RULES = ("probes", "lookup_cut", "margin")


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens from one step drafting k tokens with acceptance rate a (bonus included)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Acceptance:
    """A request's per-token acceptance rate a, estimated online from a prior.

    A step that drafted d tokens and had the first n accepted shows n accepted tokens and, when
    n < d, one rejection; the tokens after a rejection are never judged, so the estimate is the
    geometric maximum likelihood accepted / (accepted + rejections), not accepted / drafted. The
    prior is worth ``prior_weight`` judged tokens; ``decay`` per step lets recent steps outweigh
    the start of a request.
    """

    prior_a: float = PRIOR_ACCEPTANCE
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior_a * self.prior_weight) / (
            self.accepted + self.rejected + self.prior_weight)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (accepted < drafted)


@dataclass
class ProbeSchedule:
    """When a plainly decoding row drafts a probe: after ``every`` plain steps, the wait doubling after
    each probe that did not make speculation pay, up to ``max_every``; choosing to speculate starts
    it over. A due probe that does not run (it could not pay) stays due."""

    every: int = PROBE_EVERY
    max_every: int = PROBE_MAX_EVERY
    gap: int = 0  # 0 until the first wait: every
    streak: int = 0
    probed: bool = False

    def due(self) -> bool:
        """This row decodes plainly this step: True where it should probe instead."""
        if self.probed:  # the last probe did not make speculation pay
            self.gap, self.probed = min(2 * (self.gap or self.every), self.max_every), False
        self.streak += 1
        return self.streak >= (self.gap or self.every)

    def ran(self) -> None:
        self.probed, self.streak = True, 0

    def restart(self) -> None:
        self.gap, self.streak, self.probed = 0, 0, False


@dataclass
class RowPlan:
    """What the policy knows of one row before a step.

    ``acceptance`` None: the row's k is ``fixed_k`` (a fixed or heuristic k policy, or a trusted
    lookup), valued at acceptance ``fixed_rate`` (a lookup's: what its request's lookups reached),
    which the policy may cut shorter (to 0 at the least) only where ``optional`` (a cost-policy
    request's free lookup). ``model_draft``: it drafts with the shared draft model (lockstep
    forwards); ``draft_token_s``: seconds per token its own drafter spends (layer-skip; lookups 0);
    ``probes``: when it probes while the policy keeps it plain.
    """

    cap: int
    acceptance: float | None = None
    fixed_k: int = 0
    optional: bool = False
    fixed_rate: float = PRIOR_ACCEPTANCE
    model_draft: bool = False
    draft_token_s: float = 0.0
    probes: ProbeSchedule | None = None


@dataclass
class CostPolicy:
    """The ``cost`` k policy: one k for the governed rows of a step, by expected goodput (see the module)."""

    costs: CostModel
    min_gain: float = MIN_GAIN
    chosen: dict[int, int] = field(default_factory=dict)  # k -> steps it was chosen for governed rows
    off: frozenset[str] = frozenset()  # rules switched off (:data:`RULES`), for ablations

    def __post_init__(self) -> None:
        unknown = set(self.off) - set(RULES)
        if unknown:
            raise ValueError(f"unknown policy rules {sorted(unknown)} (choose from {', '.join(RULES)})")
        if "margin" in self.off:
            self.min_gain = 0.0

    def choose(self, plans: list[RowPlan], span: int | None = None) -> list[int]:
        """k of every row for the next step (fixed rows keep theirs, each capped by its ``cap``)."""
        ks = [0 if p.acceptance is not None else min(p.fixed_k, p.cap) for p in plans]
        governed = [i for i, p in enumerate(plans) if p.acceptance is not None and p.cap > 0]
        rates = {i: plans[i].acceptance for i in governed}
        # Optional lookups are cut at one length (padding makes the widest row count), where the
        # step's goodput at each row's lookup acceptance peaks; the shorter cut on a tie, 0 a plain step.
        full = {i: k for i, (p, k) in enumerate(zip(plans, ks, strict=True)) if p.optional and k}
        if full and "lookup_cut" not in self.off:
            cut = max(range(max(full.values()) + 1), key=lambda c: (
                self._goodput(plans, ks, {i: min(f, c) for i, f in full.items()}, rates, span), -c))
            for i, f in full.items():
                ks[i] = min(f, cut)
        if not governed:
            return ks
        joined, k = self._paying(plans, ks, governed, rates, span)
        if k > 0:
            for i in governed:
                if plans[i].probes is not None:
                    plans[i].probes.restart()
                if i in joined:
                    ks[i] = min(k, plans[i].cap)
        elif "probes" not in self.off:
            due = [i for i in governed if plans[i].probes is not None and plans[i].probes.due()]
            probe = {i: min(PROBE_K, plans[i].cap) for i in due}
            # Only if the probes could pay together, at perfect acceptance.
            if probe and self._pays(plans, ks, probe, dict.fromkeys(probe, 1.0), span):
                for i, kp in probe.items():
                    ks[i] = kp
                    plans[i].probes.ran()
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return ks

    def _paying(self, plans: list[RowPlan], ks: list[int], governed: list[int], rates: dict[int, float],
                span: int | None) -> tuple[list[int], int]:
        """The governed rows and the best k for them, or no rows and 0 where no k beats plain by the margin."""
        best = max(range(max(plans[i].cap for i in governed) + 1), key=lambda k: (
            self._goodput(plans, ks, self._at(plans, governed, k), rates, span), -k))
        if best == 0 or not self._pays(plans, ks, self._at(plans, governed, best), rates, span):
            return [], 0
        return governed, best

    @staticmethod
    def _at(plans: list[RowPlan], rows: list[int], k: int) -> dict[int, int]:
        return {i: min(k, plans[i].cap) for i in rows}

    def _goodput(self, plans: list[RowPlan], ks: list[int], drafting: dict[int, int], rates: dict[int, float],
                 span: int | None) -> float:
        """Predicted tokens per second of the step if rows ``drafting`` draft their k (the others ``ks``)."""
        tokens, width, draft_k, own_s = 0.0, 0, 0, 0.0
        for i, p in enumerate(plans):
            k = drafting.get(i, ks[i])
            a = rates.get(i, p.acceptance if p.acceptance is not None else p.fixed_rate)
            tokens += expected_tokens(a, k) if k > 0 else 1.0
            width = max(width, k)
            if p.model_draft:
                draft_k = max(draft_k, k)
            own_s += k * p.draft_token_s
        return tokens / (self.costs.step_s(span or len(plans), width, draft_k) + own_s)

    def _pays(self, plans: list[RowPlan], ks: list[int], drafting: dict[int, int], rates: dict[int, float],
              span: int | None) -> bool:
        return self._goodput(plans, ks, drafting, rates, span) >= \
            (1.0 + self.min_gain) * self._goodput(plans, ks, {}, rates, span)


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
    if spec.k_policy == "heuristic":
        return HeuristicK(k=min(spec.k, 4), k_max=spec.k)
    return FixedK(spec.k)
