"""How far to speculate: one k policy for one row or many.

With per-token acceptance a, drafting k tokens yields E[k] = (1 - a^(k+1)) / (1 - a) tokens per step
(Leviathan et al., 2023); a step of B rows padded to the widest k costs what the measured curves say
(:class:`~verispec.engine.costs.CostModel`). The ``cost`` policy picks the k of best expected goodput,
sum of E[k] / step seconds, where it beats plain decoding by :data:`MIN_GAIN`. Two rules more stay
because switching either off on the tune split cost more than the run-to-run spread (docs/results.md):
``lookup_cut`` cuts free lookups (which widen the padded step) where the goodput peaks, valued at the
acceptance their request's lookups reached; ``probes`` lets a plain row draft a short probe now and
then, backing off while probes do not pay, since a plain row learns nothing of its acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.engine.costs import CostModel

# Speculate only where the cost model predicts at least this gain over plain decoding: it leaves out
# each step's bookkeeping and runs on a noisy acceptance estimate.
MIN_GAIN = 0.05
PROBE_EVERY = 8  # plain steps before a row's first probe
PROBE_MAX_EVERY = 64  # the longest wait a row's probes back off to
PROBE_K = 2
PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before a request has shown its own
RULES = ("probes", "lookup_cut", "margin")  # what ``CostPolicy.off`` can switch off for an ablation


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens from one step drafting k tokens with acceptance rate a (bonus included)."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Acceptance:
    """A request's per-token acceptance rate from a prior worth ``prior_weight`` tokens: a step with n of d
    drafts accepted shows n acceptances and, if n < d, one rejection (geometric maximum likelihood;
    later tokens are never judged), decayed by ``decay`` per step so recent steps count most."""

    prior_a: float = PRIOR_ACCEPTANCE
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior_a * self.prior_weight) / (self.accepted + self.rejected + self.prior_weight)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (accepted < drafted)


@dataclass
class ProbeSchedule:
    """When a plain row probes: after ``every`` plain steps, doubling after each probe that did not pay
    (up to ``max_every``), over again once it speculates. A due probe that does not run stays due."""

    every: int = PROBE_EVERY
    max_every: int = PROBE_MAX_EVERY
    gap: int = 0  # 0 until the first wait: every
    streak: int = 0

    def due(self) -> bool:
        self.streak += 1
        return self.streak >= (self.gap or self.every)

    def ran(self) -> None:
        """A probe ran: the wait doubles, undone by :meth:`restart` if speculation then pays."""
        self.gap, self.streak = min(2 * (self.gap or self.every), self.max_every), 0

    def restart(self) -> None:
        self.gap = self.streak = 0


@dataclass
class RowPlan:
    """What the policy knows of one row before a step. ``acceptance`` None: its k is ``fixed_k`` (a fixed
    policy's, or a trusted lookup's valued at ``fixed_rate``, cut only where ``optional``);
    ``model_draft``: the draft model drafts it; ``draft_token_s``: its own drafter's seconds per token."""

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
        if unknown := set(self.off) - set(RULES):
            raise ValueError(f"unknown policy rules {sorted(unknown)} (choose from {', '.join(RULES)})")
        if "margin" in self.off:
            self.min_gain = 0.0

    def choose(self, plans: list[RowPlan], span: int | None = None) -> list[int]:
        """k of every row for the next step (fixed rows keep theirs, each capped by its ``cap``)."""
        ks = [0 if p.acceptance is not None else min(p.fixed_k, p.cap) for p in plans]
        gov = [i for i, p in enumerate(plans) if p.acceptance is not None and p.cap > 0]

        def goodput(drafting: dict[int, int], rates: dict[int, float] | None = None) -> float:
            return self._goodput(plans, ks, drafting, rates or {}, span)

        # Optional lookups are cut at one length (the widest row pads the step) where the goodput
        # peaks; the shorter cut on a tie, 0 a plain step.
        full = {i: k for i, (p, k) in enumerate(zip(plans, ks, strict=True)) if p.optional and k}
        if full and "lookup_cut" not in self.off:
            cut = max(range(max(full.values()) + 1),
                      key=lambda c: (goodput({i: min(f, c) for i, f in full.items()}), -c))
            for i, f in full.items():
                ks[i] = min(f, cut)
        if not gov:
            return ks
        at = {k: {i: min(k, plans[i].cap) for i in gov} for k in range(max(plans[i].cap for i in gov) + 1)}
        k = max(at, key=lambda k: (goodput(at[k]), -k))
        if k and goodput(at[k]) >= (1.0 + self.min_gain) * goodput({}):
            for i in gov:
                ks[i] = at[k][i]
                if plans[i].probes is not None:
                    plans[i].probes.restart()
        else:
            k = 0
            if "probes" not in self.off:
                due = [i for i in gov if plans[i].probes is not None and plans[i].probes.due()]
                probe = {i: min(PROBE_K, plans[i].cap) for i in due}
                # Only if the probes could pay together, at perfect acceptance.
                if probe and goodput(probe, dict.fromkeys(probe, 1.0)) >= \
                        (1.0 + self.min_gain) * goodput({}, dict.fromkeys(probe, 1.0)):
                    for i, kp in probe.items():
                        ks[i] = kp
                        plans[i].probes.ran()
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return ks

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
