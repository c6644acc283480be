"""What a step costs: measured curves of seconds against the work a forward does.

A target forward's time is a curve of the tokens it scores (rows x width) for each profiled
number of rows, a lockstep draft forward's a curve of its rows, both measured once at a short
context by :func:`profile_costs`. The curves are all the cost policy prices a step with: a term for
longer contexts, learning from measured steps and pricing a draft model's catch-up reads were each
switched off in an ablation on the tune split and bought nothing beyond the run-to-run spread
(docs/results.md), so they went.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from verispec.engine.metrics import seconds_of
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer

# The widest k a cost model is profiled for when nobody asks for more. A request's k never sizes
# a profile others would wait for: a larger k is priced by extending the measured curve.
PROFILE_K = 8
# Seconds of timed forwards per profiled shape at most (past its first): cheap shapes take every
# repetition, and a slow host stops at what already shows a shape's cost.
SHAPE_BUDGET_S = 0.5


@dataclass
class CostCurve:
    """Seconds of one forward against the tokens it processes: piecewise linear through measured points.

    Beyond the last point the curve extends at the last segment's slope (it never falls). It is
    read through the least-squares non-decreasing fit of the points (isotonic regression), so a
    noisy measurement cannot make more work look cheaper, and one slow outlier is averaged with
    its neighbours instead of lifting every larger size to its height.
    """

    points: dict[int, float]

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
    (next to) nothing, such as n-gram lookup.
    """

    target: RowCurves | CostCurve
    draft: CostCurve | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target, CostCurve):
            self.target = RowCurves({1: self.target})

    def describe(self) -> str:
        """One line: the curves' points in milliseconds."""
        def fmt(points: dict[int, float]) -> str:
            return ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in sorted(points.items()))

        target = "; ".join(f"{b} rows {fmt(curve.points)}" for b, curve in sorted(self.target.curves.items()))
        return f"costs: target {target}, draft {fmt(self.draft.points) if self.draft else '-'}"

    def target_s(self, tokens: int, rows: int = 1) -> float:
        """Predicted seconds of a target forward of ``rows`` rows scoring ``tokens`` tokens in all."""
        return self.target(tokens, rows)

    def draft_s(self, rows: int) -> float:
        """Predicted seconds of one lockstep draft forward of ``rows`` rows."""
        return 0.0 if self.draft is None else self.draft(rows)

    def step_s(self, rows: int, k: int, draft_k: int | None = None) -> float:
        """Predicted seconds of one step of ``rows`` rows padded to ``k`` drafts each.

        ``draft_k`` lockstep draft forwards run (default ``k``; 0 when only lookup drafters draft).
        """
        draft_k = k if draft_k is None else draft_k
        draft = draft_k * self.draft_s(rows) if draft_k > 0 else 0.0
        return draft + self.target_s(rows * (k + 1), rows)


@torch.inference_mode()
def profile_costs(target: Transformer, draft: Transformer | None, max_rows: int, k_max: int, context: int = 64,
                  reps: int = 5) -> CostModel:
    """Time target forwards of B rows x m tokens (B in powers of two up to ``max_rows``, m in 1..k_max+1).

    Each forward attends over a ``context``-token dummy prefix (a real decode step reads its
    context too); a separate small cache is used, so running requests are untouched. The draft
    curve times one-token lockstep forwards of B rows. Each point is the fastest of ``reps`` runs:
    noise on a shared host only ever adds time, and a median of a few runs can still catch a spike.
    """
    batch_sizes = sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows} | {max_rows})
    target_grid = _time_grid(target, batch_sizes, range(1, k_max + 2), context, reps)
    target_curves = RowCurves({b: CostCurve({b * m: t for (b_, m), t in target_grid.items() if b_ == b})
                               for b in batch_sizes})
    if draft is None:
        return CostModel(target_curves)
    draft_grid = _time_grid(draft, batch_sizes, (1,), context, reps)
    return CostModel(target_curves, CostCurve({b: t for (b, _), t in draft_grid.items()}))


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

