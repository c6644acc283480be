"""Concurrency-aware speculation: choose k for a whole batch from a cost curve of the target forward.

One request alone is memory-bound: scoring k + 1 tokens costs about as much as scoring one, so
speculation is nearly free. A batch of B rows scores B * (k + 1) tokens per step; once that
product passes the point where the GPU (or CPU) becomes compute-bound, each extra draft position
costs real time for every row, and from some B on no k beats plain decoding. The policy therefore
models a step's time as

    step_s(B, k) = k * draft_s(B) + target_s(B * (k + 1))

with ``target_s`` a measured curve of seconds against scored tokens (plus, for each scored token,
a measured cost per position of context it attends to beyond the profiled one), and picks the k maximising
expected batch goodput ``sum_rows E[tokens_row(k)] / step_s`` (Leviathan et al.'s E[tokens] per
row, from each row's own acceptance estimate). Rows that fix their own k (``k_policy`` other than
``cost``) keep it; the padded width is the largest k of the batch, which the model accounts for.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, replace

import torch

from verispec.engine.metrics import seconds_of
from verispec.engine.policy import MIN_GAIN, PROBE_EVERY, ContextCost, ProbeSchedule, expected_tokens, per_position_s
from verispec.models.llama import Transformer

# A probe asks whether speculation could pay at the best acceptance the batch plausibly has: its
# rows' estimates plus this many standard deviations of a mean over that many requests.
PLAUSIBLE_SDS = 2.0


@dataclass
class CostCurve:
    """Seconds of one forward against the tokens it processes: piecewise linear through measured points.

    Beyond the last point the curve extends at the last segment's slope (it never falls). It is
    read through the least-squares non-decreasing fit of the points (isotonic regression), so a
    noisy measurement cannot make more work look cheaper, and one slow outlier is averaged with
    its neighbours instead of lifting every larger size to its height (as a running maximum would:
    one spike at 3 tokens then priced every k >= 2 of a lone request as dear as it, and the policy
    drafted one token where five paid).
    """

    points: dict[int, float]
    smoothing: float = 0.1  # weight of a new observation; 0 freezes the curve

    def __call__(self, tokens: int) -> float:
        xs = sorted(self.points)
        ys = monotone_fit([self.points[x] for x in xs])
        if tokens <= xs[0]:
            return ys[0]
        i = bisect_left(xs, tokens)
        if i == len(xs):
            if len(xs) == 1:
                return ys[0] * tokens / xs[0]
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (tokens - xs[-1])
        if xs[i] == tokens:
            return ys[i]
        w = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold one measured forward into the curve.

        Only profiled points learn: an observation between two of them corrects both, each by
        its interpolation weight; one outside the profiled range is ignored (a lone point there
        would enter at full weight, and one slow outlier would lift the monotone curve for every
        larger size).
        """
        if self.smoothing <= 0:
            return
        xs = sorted(self.points)
        if tokens in self.points:
            weights = {tokens: 1.0}
        elif xs[0] < tokens < xs[-1]:
            i = bisect_left(xs, tokens)
            w = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
            weights = {xs[i - 1]: 1.0 - w, xs[i]: w}
        else:
            return
        error = seconds - sum(self.points[x] * w for x, w in weights.items())
        for x, w in weights.items():
            self.points[x] += self.smoothing * w * error


def monotone_fit(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (mean, count) of pooled runs
    for y in ys:
        blocks.append((y, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2))
    return [m for m, n in blocks for _ in range(n)]


@dataclass
class BatchCostModel:
    """Step time of a batch: target forwards against scored tokens, lockstep draft forwards against rows.

    ``draft`` is None for drafters that cost (next to) nothing, such as n-gram lookup. Both curves
    hold times at ``per_position.context`` positions; each scored token (draft forward row)
    attending to more pays :class:`~verispec.engine.policy.ContextCost`'s per-position term. Without
    it a busy batch at long contexts measured its plain steps far above the curve, observations
    raised only the plain width's point, the monotone fit pooled it with the wider (unobserved,
    still short-context) points, and drafting looked nearly free.
    """

    target: CostCurve
    draft: CostCurve | None = None
    # A row's draft catching up on context it has not seen (a new row's prompt, or what it
    # generated while the batch decoded plainly) is one forward of its own: a one-row draft
    # forward plus this many seconds per token read. A one-off cost per row, not per step.
    catch_up_per_token_s: float = 0.0
    smoothing: float = 0.1
    per_position: ContextCost = field(default_factory=ContextCost)

    def target_s(self, tokens: int, context: int = 0) -> float:
        """Predicted seconds of a target forward scoring ``tokens`` tokens that attend to ``context`` positions."""
        return self.target(tokens) + self.per_position.target(tokens, context)

    def draft_s(self, rows: int, context: int = 0) -> float:
        """Predicted seconds of one lockstep draft forward of ``rows`` rows at ``context`` positions."""
        if self.draft is None:
            return 0.0
        return self.draft(rows) + self.per_position.draft(rows, context)

    def observe_target(self, tokens: int, seconds: float, context: int = 0) -> None:
        """Fold in a measured target forward; the curve learns the time its context does not explain."""
        self.target.observe(tokens, seconds - self.per_position.target(tokens, context))

    def observe_draft(self, rows: int, seconds: float, context: int = 0) -> None:
        """Fold in a measured lockstep draft forward (as :meth:`observe_target`)."""
        if self.draft is not None:
            self.draft.observe(rows, seconds - self.per_position.draft(rows, context))

    def catch_up_s(self, tokens: int) -> float:
        """Predicted seconds for one row's draft to read ``tokens`` tokens of context."""
        if tokens <= 0 or self.draft is None:
            return 0.0
        return self.draft(1) + tokens * self.catch_up_per_token_s

    def observe_catch_up(self, count: int, tokens: int, seconds: float) -> None:
        """Fold in ``count`` measured catch-ups that read ``tokens`` tokens in ``seconds``."""
        if count > 0 and tokens > 0 and self.draft is not None:
            per_token = max(0.0, seconds - count * self.draft(1)) / tokens
            self.catch_up_per_token_s += self.smoothing * (per_token - self.catch_up_per_token_s)

    def step_s(self, rows: int, k: int, draft_k: int | None = None, context: int = 0) -> float:
        """Predicted seconds of one step of ``rows`` rows padded to ``k`` drafts each, attending to ``context``.

        ``draft_k`` lockstep draft forwards run (default ``k``; 0 when only lookup drafters draft).
        """
        draft_k = k if draft_k is None else draft_k
        draft = draft_k * self.draft_s(rows, context) if draft_k > 0 else 0.0
        return draft + self.target_s(rows * (k + 1), context)


@dataclass
class RowPlan:
    """What the policy knows of a row: its cap on k, and either its acceptance (policy-governed) or a fixed k."""

    cap: int
    acceptance: float | None = None  # None: the row's k is fixed (``fixed_k``)
    fixed_k: int = 0
    model_draft: bool = True  # drafts with the draft model (costs forwards), not a lookup
    catch_up: int = 0  # tokens the draft model must read for this row before it can draft
    horizon: int | None = None  # tokens the row is expected to still produce (None: unknown)
    spread: float | None = None  # sd of acceptance between requests of its drafter (None: a probe assumes a = 1)
    context: int = 0  # tokens the row's sequence holds: what its scored tokens attend to
    request: int | None = None  # the request's id: a probe's back-off holds only while its rows stay

    @property
    def must_catch_up(self) -> bool:
        """A policy-governed model-draft row whose draft must first read context on its own."""
        return self.acceptance is not None and self.model_draft and self.catch_up > 0


@dataclass
class BatchPolicy:
    """Chooses one k per step for all policy-governed rows by expected batch goodput.

    While k = 0 nothing is learned about acceptance, so after ``probe_every`` plain steps a
    ``probe_k`` step runs, but only if speculation could pay at the best acceptance the batch
    plausibly has (each row's estimate plus two standard deviations of a mean over the batch's
    requests; perfect acceptance for rows that give no ``spread``): otherwise (compute-bound, or
    a full batch whose drafter's record is far below what would pay) probing only wastes compute.
    A probe lets at most one row whose draft must first catch up read its context, and only if
    that bound wins the read back; it runs only if what it could show might change the next choice
    (not where the other rows' reads keep the batch plain). Probes that change nothing come ever more rarely
    (:class:`~verispec.engine.policy.ProbeSchedule`), until every request they looked at has left
    (rows that give their ``request``): then the wait starts over.
    """

    costs: BatchCostModel
    probe_every: int = PROBE_EVERY
    probe_k: int = 2
    min_gain: float = MIN_GAIN  # the predicted goodput gain over plain decoding that speculating must show
    chosen: dict[int, int] = field(default_factory=dict)  # k -> steps it was chosen

    def __post_init__(self) -> None:
        self.probes = ProbeSchedule(self.probe_every, 8 * self.probe_every)
        self._probed_requests: set[int] = set()  # requests in the batch at probes since the wait started over

    def goodput(self, plans: list[RowPlan], k: int, span: int | None = None, optimistic: bool = False) -> float:
        """Predicted tokens per second of the whole batch if governed rows draft ``k``.

        ``optimistic``: at the best acceptance each row plausibly has (a probe's bound): its
        estimate plus :data:`PLAUSIBLE_SDS` standard deviations of a mean over the batch's governed
        rows, or 1 where the row gives no ``spread``.
        """
        tokens, width, draft_k = 0.0, 0, 0
        governed = sum(p.acceptance is not None for p in plans)
        for p in plans:
            kr = p.fixed_k if p.acceptance is None else min(k, p.cap)
            a = p.acceptance if p.acceptance is not None else 0.6
            if optimistic and p.acceptance is not None:
                a = self._plausible_best(p, governed)
            tokens += expected_tokens(a, kr) if kr > 0 else 1.0
            width = max(width, kr)
            if p.model_draft:
                draft_k = max(draft_k, kr)
        return tokens / self.costs.step_s(span or len(plans), width, draft_k, batch_context(plans))

    @staticmethod
    def _plausible_best(plan: RowPlan, governed: int) -> float:
        """A governed row's best plausible acceptance in a batch of ``governed`` such rows (:meth:`goodput`)."""
        assert plan.acceptance is not None
        if plan.spread is None:
            return 1.0
        return min(1.0, plan.acceptance + PLAUSIBLE_SDS * plan.spread / governed ** 0.5)

    def choose(self, plans: list[RowPlan], span: int | None = None, joining: int = 0) -> int:
        """k for the governed rows of the next step (each still capped by its own ``cap``).

        A governed row whose draft model must first catch up on context joins only if the
        batch's predicted saving per token, over the tokens the row is expected to produce, wins
        the catch-up back (as :class:`~verispec.engine.policy.CostK` does for one request);
        otherwise its ``cap`` is set to 0 and it decodes plainly this step. ``joining`` rows are
        about to join the batch (admitted and still prefilling, or waiting for a free slot): the
        saving that pays a catch-up back is the one of the batch they will make.
        """
        caps = [p.cap for p in plans]
        governed = [p.cap for p in plans if p.acceptance is not None]
        if not governed:
            return 0
        if self._probed_requests and self._probed_requests.isdisjoint(p.request for p in plans):
            # Every request the failed probes looked at has left: acceptance differs widely between
            # requests, so the grown wait says nothing about these. Kept, it could make a lone
            # client's later requests wait up to 8 x probe_every steps, longer than their answers, where the
            # single-request engine's wait starts over with every request.
            self._restart_probes()
        k = self._paying_k(plans, span, joining)
        if k == 0:
            if self.probes.due():
                # A probe weighs each catch-up at its own, plausible best, bound: a row the expected
                # acceptance just kept out (a new request's prior too low to pay for reading its
                # prompt) is exactly the one a probe must be able to take, or a lone client whose
                # prompt read never pays at the prior is never probed and never drafts.
                for p, cap in zip(plans, caps, strict=True):
                    p.cap = cap
                probe = min(self.probe_k, max(governed))
                # A probe can only show speculation paying if the best plausible acceptance would clear
                # the same margin the choice demands; a near-tie (a compute-bound batch, or a full batch
                # whose mean acceptance cannot plausibly reach what would pay) would never turn into a
                # chosen k, so its probes would be pure cost.
                if probe and self._pays(plans, span, probe, optimistic=True):
                    # A row whose draft must first read what it generated while plain (or its prompt)
                    # joins only if the plausible best acceptance would win that read back, as CostK
                    # probes one request. Keeping every such row out locked a lone request into plain
                    # decoding: once plain, its draft always lags, so no probe ever took it again. A probe that
                    # would take no row, or whose best outcome would still leave the batch plain, changes
                    # nothing: it does not run, the wait does not grow, and it stays due for the next step
                    # (a request arriving with its whole answer ahead).
                    self._exclude_unpaid_catch_ups(plans, span, probe, joining, optimistic=True)
                    self._one_catch_up_per_probe(plans)
                    if self._probe_could_pay(plans, caps, span, joining):
                        k = probe
                        self.probes.ran()
                        # The whole batch it was taken in, not only the rows that drafted: at 8 clients
                        # the wait then starts over once per turnover of the batch, not per answer.
                        self._probed_requests.update(p.request for p in plans if p.request is not None)
        else:
            self._restart_probes()  # choosing to speculate starts the wait over
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def _paying_k(self, plans: list[RowPlan], span: int | None, joining: int) -> int:
        """The best k once every row whose catch-up it cannot win back is kept out (``cap = 0``)."""
        k = self._best_k(plans, span)
        # Until no catch-up is left that the chosen k cannot win back: a row kept out no longer drafts,
        # which lowers the batch's saving (and maybe its best k), so reads admitted while it counted
        # may no longer pay. Checked once, at 4 clients two rows read 123 prompt tokens (0.54 s) for
        # k = 1 steps whose saving over their answers, without the long-prompt row, was worth 0.13 s each.
        while k > 0 and self._exclude_unpaid_catch_ups(plans, span, k, joining):
            k = self._best_k(plans, span)
        return k

    def _probe_could_pay(self, plans: list[RowPlan], caps: list[int], span: int | None, joining: int) -> bool:
        """Whether the choice after this probe could be to speculate: its drafting rows (``cap > 0``) at
        their plausible best acceptance with their drafts current, the other rows as they are.

        A probe learns the acceptance of the rows it drafts and nothing else. Where the reads the
        other rows' drafts must first make keep the batch plain, or a padded batch in which only the
        probed row drafts cannot pay, no acceptance it could show changes the next choice: at 4
        clients such probes each cost a step at 58-72% of plain decoding's goodput plus one row's read
        of its context, and the batch went back to plain decoding every time.
        """
        governed = sum(p.acceptance is not None for p in plans)
        after = []
        for p, cap in zip(plans, caps, strict=True):
            if p.acceptance is not None and p.cap > 0:
                p = replace(p, acceptance=self._plausible_best(p, governed), catch_up=0)
            after.append(replace(p, cap=cap))
        return any(p.acceptance is not None and p.cap > 0 for p in plans) and self._paying_k(after, span, joining) > 0

    def _restart_probes(self) -> None:
        self.probes.restart()
        self._probed_requests.clear()

    def _exclude_unpaid_catch_ups(self, plans: list[RowPlan], span: int | None, k: int, joining: int = 0,
                                  optimistic: bool = False) -> bool:
        """Set ``cap = 0`` for rows whose catch-up the saving at ``k`` cannot win back; True if any.

        With rows ``joining``, the saving is the smaller of today's and the one of the batch they
        will make (more rows: maybe none at all). Without that, a busy server's first steps after
        a burst of arrivals, taken while most rows still prefill, looked like a small batch where
        speculation pays: rows caught up, and a few steps later the full batch decoded plainly
        and never won those reads back (1-4% of throughput at 8 clients, measured). ``optimistic``
        prices the saving at the best plausible acceptance (a probe's bound, :meth:`goodput`), at
        ``k`` for the future batch too.
        """
        if self.costs.draft is None:
            return False
        saved = self._saving(plans, span, k, optimistic)
        if joining > 0 and saved > 0:
            governed = [p for p in plans if p.acceptance is not None]
            cap, a = max(p.cap for p in governed), sum(p.acceptance for p in governed) / len(governed)
            spreads = [p.spread for p in governed]
            spread = None if None in spreads else max(spreads)
            future = plans + [RowPlan(cap, a, spread=spread)] * joining  # read only, never changed
            future_span = (span or len(plans)) + joining
            if optimistic:
                k_future = k if self._pays(future, future_span, k, optimistic=True) else 0
            else:
                k_future = self._best_k(future, future_span)
            saved = min(saved, self._saving(future, future_span, k_future, optimistic)) if k_future > 0 else 0.0
        excluded = False
        for p in plans:
            # Only rows still drafting, so that _paying_k's repeats end once nothing changes.
            if p.cap > 0 and p.must_catch_up and p.horizon is not None and \
                    saved * p.horizon <= self.costs.catch_up_s(p.catch_up):
                p.cap, excluded = 0, True
        return excluded

    def _one_catch_up_per_probe(self, plans: list[RowPlan]) -> None:
        """Let a probe pay for at most one row's catch-up, and none if a caught-up row can draft.

        A probe measures the drafter's acceptance, which one row shows as well as many. Letting
        every lagging row in made each probe read all their prompts (and what they generated
        while plain), reads a batch that goes back to plain decoding never wins back. The lagging
        row kept is the one that wins its read back fastest (most tokens still to produce per
        second of catch-up).
        """
        if self.costs.draft is None:
            return
        candidates = [p for p in plans if p.acceptance is not None and p.cap > 0]
        lagging = [p for p in candidates if p.must_catch_up]
        if lagging and len(lagging) == len(candidates):
            lagging.remove(max(lagging, key=lambda p: (p.horizon if p.horizon is not None else float("inf"))
                               / max(self.costs.catch_up_s(p.catch_up), 1e-9)))
        for p in lagging:
            p.cap = 0

    def _saving(self, plans: list[RowPlan], span: int | None, k: int, optimistic: bool = False) -> float:
        """Predicted seconds per token that the governed rows drafting ``k`` save over their decoding plainly.

        Against the batch at k = 0, rows with a fixed k still drafting: against an all-plain step, a
        batch whose fixed-k rows already pay for the draft forwards and the wide step looked like it
        lost by drafting, and its policy rows never read their prompts (tiny models in the mix of
        specs of the real pair's batch test: 16 of 18 steps plain where drafting was predicted to gain 20%).
        """
        return 1.0 / self.goodput(plans, 0, span) - 1.0 / self.goodput(plans, k, span, optimistic)

    def _pays(self, plans: list[RowPlan], span: int | None, k: int, optimistic: bool = False) -> bool:
        """Whether drafting ``k`` is predicted to beat plain decoding by the margin a choice demands."""
        return self.goodput(plans, k, span, optimistic) >= (1.0 + self.min_gain) * self.goodput(plans, 0, span)

    def _best_k(self, plans: list[RowPlan], span: int | None) -> int:
        k_max = max(p.cap for p in plans if p.acceptance is not None)
        k = max(range(k_max + 1), key=lambda k: (self.goodput(plans, k, span), -k))
        return k if self._pays(plans, span, k) else 0


def batch_context(plans: list[RowPlan]) -> int:
    """The context a step of these rows attends to: the longest row's (the forward pads keys to it)."""
    return max((p.context for p in plans), default=0)


@torch.inference_mode()
def profile_costs(target: Transformer, draft: Transformer | None, max_rows: int, k_max: int, context: int = 64,
                  reps: int = 5, long_context: int | None = None) -> BatchCostModel:
    """Time target forwards of B rows x m tokens (B in powers of two up to ``max_rows``, m in 1..k_max+1).

    Each forward attends over a ``context``-token dummy prefix (a real decode step reads its
    context too); a separate small cache is used, so running requests are untouched. The draft
    curve times one-token lockstep forwards of B rows. Each point is the fastest of ``reps`` runs:
    noise on a shared host only ever adds time, and a median of a few runs can still catch a spike.
    What a longer context adds per scored token and position is timed at ``long_context``
    (default 8 x ``context``; not at all if it is not longer).
    """
    batch_sizes = sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows} | {max_rows})
    target_grid = _time_grid(target, batch_sizes, range(1, k_max + 2), context, reps)
    draft_grid = _time_grid(draft, batch_sizes, (1,), context, reps) if draft is not None else None
    target_pts = _by_tokens(target_grid)
    draft_pts = _by_tokens(draft_grid) if draft_grid is not None else None
    long_context = 8 * context if long_context is None else long_context
    rows = min(max_rows, 16)  # a grid batch size; the per-position cost hardly depends on the rows
    shapes = list(dict.fromkeys([(rows, 1), (rows, min(2, k_max + 1)), (1, k_max + 1)]))
    target_context_s = _context_slope(target, target_grid, shapes, context, long_context, reps)
    catch_up = draft_context_s = 0.0
    if draft is not None:  # one row reading a context-token prompt, as a new row's catch-up does
        cache = draft.new_cache(1, context)
        tokens = ((torch.arange(context, device=draft.device) * 7 + 3) % draft.args.vocab_size).unsqueeze(0)
        pos = torch.arange(context, device=draft.device).unsqueeze(0)
        times = seconds_of(lambda: draft(tokens, pos, cache, last_only=True), draft.device, reps)
        catch_up = max(0.0, min(times) - draft_pts[1]) / context  # beyond one one-row forward
        draft_context_s = _context_slope(draft, draft_grid, [(rows, 1), (1, 1)], context, long_context, reps)
    return BatchCostModel(CostCurve(target_pts), CostCurve(draft_pts) if draft_pts else None, catch_up,
                          per_position=ContextCost(context, target_context_s, draft_context_s))


def _context_slope(model: Transformer, short: dict[tuple[int, int], float], shapes: list[tuple[int, int]],
                   context: int, long_context: int, reps: int) -> float:
    """Seconds per scored token per context position: forwards of B rows x m tokens (``shapes``) timed
    at ``long_context`` positions against their ``short`` (grid) times at ``context``."""
    if long_context <= context:
        return 0.0
    device = model.device
    # Keys past what was ever written are zeros: what they hold does not change a forward's time.
    cache = model.new_cache(max(b for b, _ in shapes), long_context + max(m for _, m in shapes))
    long = {}
    for b, m in shapes:
        tokens = ((torch.arange(m, device=device) * 7 + 3) % model.args.vocab_size).expand(b, -1).contiguous()
        pos = (long_context + torch.arange(m, device=device)).expand(b, -1)
        long[b, m] = min(seconds_of(
            lambda tokens=tokens, pos=pos, b=b: model(tokens, pos, cache, rows=slice(0, b)), device, reps))
    return per_position_s(short, long, context, long_context)


def _time_grid(model: Transformer, batch_sizes: list[int], widths: range | tuple[int, ...], context: int,
               reps: int) -> dict[tuple[int, int], float]:
    """The fastest of ``reps`` forwards of B rows x m tokens at ``context``, per (B, m)."""
    device = model.device
    cache = model.new_cache(max(batch_sizes), context + max(widths))
    prefix = (torch.arange(context, device=device) * 7 + 3) % model.args.vocab_size
    model(prefix.expand(cache.batch, -1).contiguous(), torch.arange(context, device=device).expand(cache.batch, -1),
          cache, last_only=True)
    times: dict[tuple[int, int], float] = {}
    for b in batch_sizes:
        for m in widths:
            # m tokens at m positions, whatever the prefix's length (k + 1 may exceed the context: k = 64).
            tokens = ((torch.arange(m, device=device) * 7 + 3) % model.args.vocab_size).expand(b, -1).contiguous()
            pos = (context + torch.arange(m, device=device)).expand(b, -1)
            times[b, m] = min(seconds_of(
                lambda tokens=tokens, pos=pos, b=b: model(tokens, pos, cache, rows=slice(0, b)), device, reps))
    return times


def _by_tokens(grid: dict[tuple[int, int], float]) -> dict[int, float]:
    """Grid times per scored-token count (B x m), shapes of the same count averaged."""
    samples: dict[int, list[float]] = {}
    for (b, m), t in grid.items():
        samples.setdefault(b * m, []).append(t)
    return {t: sum(v) / len(v) for t, v in samples.items()}
