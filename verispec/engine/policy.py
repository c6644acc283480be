"""How far to speculate: choosing k each step.

The ``cost`` policy follows Leviathan et al. (2023): with per-token acceptance rate a, a
step that drafts k tokens yields E[k] = (1 - a^(k+1)) / (1 - a) tokens and costs
k * t_draft + t_verify(k + 1), so the best k maximises E[k] / cost; k = 0 (plain decoding)
wins whenever no k beats 1 / t_verify(1). Costs are profiled at start and refreshed online
from the step timings; a is tracked per request.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from verispec.config import SpecConfig

# Speculate only where the cost model predicts at least this gain over plain decoding. The model
# leaves out each step's bookkeeping and runs on a noisy acceptance estimate, so a predicted gain
# of a few percent is a coin flip that still pays for draft forwards (and, for a request whose
# draft has not read its prompt yet, a draft prefill).
MIN_GAIN = 0.05
# Plain steps before a policy at k = 0 probes acceptance again, for one request and for a batch
# alike: at one client the batch policy must make the single-request engine's choices, and a wait
# of 16 there, with the draft lagging further each plain step, left too few tokens of a 48-token
# answer to win the probe's catch-up back, so a request whose drafts paid (acceptance near 0.9)
# was never probed. The back-off and a batch's plausible-acceptance bound keep busy batches from
# probing where it cannot pay.
PROBE_EVERY = 8
# The widest k a cost model is profiled for when nobody asks for more: what a first use of the
# cost policy measures (a request's k never sizes a profile that others would wait for). A larger
# k is priced by extending the measured curve (see CostModel.score_s and CostCurve).
PROFILE_K = 8


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens from one step drafting k tokens with acceptance rate a (bonus included)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class ContextCost:
    """What a longer context adds to a forward: seconds per scored token (target) or per draft token
    (draft) for each position of context beyond the ``context`` the cost curves were measured at.

    Without it a cost model profiled at a short context is blind to where requests spend most
    steps: 16 clients near 1000-token contexts drafted on steps that cost twice their prediction,
    because the slower plain steps looked like noise on the plain width alone.
    """

    context: int = 0
    target_s: float = 0.0
    draft_s: float = 0.0

    def __post_init__(self) -> None:
        if self.context < 0 or self.target_s < 0 or self.draft_s < 0:
            raise ValueError("context and the per-position costs must be >= 0")

    def target(self, tokens: int, context: int) -> float:
        """Seconds ``tokens`` scored tokens pay for attending to ``context`` positions, beyond the profiled ones."""
        return tokens * max(0, context - self.context) * self.target_s

    def draft(self, tokens: int, context: int) -> float:
        """The same for ``tokens`` draft tokens (or rows of a lockstep draft forward)."""
        return tokens * max(0, context - self.context) * self.draft_s


def per_position_s(short: dict[tuple[int, int], float], long: dict[tuple[int, int], float], context: int,
                   long_context: int) -> float:
    """Seconds per scored token per position of context, from forwards of B rows x m tokens (the keys)
    timed at ``context`` (``short``) and at ``long_context`` (``long``): the median over shapes, never
    below 0 (noise on a shared host can make one long forward faster than its short twin)."""
    if long_context <= context or not long:
        return 0.0
    slopes = [(long[b, m] - short[b, m]) / (b * m * (long_context - context)) for b, m in long]
    return max(0.0, statistics.median(slopes))


@dataclass
class CostModel:
    """Measured seconds: one draft token, and a target forward scoring m tokens (index m - 1), both at
    ``per_position.context`` positions; longer contexts add :class:`ContextCost`'s terms."""

    draft_s: float
    verify_s: list[float]
    catch_up_per_token_s: float = 0.0  # the drafter reading context it has not seen (a draft prefill)
    smoothing: float = 0.1  # weight of a new observation in the running averages
    per_position: ContextCost = field(default_factory=ContextCost)

    def catch_up_s(self, tokens: int) -> float:
        """Predicted seconds for the drafter to read ``tokens`` tokens of context before drafting."""
        return tokens * self.catch_up_per_token_s

    def draft_token_s(self, context: int = 0) -> float:
        """Predicted seconds of one draft token at ``context`` positions."""
        return self.draft_s + self.per_position.draft(1, context)

    def score_s(self, m: int, context: int = 0) -> float:
        """Predicted seconds of a target forward scoring ``m`` tokens at ``context`` positions."""
        return self._verify(m) + self.per_position.target(m, context)

    def _verify(self, m: int) -> float:
        """The profiled seconds of scoring ``m`` tokens; past the profiled widths the curve goes on at its
        last segment's slope (never falling), so a k wider than the profile is priced, not re-profiled."""
        n = len(self.verify_s)
        if m <= n:
            return self.verify_s[m - 1]
        slope = max(0.0, self.verify_s[-1] - self.verify_s[-2]) if n > 1 else 0.0
        return self.verify_s[-1] + slope * (m - n)

    def step_s(self, k: int, context: int = 0) -> float:
        """Predicted seconds of one step drafting k tokens."""
        return k * self.draft_token_s(context) + self.score_s(k + 1, context)

    def speed(self, a: float, k: int, hit: float = 1.0, context: int = 0) -> float:
        """Predicted tokens per second at acceptance a and k drafts per step, at ``context`` positions.

        ``hit`` is the share of steps on which the drafter proposes at all (lookup drafters
        often find no match; such a step is a plain decoding step).
        """
        plain_s = self.score_s(1, context)
        if k == 0:
            return 1.0 / plain_s
        tokens = hit * expected_tokens(a, k) + (1.0 - hit)
        return tokens / (k * self.draft_token_s(context) + hit * self.score_s(k + 1, context) + (1.0 - hit) * plain_s)

    def speedup(self, a: float, k: int, hit: float = 1.0, context: int = 0) -> float:
        """Predicted speedup over plain decoding."""
        return self.speed(a, k, hit, context) * self.score_s(1, context)

    def best_k(self, a: float, k_max: int, min_gain: float = 0.0, context: int = 0) -> int:
        """The k with the highest predicted speed; 0 unless it beats plain decoding by ``min_gain``."""
        k = max(range(k_max + 1), key=lambda k: (self.speed(a, k, context=context), -k))
        return k if self.speed(a, k, context=context) >= (1.0 + min_gain) * self.speed(a, 0, context=context) else 0

    def observe(self, k: int, drafted: int, propose_s: float, score_s: float, context: int = 0) -> None:
        """Fold one step's timings at ``context`` positions in; what the context explains is not learned.
        The verification curve keeps its profiled shape and only its level follows what steps
        measure: a policy sticking to one k would otherwise never correct the entries of the k it
        does not try."""
        w = self.smoothing
        if drafted:
            measured = propose_s / drafted - self.per_position.draft(1, context)
            self.draft_s += w * (measured - self.draft_s)
        measured = score_s - self.per_position.target(k + 1, context)
        scale = 1.0 + w * (measured / self._verify(k + 1) - 1.0)
        self.verify_s = [t * scale for t in self.verify_s]


class KPolicy(ABC):
    """Chooses k before each step and learns from what the step accepted."""

    @abstractmethod
    def choose(self, k_cap: int, remaining: int | None = None, catch_up: int = 0, context: int = 0) -> int:
        """k for the next step, at most ``k_cap``.

        ``remaining`` is how many tokens the request is expected to still generate (at most what
        its limits allow; see :class:`AnswerLengths`); ``catch_up`` how many tokens of context
        the drafter has yet to read before it can draft; ``context`` how many tokens the sequence
        holds (policies may ignore all three).
        """

    def update(self, k: int, drafted: int, accepted: int, propose_s: float, score_s: float) -> None:  # noqa: B027
        """What the last step drafted, accepted and cost."""


@dataclass
class FixedK(KPolicy):
    k: int

    def choose(self, k_cap: int, remaining: int | None = None, catch_up: int = 0, context: int = 0) -> int:
        return min(self.k, k_cap)


@dataclass
class HeuristicK(KPolicy):
    """Grow k after a fully accepted step, shrink it after a rejection (as transformers' assisted generation)."""

    k: int
    k_max: int
    k_min: int = 1

    def choose(self, k_cap: int, remaining: int | None = None, catch_up: int = 0, context: int = 0) -> int:
        return min(self.k, k_cap)

    def update(self, k: int, drafted: int, accepted: int, propose_s: float, score_s: float) -> None:
        if drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(self.k_min, self.k - 1)


@dataclass
class Acceptance:
    """A drafter's per-token acceptance rate a, estimated online with a prior.

    A step that drafted d tokens and had the first n accepted shows n accepted tokens and, when
    n < d, one rejection; the tokens after a rejection are never judged. Counting them as
    failures (accepted / drafted) would read a = 0.9 at k = 5 as 0.74 and make a policy
    under-draft exactly where drafting pays most, so the estimate is the geometric maximum
    likelihood: accepted / (accepted + rejections). The prior is worth ``prior_weight`` judged
    tokens; ``decay`` per step lets recent behaviour outweigh the start of a request.
    """

    prior_a: float = 0.6
    prior_weight: float = 2.0  # small: a policy at k = 0 learns only from occasional 2-token probes
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
class AcceptanceSpread:
    """How much acceptance differs from one request to the next, for one drafter.

    A probe asks whether speculation could pay at the best acceptance the batch plausibly has.
    One request's acceptance ranges widely (code near 0.9, open chat far lower), so for a lone
    request that bound is near 1; the mean over B requests varies by only sd / sqrt(B), so a
    full batch whose drafter has a modest record cannot plausibly reach a high mean, and probing
    it only costs (at 8 clients on a CPU, a step three tokens wide over eight rows). ``sd`` is the
    standard deviation of finished requests' rates once ``min_requests`` have drafted, else
    ``prior_sd``.
    """

    prior_sd: float = 0.25
    min_requests: int = 8
    window: int = 64
    rates: deque = field(init=False)
    sd: float = field(init=False)  # kept current by add(): every decode step reads it for every row

    def __post_init__(self) -> None:
        self.rates = deque(maxlen=self.window)
        self.sd = self.prior_sd

    def add(self, acceptance: Acceptance) -> None:
        """Record a finished request's acceptance, if it drafted enough to show one."""
        judged = acceptance.accepted + acceptance.rejected
        if judged < 2:
            return
        self.rates.append(acceptance.accepted / judged)
        if len(self.rates) >= self.min_requests:
            self.sd = statistics.stdev(self.rates)


@dataclass
class AnswerLengths:
    """How long recent answers ran, to estimate how many tokens a running request will still produce.

    The cost policy weighs a one-off cost (a model drafter reading the prompt) against what
    speculation saves per token. ``max_tokens`` overstates the tokens left when answers usually
    end at EOS well before it (translations, short QA), so the estimate is the mean remaining
    length of recent answers that ran longer than this one has so far. An answer cut by its token
    limit only says it would have run at least that long: it counts as running to the limit.
    """

    window: int = 64
    recent: deque = field(init=False)  # (length, cut by its limit), the latest ``window``

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window)

    def add(self, length: int, cut: bool) -> None:
        self.recent.append((length, cut))

    def expected_remaining(self, generated: int, limit_left: int) -> int:
        """Expected tokens still to come after ``generated``, at most ``limit_left``."""
        left = [limit_left if cut else min(n - generated, limit_left) for n, cut in self.recent if n > generated]
        if not left:
            return limit_left
        return max(1, round(sum(left) / len(left)))


@dataclass
class ProbeSchedule:
    """When a policy that chose plain decoding takes a probe step instead, to look at acceptance again.

    The first probe comes after ``every`` plain steps. A probe after which the policy still finds
    speculation not worth it doubles the wait, up to ``max_every``: a request (or a batch) whose
    drafts keep failing stops paying for looks that change nothing (at 8 clients the batch ran 7-9
    probes in 181 steps and no other speculation). Choosing to speculate starts over at ``every``.
    """

    every: int = 8
    max_every: int = 64
    _gap: int = 0  # 0: every
    _streak: int = 0
    _probed: bool = False

    @property
    def gap(self) -> int:
        """Plain steps before the next probe."""
        return self._gap or self.every

    def due(self) -> bool:
        """The policy chose plain decoding for this step: True where it should probe instead.

        A due probe that does not run (:meth:`ran` not called: no request could win its draft's
        catch-up back) stays due until one does. Starting the wait over instead locked one client
        into plain decoding once the wait had grown past an answer's length: the probe fell due
        late in a request, whose few remaining tokens could not pay for a probe, and the next
        request waited the whole gap again.
        """
        if self._probed:  # the last probe did not make speculation pay
            self._gap, self._probed = min(2 * self.gap, self.max_every), False
        self._streak += 1
        return self._streak >= self.gap

    def ran(self) -> None:
        """A probe step runs now."""
        self._probed, self._streak = True, 0

    def restart(self) -> None:
        """Start the wait over at ``every``: the policy chose to speculate, or what the back-off
        learned no longer applies."""
        self._streak, self._gap, self._probed = 0, 0, False


@dataclass
class CostK(KPolicy):
    """Pick the k that maximises predicted tokens/s; k = 0 when speculation does not pay.

    ``acceptance`` starts from a prior (the engine passes what this drafter achieved on earlier
    requests), so the first steps neither trust one lucky step nor give up after one bad one.
    While k = 0 nothing is learned about acceptance, so after ``probe_every`` plain steps one
    small probe step runs, unless even perfect acceptance could not pay; probes that change
    nothing come ever more rarely (:class:`ProbeSchedule`).

    A model drafter that has not yet read the prompt must first catch up on it (a prefill of
    the draft): the choice weighs that one-off cost against what speculation would save over
    the tokens the request is expected to still generate, so a long prompt with a short answer
    (RAG) stays plain rather than paying for a draft prefill it cannot win back.
    """

    costs: CostModel
    k_max: int
    acceptance: Acceptance = field(default_factory=Acceptance)
    probe_every: int = PROBE_EVERY
    probe_k: int = 2
    min_gain: float = MIN_GAIN  # the predicted gain over plain decoding that speculating must show
    _catch_up: int = 0
    _context: int = 0
    chosen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.probes = ProbeSchedule(self.probe_every, 8 * self.probe_every)

    def choose(self, k_cap: int, remaining: int | None = None, catch_up: int = 0, context: int = 0) -> int:
        """``remaining``: tokens the request is expected to produce; ``catch_up``: tokens to read first;
        ``context``: tokens the sequence holds (a longer context makes every scored token dearer)."""
        self._catch_up, self._context = catch_up, context
        a = self.acceptance.rate
        k = self.costs.best_k(a, min(self.k_max, k_cap), self.min_gain, context)
        if k > 0 and not self._worth_catching_up(a, k, remaining, catch_up, context):
            k = 0
        if k == 0:
            if self.probes.due():
                # Only where drafting could pay at all: perfect acceptance beats plain decoding by
                # the margin a choice demands and wins back what the drafter must read first.
                probe = min(self.probe_k, k_cap)
                if probe and self.costs.speed(1.0, probe, context=context) >= \
                        (1.0 + self.min_gain) * self.costs.speed(1.0, 0, context=context) and \
                        self._worth_catching_up(1.0, probe, remaining, catch_up, context):
                    k = probe
                    self.probes.ran()
        else:
            self.probes.restart()  # choosing to speculate starts the wait over
        self.chosen.append(k)
        return k

    def _worth_catching_up(self, a: float, k: int, remaining: int | None, catch_up: int, context: int) -> bool:
        if catch_up <= 0 or remaining is None:
            return True
        saved_per_token = self.costs.score_s(1, context) - 1.0 / self.costs.speed(a, k, context=context)
        return saved_per_token * remaining > self.costs.catch_up_s(catch_up)

    def update(self, k: int, drafted: int, accepted: int, propose_s: float, score_s: float) -> None:
        self.acceptance.update(drafted, accepted)
        # A step that began with the drafter reading a long context (a probe after plain steps)
        # says nothing about the cost of one draft token: counting it would make drafting look
        # many times dearer than it is and keep the policy plain for good.
        self.costs.observe(k, 0 if self._catch_up > 1 else drafted, propose_s, score_s, self._context)


def make_policy(spec: SpecConfig, costs: CostModel | None, prior_a: float | None = None) -> KPolicy:
    """The policy ``spec.k_policy`` names; ``spec.k`` is the fixed k or the upper bound.

    ``prior_a`` seeds the cost policy's acceptance estimate (e.g. from earlier requests).
    """
    if spec.k_policy == "heuristic":
        return HeuristicK(k=min(spec.k, 4), k_max=spec.k)
    if spec.k_policy == "cost" and costs is not None:
        return CostK(costs, k_max=spec.k, acceptance=Acceptance() if prior_a is None else Acceptance(prior_a))
    return FixedK(spec.k)  # "fixed" and "confidence" (the drafter stops early by itself)
