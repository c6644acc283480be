"""Fault isolation for a batched step: a step that raises is undone and rerun row by row, so only the
rows that fail alone fail, and every surviving row's caches, drafter and generator stay consistent."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verispec.engine.request import Request
from verispec.engine.step import StepReport
from verispec.log import logger
from verispec.models.kv_cache import KVCache

RowState = tuple[int, torch.Tensor | None]


def step_isolated(run: Callable[[list[Request]], StepReport], rows: list[Request], cache: KVCache) -> StepReport:
    """``run(rows)``, one speculative step; a row that fails it is in ``report.failed``, the others advance.

    A row whose own drafter raises is left out of the step by the step itself. If the step raises
    anyway (the draft runner, the shared target forward, verification), it is undone, each row's
    caches, drafter and generator as they were before, and every row runs it alone: the rows that
    raise alone are the ones that fail. The combined report is marked ``retried`` (its timings are
    no single forward's, so the cost model does not learn from it).
    """
    saved = [_row_state(cache, r) for r in rows]
    try:
        return run(rows)
    except Exception as e:  # noqa: BLE001 (isolated below)
        if len(rows) == 1:
            _restore_row(cache, rows[0], saved[0])
            return _failed_alone(e)
        logger.warning("a step of %d rows failed (%r); retrying its rows one by one", len(rows), e)
    for row, state in zip(rows, saved, strict=True):
        _restore_row(cache, row, state)
    report = StepReport(len(rows), 0, 0, 0, 0.0, 0.0, 0.0, retried=True)
    for i, (row, state) in enumerate(zip(rows, saved, strict=True)):
        try:
            alone = run([row])
        except Exception as e:  # noqa: BLE001 (this row fails on its own: it is the culprit)
            _restore_row(cache, row, state)
            alone = _failed_alone(e)
        report.new_tokens += alone.new_tokens
        report.drafted += alone.drafted
        report.accepted += alone.accepted
        if 0 in alone.failed:
            report.failed[i] = alone.failed[0]
        report.span, report.width = max(report.span, alone.span), max(report.width, alone.width)
        report.draft_forwards += alone.draft_forwards
        report.propose_s += alone.propose_s
        report.score_s += alone.score_s
        report.verify_s += alone.verify_s
        report.context = max(report.context, alone.context)
    return report


def _failed_alone(error: BaseException) -> StepReport:
    return StepReport(1, 0, 0, 0, 0.0, 0.0, 0.0, new_tokens=[[]], drafted=[0], accepted=[0], failed={0: error},
                      retried=True)


def _row_state(cache: KVCache, row: Request) -> RowState:
    """What a step may change in a row before it fails: the target cache length and the generator."""
    return cache.lengths[row.slot], None if row.generator is None else row.generator.get_state()


def _restore_row(cache: KVCache, row: Request, state: RowState) -> None:
    """Undo a step that raised: the row is back to ``seq`` with nothing drafted or accepted.

    The target's cache row is back at ``len(seq) - 1``; the row's drafter is told that only ``seq`` is
    final (a draft model's row lowers its length and catches up next time), and the generator is back
    where it was, so a retried sampled row draws what it would have drawn.
    """
    length, generator_state = state
    cache.lengths[row.slot] = length
    if row.drafter is not None:
        try:
            row.drafter.commit(len(row.seq))
        except Exception:  # noqa: BLE001 (a broken drafter fails its row when it runs alone)
            pass
    if generator_state is not None:
        row.generator.set_state(generator_state)
