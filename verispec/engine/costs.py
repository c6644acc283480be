"""What a step costs: measured curves of seconds against the work a forward does.

A target forward's time is a curve of the tokens it scores (rows x width) per profiled number of
rows, a lockstep draft forward's a curve of its rows, both timed once at a short context by
:func:`profile_costs`. They are all the cost policy prices a step with (docs/results.md has the
ablation that removed a context term, online learning and catch-up pricing).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from verispec.engine.metrics import seconds_of
from verispec.models.linear import VERIFY_M_MAX
from verispec.models.llama import Transformer

PROFILE_K = 8  # the widest k profiled when nobody asks for more: a larger k extends the curve
# One row's curve is also timed at these widths: a prediction or a long lookup drafts far past PROFILE_K, and
# extending the curve by its last (noisy) segment would price those steps by chance.
PROFILE_WIDE = (16, 32, 64)
SHAPE_BUDGET_S = 0.5  # seconds of timing per profiled shape at most (past its first): a slow host stops early


@dataclass
class CostCurve:
    """Seconds of one forward against the tokens it processes, piecewise linear through the non-decreasing
    least-squares fit of fixed measured points (noise cannot make more work look cheaper); past the last
    point it extends at the last segment's slope."""

    points: dict[int, float]

    @cached_property
    def _fit(self) -> tuple[list[int], list[float]]:  # fitted once: the policy reads it many times a step
        xs = sorted(self.points)
        return xs, monotone_fit([self.points[x] for x in xs])

    def __call__(self, tokens: int) -> float:
        xs, ys = self._fit
        if tokens > xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[0] / xs[0]
            return ys[-1] + max(0.0, slope) * (tokens - xs[-1])
        return float(np.interp(tokens, xs, ys))


@dataclass
class RowCurves:
    """One :class:`CostCurve` per profiled number of rows, linear in the rows between two of them: forwards
    of the same scored tokens differ with their rows (each attends to its own cache)."""

    curves: dict[int, CostCurve]

    def __post_init__(self) -> None:
        if not self.curves or min(self.curves) < 1:
            raise ValueError("RowCurves needs a curve for at least one row count >= 1")

    def __call__(self, tokens: int, rows: int = 1) -> float:
        bs = sorted(self.curves)
        lo = max((b for b in bs if b <= rows), default=bs[0])
        hi = min((b for b in bs if b >= rows), default=bs[-1])
        w = 0.0 if lo == hi else (rows - lo) / (hi - lo)
        return (1.0 - w) * self.curves[lo](tokens) + (w * self.curves[hi](tokens) if w else 0.0)


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
    """Step time of any batch: target forwards by scored tokens and rows (one curve may serve any rows),
    lockstep draft forwards by rows (``draft`` None where drafting costs next to nothing, as lookups)."""

    target: RowCurves | CostCurve
    draft: CostCurve | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target, CostCurve):
            self.target = RowCurves({1: self.target})

    def describe(self) -> str:
        """One line: the curves' points in milliseconds."""
        fmt = lambda c: ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in sorted(c.points.items())) if c else "-"  # noqa: E731
        target = "; ".join(f"{b} rows {fmt(c)}" for b, c in sorted(self.target.curves.items()))
        return f"costs: target {target}, draft {fmt(self.draft)}"

    def target_s(self, tokens: int, rows: int = 1) -> float:
        """Predicted seconds of a target forward of ``rows`` rows scoring ``tokens`` tokens in all."""
        return self.target(tokens, rows)

    def draft_s(self, rows: int) -> float:
        """Predicted seconds of one lockstep draft forward of ``rows`` rows."""
        return 0.0 if self.draft is None else self.draft(rows)

    def step_s(self, rows: int, k: int, draft_k: int | None = None) -> float:
        """Predicted seconds of a step of ``rows`` rows padded to ``k`` drafts each, with ``draft_k``
        lockstep draft forwards (default ``k``; 0 where only lookups draft)."""
        draft_k = k if draft_k is None else draft_k
        return draft_k * self.draft_s(rows) + self.target_s(rows * (k + 1), rows)


@torch.inference_mode()
def profile_costs(target: Transformer, draft: Transformer | None, max_rows: int, k_max: int, context: int = 64,
                  reps: int = 5) -> CostModel:
    """Time forwards of B rows x m tokens (B in powers of two up to ``max_rows``, m in 1..k_max+1, and one row
    also at the :data:`PROFILE_WIDE` widths past that) over a ``context``-token dummy prefix in a cache of their
    own, and one-token draft forwards of B rows.

    Each point is the fastest of ``reps`` runs: noise on a shared host only ever adds time.
    """
    rows = sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows} | {max_rows})
    grid = _time_grid(target, rows, range(1, k_max + 2), context, reps)
    grid |= _time_grid(target, [1], tuple(m for m in PROFILE_WIDE if k_max + 1 < m <= VERIFY_M_MAX), context, reps)
    curves = RowCurves({b: CostCurve({b * m: t for (b_, m), t in grid.items() if b_ == b}) for b in rows})
    if draft is None:
        return CostModel(curves)
    return CostModel(curves, CostCurve({b: t for (b, _), t in _time_grid(draft, rows, (1,), context, reps).items()}))


def _time_grid(model: Transformer, rows: list[int], widths: range | tuple[int, ...], context: int,
               reps: int) -> dict[tuple[int, int], float]:
    """The fastest of ``reps`` forwards of B rows x m tokens at positions ``context``..., per (B, m)."""
    def dummy(b: int, m: int) -> torch.Tensor:  # which tokens a forward reads does not change its time
        return ((torch.arange(m, device=model.device) * 7 + 3) % model.args.vocab_size).expand(b, -1).contiguous()

    if not widths:
        return {}
    cache = model.new_cache(max(rows), context + max(widths))
    model(dummy(cache.batch, context), torch.arange(context, device=model.device).expand(cache.batch, -1), cache,
          last_only=True)
    times = {}
    for b in rows:
        for m in widths:  # m tokens at m positions, whatever the prefix's length (k + 1 may exceed it)
            tokens, pos = dummy(b, m), (context + torch.arange(m, device=model.device)).expand(b, -1)
            times[b, m] = min(seconds_of(lambda: model(tokens, pos, cache, rows=slice(0, b)),  # noqa: B023
                                         model.device, reps, budget_s=SHAPE_BUDGET_S))
    return times
