"""What a step costs: measured curves of seconds against the work a forward does.

A target forward's time is a curve of the tokens it scores (rows x width) for each profiled
number of rows, a lockstep draft forward's a curve of its rows; both are measured at a short
context, and each scored token pays a measured per-position term for the context it attends to
beyond that. :func:`profile_costs` measures them once; steps then correct the curves online
(:meth:`CostModel.observe_target`).
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.engine.metrics import seconds_of
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer

if TYPE_CHECKING:
    from verispec.engine.step import StepReport

# The widest k a cost model is profiled for when nobody asks for more. A request's k never sizes
# a profile others would wait for: a larger k is priced by extending the measured curve.
PROFILE_K = 8
# Seconds of timed forwards per profiled shape at most (past its first): cheap shapes take every
# repetition, and a slow host stops at what already shows a shape's cost.
SHAPE_BUDGET_S = 0.5


@dataclass
class ContextCost:
    """What a longer context adds to a forward: seconds per scored token (target) or per draft token
    (draft) for each position of context beyond the ``context`` the cost curves were measured at.

    A request spends most of its steps far past the short context the curves are profiled at;
    without this term, drafting there would look cheaper than it is.
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
class CostCurve:
    """Seconds of one forward against the tokens it processes: piecewise linear through measured points.

    Beyond the last point the curve extends at the last segment's slope (it never falls). It is
    read through the least-squares non-decreasing fit of the points (isotonic regression), so a
    noisy measurement cannot make more work look cheaper, and one slow outlier is averaged with
    its neighbours instead of lifting every larger size to its height.
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


@dataclass
class RowCurves:
    """Seconds of a target forward against its scored tokens, one :class:`CostCurve` per profiled number
    of rows, linear in the rows between two of them (the nearest one's outside).

    Forwards of the same scored tokens differ with their rows (each row attends to its own cache and
    pays its own bookkeeping), so one row is priced by one-row forwards, not by an average over shapes.
    """

    curves: dict[int, CostCurve]

    def __post_init__(self) -> None:
        if not self.curves or min(self.curves) < 1:
            raise ValueError("RowCurves needs a curve for at least one row count >= 1")

    def _weights(self, rows: int) -> dict[int, float]:
        bs = sorted(self.curves)
        lo = max((b for b in bs if b <= rows), default=bs[0])
        hi = min((b for b in bs if b >= rows), default=bs[-1])
        if lo == hi:
            return {lo: 1.0}
        w = (rows - lo) / (hi - lo)
        return {lo: 1.0 - w, hi: w}

    def __call__(self, tokens: int, rows: int = 1) -> float:
        return sum(w * self.curves[b](tokens) for b, w in self._weights(rows).items())

    def observe(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """Fold one measured forward of ``rows`` rows into the curve it is read from alone (a profiled row
        count's, or the nearest one's outside them); a forward between two row counts teaches neither."""
        weights = self._weights(rows)
        if len(weights) == 1:
            self.curves[next(iter(weights))].observe(tokens, seconds)


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
class CostModel:
    """Step time of any batch (one row included): target forwards against scored tokens and rows, lockstep
    draft forwards against rows.

    ``target`` may be one curve for any number of rows. ``draft`` is None for drafters that cost
    (next to) nothing, such as n-gram lookup. Both hold times at ``per_position.context``
    positions; each scored token (draft forward row) attending to more pays :class:`ContextCost`'s
    per-position term, and observations teach the curves only the time their context does not explain.
    """

    target: RowCurves | CostCurve
    draft: CostCurve | None = None
    # A row's draft catching up on context it has not seen (a new row's prompt, or what it
    # generated while the batch decoded plainly) is one forward of its own: a one-row draft
    # forward plus this many seconds per token read. A one-off cost per row, not per step.
    catch_up_per_token_s: float = 0.0
    smoothing: float = 0.1
    per_position: ContextCost = field(default_factory=ContextCost)

    def __post_init__(self) -> None:
        if isinstance(self.target, CostCurve):
            self.target = RowCurves({1: self.target})

    def observe_step(self, report: StepReport) -> None:
        """Learn from one step's measured stages: the target forward, the draft forwards and catch-ups."""
        self.observe_target(report.scored_tokens, report.score_s, report.context, report.span)
        self.observe_catch_up(report.catch_ups, report.catch_up_tokens, report.catch_up_s)
        if self.draft is not None and report.draft_forwards:
            per_forward = (report.propose_s - report.catch_up_s) / report.draft_forwards
            self.observe_draft(report.span, per_forward, report.context)

    def describe(self) -> str:
        """One line: the curves' points in milliseconds, and each further position's cost."""
        def fmt(points: dict[int, float]) -> str:
            return ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in sorted(points.items()))

        target = "; ".join(f"{b} rows {fmt(curve.points)}" for b, curve in sorted(self.target.curves.items()))
        return (f"costs at {self.per_position.context}-token context: target {target}, draft "
                f"{fmt(self.draft.points) if self.draft else '-'}; per token and further position: target "
                f"{self.per_position.target_s:.2g} s, draft {self.per_position.draft_s:.2g} s")

    def target_s(self, tokens: int, context: int = 0, rows: int = 1) -> float:
        """Predicted seconds of a target forward of ``rows`` rows scoring ``tokens`` tokens in all, that
        attend to ``context`` positions."""
        return self.target(tokens, rows) + self.per_position.target(tokens, context)

    def draft_s(self, rows: int, context: int = 0) -> float:
        """Predicted seconds of one lockstep draft forward of ``rows`` rows at ``context`` positions."""
        if self.draft is None:
            return 0.0
        return self.draft(rows) + self.per_position.draft(rows, context)

    def observe_target(self, tokens: int, seconds: float, context: int = 0, rows: int = 1) -> None:
        """Fold in a measured target forward; the curves learn the time its context does not explain."""
        self.target.observe(tokens, seconds - self.per_position.target(tokens, context), rows)

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
        return draft + self.target_s(rows * (k + 1), context, rows)


@torch.inference_mode()
def profile_costs(target: Transformer, draft: Transformer | None, max_rows: int, k_max: int, context: int = 64,
                  reps: int = 5, long_context: int | None = None) -> CostModel:
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
    target_curves = RowCurves({b: CostCurve({b * m: t for (b_, m), t in target_grid.items() if b_ == b})
                               for b in batch_sizes})
    draft_pts = {b: t for (b, _), t in draft_grid.items()} if draft_grid is not None else None
    long_context = 8 * context if long_context is None else long_context
    rows = min(max_rows, 16)  # a grid batch size; the per-position cost hardly depends on the rows
    shapes = list(dict.fromkeys([(rows, 1), (rows, min(2, k_max + 1)), (1, k_max + 1)]))
    target_context_s = _context_slope(target, target_grid, shapes, context, long_context, reps)
    catch_up = draft_context_s = 0.0
    if draft is not None:  # one row reading a context-token prompt, as a new row's catch-up does
        cache = draft.new_cache(1, context)
        tokens, pos = _dummy(draft, 1, context), torch.arange(context, device=draft.device).unsqueeze(0)
        times = seconds_of(lambda: draft(tokens, pos, cache, last_only=True), draft.device, reps,
                           budget_s=SHAPE_BUDGET_S)
        catch_up = max(0.0, min(times) - draft_pts[1]) / context  # beyond one one-row forward
        draft_context_s = _context_slope(draft, draft_grid, [(rows, 1), (1, 1)], context, long_context, reps)
    return CostModel(target_curves, CostCurve(draft_pts) if draft_pts else None, catch_up,
                          per_position=ContextCost(context, target_context_s, draft_context_s))


def _context_slope(model: Transformer, short: dict[tuple[int, int], float], shapes: list[tuple[int, int]],
                   context: int, long_context: int, reps: int) -> float:
    """Seconds per scored token per context position: forwards of B rows x m tokens (``shapes``) timed
    at ``long_context`` positions against their ``short`` (grid) times at ``context``."""
    if long_context <= context:
        return 0.0
    # Keys past what was ever written are zeros: what they hold does not change a forward's time.
    cache = model.new_cache(max(b for b, _ in shapes), long_context + max(m for _, m in shapes))
    long = {(b, m): _fastest(model, cache, b, m, long_context, reps) for b, m in shapes}
    return per_position_s(short, long, context, long_context)


def _time_grid(model: Transformer, batch_sizes: list[int], widths: range | tuple[int, ...], context: int,
               reps: int) -> dict[tuple[int, int], float]:
    """The fastest of ``reps`` forwards of B rows x m tokens at ``context``, per (B, m)."""
    cache = model.new_cache(max(batch_sizes), context + max(widths))
    model(_dummy(model, cache.batch, context), torch.arange(context, device=model.device).expand(cache.batch, -1),
          cache, last_only=True)
    # m tokens at m positions, whatever the prefix's length (k + 1 may exceed the context: k = 64).
    return {(b, m): _fastest(model, cache, b, m, context, reps) for b in batch_sizes for m in widths}


def _dummy(model: Transformer, b: int, m: int) -> torch.Tensor:
    """``[b, m]`` stand-in token ids: which tokens a forward reads does not change its time."""
    return ((torch.arange(m, device=model.device) * 7 + 3) % model.args.vocab_size).expand(b, -1).contiguous()


def _fastest(model: Transformer, cache: KVCache, b: int, m: int, start: int, reps: int) -> float:
    """The fastest of ``reps`` forwards of ``b`` rows (cache rows 0..b-1) x ``m`` tokens at positions ``start``..."""
    tokens, pos = _dummy(model, b, m), (start + torch.arange(m, device=model.device)).expand(b, -1)
    return min(seconds_of(lambda: model(tokens, pos, cache, rows=slice(0, b)), model.device, reps,
                          budget_s=SHAPE_BUDGET_S))

