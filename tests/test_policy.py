"""The cost k policy and the cost curves it reads, on hand-built cost models (no models run).

A row drafts only where the predicted goodput beats plain decoding by MIN_GAIN, and every row's
probes back off but never stop. Profiling bounds the time it spends per shape.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from verispec.config import SpecConfig
from verispec.engine.costs import CostCurve, CostModel, RowCurves, monotone_fit
from verispec.engine.policy import (
    PROBE_K,
    Acceptance,
    CostPolicy,
    ProbeSchedule,
    RowPlan,
    expected_tokens,
)
from verispec.engine.request import FixedK, HeuristicK, request_policy


def compute_bound() -> CostModel:
    """Flat (memory-bound) up to 4 scored tokens, then 1 ms per token; draft forwards 0.2 ms."""
    return CostModel(CostCurve({1: 4e-3, 4: 4e-3, 1024: 1.024}),
                     CostCurve({1: 2e-4, 64: 2e-4}))


def flat(target_s: float = 0.1, draft_s: float = 0.01, **kwargs) -> CostModel:
    """A target whose forwards cost the same at any width: perfect acceptance always pays."""
    return CostModel(CostCurve({1: target_s, 1024: target_s}),
                     CostCurve({1: draft_s, 64: draft_s}), **kwargs)


def row(acceptance: float | None = 0.1, cap: int = 5, **kwargs) -> RowPlan:
    return RowPlan(cap, acceptance, model_draft=True, **kwargs)


def probe_steps(policy: CostPolicy, steps: range, plans) -> list[tuple[int, list[int]]]:
    """(step, ks) of every step in ``steps`` where some row drafts; ``plans()`` builds each step's rows."""
    return [(s, ks) for s in steps if any(ks := policy.choose(plans()))]


def test_speculates_alone_but_not_when_compute_bound():
    policy = CostPolicy(compute_bound())
    assert policy.choose([row(0.8, cap=6)])[0] >= 2
    assert policy.choose([row(0.8, cap=6) for _ in range(16)]) == [0] * 16
    # A lone row whose step is priced at 16 rows' span pays as the 16 rows do.
    assert policy.choose([row(0.8, cap=6)], span=16) == [0]
    # On a linear curve even perfect acceptance cannot pay: no draft and no probe, however often due.
    linear = CostPolicy(CostModel(CostCurve({1: 1e-3, 100: 0.1})))
    schedules = [ProbeSchedule(every=2) for _ in range(4)]
    for _ in range(20):
        assert linear.choose([RowPlan(6, 0.99, probes=s) for s in schedules]) == [0] * 4
    assert linear.chosen == {0: 20}


def test_a_clear_predicted_gain_is_needed():
    # Draft forwards at 40% of a flat target step, k = 1: a = 0.5 predicts 1.07x, a = 0.45 1.04x.
    costs = flat(0.1, 0.04)
    assert expected_tokens(0.45, 1) / costs.step_s(4, 1) * costs.step_s(4, 0) == pytest.approx(1.036, abs=1e-3)
    assert expected_tokens(0.5, 1) / costs.step_s(4, 1) * costs.step_s(4, 0) == pytest.approx(1.071, abs=1e-3)
    assert CostPolicy(costs).choose([row(0.45, cap=1) for _ in range(4)]) == [0] * 4
    assert CostPolicy(costs).choose([row(0.5, cap=1) for _ in range(4)]) == [1] * 4
    assert CostPolicy(costs, min_gain=0.0).choose([row(0.45, cap=1) for _ in range(4)]) == [1] * 4


def test_fixed_rows_keep_their_k_and_governed_rows_their_cap():
    policy = CostPolicy(compute_bound())
    fixed = [RowPlan(cap=3, fixed_k=5), RowPlan(cap=6, fixed_k=2), RowPlan(cap=0, fixed_k=4)]
    assert policy.choose(fixed) == [3, 2, 0] and policy.chosen == {}  # nothing governed: nothing chosen
    assert CostPolicy(flat()).choose([row(0.95, cap=6), row(0.95, cap=2), row(0.95, cap=0)]) == [6, 2, 0]
    assert CostPolicy(flat()).choose([row(0.95, cap=6), RowPlan(cap=4, fixed_k=4)]) == [6, 4]


def test_a_free_lookup_is_drafted_only_where_its_padding_pays():
    # A cost-policy row's trusted lookup drafts for free, but the forward scores every row at its
    # width: alone its first 3 tokens pay (scored within the flat part), among 16 rows on a compute-bound
    # target any width would cost more than it brings, even where its request's lookups were all accepted.
    policy = CostPolicy(compute_bound())
    lookup = RowPlan(cap=5, fixed_k=5, optional=True)
    assert policy.choose([lookup]) == [3]
    assert CostPolicy(flat()).choose([lookup]) == [5]
    assert policy.choose([lookup] + [row(0.8) for _ in range(15)]) == [0] * 16
    assert policy.choose([replace(lookup, fixed_rate=0.99)] + [row(0.8) for _ in range(15)]) == [0] * 16
    # A lookup the request asked for at a fixed k is not the policy's to drop.
    assert policy.choose([RowPlan(cap=5, fixed_k=5)] + [row(0.8) for _ in range(15)])[0] == 5
    # On a flat target the padding costs nothing: the lookup drafts, and the governed rows join it.
    assert CostPolicy(flat()).choose([lookup, row(0.8), row(0.8)]) == [5, 5, 5]
    # Nothing governed: the lookups alone are weighed, and no k is recorded as chosen.
    pair = CostPolicy(compute_bound())
    assert pair.choose([lookup] * 16) == [0] * 16 and pair.chosen == {}


def test_a_long_lookup_is_cut_where_the_step_pays_not_dropped():
    # Scoring all 17 tokens of a 16-token lookup would cost more than it is expected to bring, but its
    # first tokens are a draft of their own: the step drafts them rather than decoding plainly.
    steep = CostModel(CostCurve({1: 4e-3, 4: 4e-3, 17: 4e-3 + 13 * 1.5e-3}))
    lookup = RowPlan(cap=16, fixed_k=16, optional=True)
    assert CostPolicy(steep).choose([lookup]) == [3]
    # Cut to the best prefix, not to the longest one that still beats plain decoding.
    assert 1.0 / steep.step_s(1, 0) < expected_tokens(0.6, 5) / steep.step_s(1, 5)
    assert CostPolicy(steep).choose([RowPlan(cap=16, fixed_k=5, optional=True)]) == [3]
    # A lookup shorter than the best cut drafts whole; a request's own fixed k is never cut.
    assert CostPolicy(steep).choose([RowPlan(cap=16, fixed_k=2, optional=True)]) == [2]
    assert CostPolicy(steep).choose([RowPlan(cap=16, fixed_k=16)]) == [16]


def test_a_lookup_is_cut_at_the_acceptance_its_request_reached():
    # Each scored token past the fourth costs a tenth of a step: the better a request's lookups have
    # been accepted, the longer the prefix that pays.
    gentle = CostModel(CostCurve({1: 4e-3, 4: 4e-3, 17: 4e-3 + 13 * 0.4e-3}))
    cuts = [CostPolicy(gentle).choose([RowPlan(cap=16, fixed_k=16, optional=True, fixed_rate=a)])[0]
            for a in (0.3, 0.6, 0.8, 0.9, 0.95)]
    assert cuts == [3, 3, 5, 8, 13]
    # Among rows the cut is shared (padding), between what each row's own rate alone would cut.
    rows = [RowPlan(cap=16, fixed_k=16, optional=True, fixed_rate=0.95),
            RowPlan(cap=16, fixed_k=16, optional=True, fixed_rate=0.3)]
    assert CostPolicy(gentle).choose(rows) == [5, 5]


def test_probes_back_off_to_a_bound_and_never_stop():
    policy = CostPolicy(flat())  # a = 0.1 keeps the row plain (1.1 tokens per 0.11 s); a = 1 would pay
    schedule = ProbeSchedule(every=2, max_every=8)
    probes = probe_steps(policy, range(1, 1001), lambda: [row(probes=schedule)])
    assert all(ks == [PROBE_K] for _, ks in probes)
    steps = [s for s, _ in probes]
    assert steps[:6] == [2, 6, 14, 22, 30, 38]  # waits 2, 4, 8, then 8 for ever
    assert steps == [2, 6] + list(range(14, 1001, 8))
    # A probe drafts at most the row's cap; the default schedule waits 8, 16, 32, 64, 64 ...
    narrow = ProbeSchedule(every=2)
    assert probe_steps(CostPolicy(flat()), range(1, 3), lambda: [row(cap=1, probes=narrow)]) == [(2, [1])]
    default = ProbeSchedule()
    assert [s for s, _ in probe_steps(CostPolicy(flat()), range(1, 200), lambda: [row(probes=default)])] == \
        [8, 24, 56, 120, 184]


def test_each_request_has_its_own_probe_schedule():
    policy = CostPolicy(flat())
    old, new = ProbeSchedule(every=2, max_every=8), ProbeSchedule(every=2, max_every=8)
    assert [s for s, _ in probe_steps(policy, range(1, 15), lambda: [row(probes=old)])] == [2, 6, 14]
    # A new request joins: it starts at every = 2 while the old one keeps its back-off (next at 22).
    both = probe_steps(policy, range(15, 39), lambda: [row(probes=old), row(probes=new)])
    assert both == [(16, [0, 2]), (20, [0, 2]), (22, [2, 0]), (28, [0, 2]), (30, [2, 0]), (36, [0, 2]),
                    (38, [2, 0])]
    # Choosing to speculate starts the schedule over: the next probe comes after 2 plain steps.
    assert policy.choose([row(0.9, probes=old)]) == [5]
    assert [policy.choose([row(probes=old)]) for _ in range(3)] == [[0], [PROBE_K], [0]]


def test_a_probe_that_cannot_pay_stays_due():
    # A draft forward dearer than what perfect acceptance saves: the due probe does not run and stays
    # due, and it runs on the first step it can pay.
    schedule = ProbeSchedule(every=2)
    dear, cheap = CostPolicy(flat(draft_s=1.0)), CostPolicy(flat())
    assert [dear.choose([row(probes=schedule)]) for _ in range(6)] == [[0]] * 6
    assert (schedule.gap, schedule.streak) == (0, 6)
    assert cheap.choose([row(probes=schedule)]) == [PROBE_K]
    assert cheap.choose([row(probes=schedule)]) == [0] and schedule.gap == 4  # it ran: the wait grows


def test_policy_rules_switch_off_for_an_ablation():
    schedule = ProbeSchedule(every=1)
    assert CostPolicy(flat(), off=frozenset({"probes"})).choose([row(probes=schedule)]) == [0]
    assert CostPolicy(flat()).choose([row(probes=schedule)]) == [PROBE_K]
    # A 16-token lookup on a compute-bound host is cut to what pays; drafted whole with the cut off.
    lookup = RowPlan(16, fixed_k=16, optional=True, fixed_rate=0.9)
    assert CostPolicy(compute_bound()).choose([lookup])[0] < 16
    assert CostPolicy(compute_bound(), off=frozenset({"lookup_cut"})).choose([lookup]) == [16]
    assert CostPolicy(flat(), off=frozenset({"margin"})).min_gain == 0.0
    with pytest.raises(ValueError, match="unknown policy rules"):
        CostPolicy(flat(), off=frozenset({"context"}))


def test_a_drafter_s_own_cost_can_make_drafting_lose():
    policy = CostPolicy(CostModel(CostCurve({1: 0.01, 64: 0.01})))  # no draft model
    assert [policy.choose([RowPlan(4, 0.8, draft_token_s=s)]) for s in (0.0, 1e-3, 3e-3, 1e-2)] == \
        [[4], [4], [3], [0]]


def test_acceptance_is_the_geometric_estimate_with_a_prior():
    bare = Acceptance(prior_weight=0.0, decay=1.0)
    bare.update(drafted=5, accepted=2)
    bare.update(drafted=5, accepted=3)
    assert bare.rate == pytest.approx(5 / 7)  # accepted / (accepted + rejections), not 5 / 10
    bare.update(drafted=4, accepted=4)  # all accepted: no rejection
    bare.update(drafted=0, accepted=0)  # drafted nothing: learns nothing
    assert bare.rate == pytest.approx(9 / 11)
    prior = Acceptance(decay=1.0)
    assert prior.rate == 0.6
    prior.update(drafted=5, accepted=2)
    assert prior.rate == pytest.approx((2 + 1.2) / (3 + 2))
    recent = Acceptance(decay=0.5)
    recent.update(2, 2)
    recent.update(2, 0)
    assert (recent.accepted, recent.rejected) == (1.0, 1.0)
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4.0 and expected_tokens(0.3, 0) == 1.0


def test_request_policies_and_the_heuristic_k():
    def policy(k_policy: str, k: int = 6):
        return request_policy(SpecConfig(method="draft", k=k, k_policy=k_policy))

    assert policy("cost") is None
    assert type(policy("fixed")) is FixedK and policy("fixed") == FixedK(6) == policy("confidence")
    assert policy("heuristic") == HeuristicK(k=4, k_max=6) and policy("heuristic", 3) == HeuristicK(k=3, k_max=3)
    assert FixedK(6).choose(4) == 4 and FixedK(2).choose(4) == 2
    h = HeuristicK(k=2, k_max=5)
    ks = []
    for drafted, accepted in ((2, 2), (4, 4), (5, 5), (5, 1), (0, 0), (4, 0), (3, 0), (2, 0), (1, 0)):
        h.update(drafted, accepted)
        ks.append(h.k)
    assert ks == [4, 5, 5, 4, 4, 3, 2, 1, 1]  # +2 on a full accept (to k_max), -1 on a rejection (to k_min)
    assert h.choose(3) == 1


def test_cost_curve_pools_an_outlier_and_extends_at_the_last_slope():
    assert monotone_fit([1.0, 3.0, 1.0, 1.0, 5.0]) == [1.0, 5 / 3, 5 / 3, 5 / 3, 5.0]
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # One slow profile point at 3 tokens: pooled, it does not price every k >= 2 at the spike.
    curve = CostCurve({1: 0.0755, 2: 0.0778, 3: 0.1217, 4: 0.0782, 5: 0.0779, 6: 0.0790})
    assert curve(6) < 0.0905 and curve(2) < curve(3) <= curve(6)
    assert CostPolicy(CostModel(curve, CostCurve({1: 0.0108}))).choose([row(0.8)]) == [5]
    line = CostCurve({1: 1.0, 5: 2.0})
    assert (line(0), line(3), line(9)) == (1.0, 1.5, 3.0)  # clamped below, interpolated, extended at 1/4
    assert CostCurve({4: 2.0})(8) == 4.0  # one point: proportional
    assert CostCurve({1: 2.0, 5: 1.0})(9) == 1.5  # pooled flat: never falls


def test_cost_model_composes_draft_and_target():
    costs = CostModel(CostCurve({1: 0.1, 64: 0.2}), CostCurve({1: 0.01, 64: 0.01}))
    target = CostCurve({1: 0.1, 64: 0.2})(12)
    assert costs.step_s(4, 2) == pytest.approx(2 * 0.01 + target)
    assert costs.step_s(4, 2, draft_k=0) == pytest.approx(target)  # lookups: no draft forwards
    assert CostModel(costs.target).draft_s(4) == 0.0


def test_one_row_is_priced_by_one_row_forwards():
    # The same scored tokens cost more over more rows (each row attends to its own cache).
    one = CostCurve({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2})
    four = CostCurve({4: 2.0, 8: 2.0, 16: 2.4, 32: 3.2})
    curves = RowCurves({1: one, 4: four})
    assert curves(8) == 1.2 and curves(8, rows=4) == 2.0
    assert curves(8, rows=2) == pytest.approx(1.2 + (2.0 - 1.2) / 3)  # linear in the rows between
    assert curves(16, rows=9) == 2.4  # past the last profiled rows: that curve
    # A cost model priced by one curve over the shapes' average would make k > 0 look dearer to a lone
    # row than it is; with one curve per row count a lone row is priced as on a one-row engine.
    alone = CostPolicy(CostModel(CostCurve(dict(one.points)), CostCurve({1: 0.05})))
    many = CostPolicy(CostModel(RowCurves({1: CostCurve(dict(one.points)),
                                           4: CostCurve(dict(four.points))}),
                                CostCurve({1: 0.05, 4: 0.1})))
    for a in (0.3, 0.5, 0.7, 0.9):
        assert many.choose([row(a, cap=7)]) == alone.choose([row(a, cap=7)])
    with pytest.raises(ValueError):
        RowCurves({})


def test_profiling_stops_repeating_a_shape_once_its_budget_is_spent(monkeypatch: pytest.MonkeyPatch):
    import torch

    from verispec.engine import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    calls = []

    def run(seconds: float) -> None:
        calls.append(seconds)
        clock[0] += seconds

    cpu = torch.device("cpu")
    # A slow shape (0.4 s a forward, budget 0.5 s): the warm-up, then two timed forwards, not five.
    assert metrics.seconds_of(lambda: run(0.4), cpu, reps=5, budget_s=0.5) == pytest.approx([0.4, 0.4])
    assert len(calls) == 3
    # A cheap one takes every repetition; so does any shape without a budget.
    assert len(metrics.seconds_of(lambda: run(0.01), cpu, reps=5, budget_s=0.5)) == 5
    assert len(metrics.seconds_of(lambda: run(0.4), cpu, reps=5)) == 5
    # One forward over the budget is still timed once.
    assert metrics.seconds_of(lambda: run(2.0), cpu, reps=5, budget_s=0.5) == pytest.approx([2.0])
