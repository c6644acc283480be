"""Continuous batching with batched speculative decoding: every request gets exactly what it would alone.

Greedy outputs of the batch engine equal Engine.generate per request (plain, draft model, n-gram,
the concurrency-aware policy; batches of 1..8 with mixed prompt lengths and max_tokens); requests
arriving or cancelled mid-flight leave the others unchanged and give their slot and KV tokens back;
seeded sampling does not depend on batch companions; the policy turns speculation off when a
(synthetic) cost curve says verification is compute-bound.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from drafters_common import FailingDrafter, build_tok_model

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig, VerispecError
from verispec.engine.batch import BatchEngine
from verispec.engine.batch_policy import BatchCostModel, BatchPolicy, CostCurve, RowPlan, monotone_fit
from verispec.engine.policy import Acceptance, ContextCost, CostK, CostModel
from verispec.engine.scheduler import Scheduler

# make_tiny's eos_token_id, plus a token the tiny target emits often, so that some requests stop early.
EOS_IDS = {1, 26}
MAX_LEN = 128
# Different lengths (1 to 17 tokens), with repeats so the n-gram drafter finds matches.
PROMPTS = [[2], [3, 5, 7, 9, 3, 5, 7], [10, 20, 30, 40, 10, 20], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11],
           [40, 41], [50, 51, 52, 53, 54, 50, 51, 52, 53, 54, 50, 51, 52, 53, 54, 50, 51],
           [60, 61, 62, 63, 60], [70, 71, 72, 73, 74, 75, 76, 77, 70, 71, 72, 73]]
# Different max_tokens; half the requests may stop at an EOS id.
PARAMS = [SamplingParams(max_tokens=8 + 5 * i, ignore_eos=i % 2 == 1) for i in range(len(PROMPTS))]
SPECS = {
    "plain": SpecConfig(k_policy="fixed", method="none", k=0),
    "draft": SpecConfig(k_policy="fixed", method="draft", k=4),
    "ngram": SpecConfig(k_policy="fixed", method="ngram", k=3),
    "draft-cost": SpecConfig(method="draft", k=6, k_policy="cost"),
    "draft-confidence": SpecConfig(method="draft", k=6, k_policy="confidence", confidence=0.5),
    "draft-cost-confidence": SpecConfig(method="draft", k=6, k_policy="cost", confidence=0.5),
    "ngram-heuristic": SpecConfig(method="ngram", k=5, k_policy="heuristic"),
}


def make_engine(target, draft=None) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=MAX_LEN, progress=False)
    return Engine(cfg, target.model, None, EOS_IDS, draft=None if draft is None else draft.model)


@pytest.fixture(scope="module")
def engine(qwen2_tiny, qwen2_noisy_draft_tiny) -> Engine:
    """The target with a noisy copy as draft: drafts are accepted sometimes, rejected sometimes."""
    return make_engine(qwen2_tiny, qwen2_noisy_draft_tiny)


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[list[int]]]:
    """Each request decoded alone by Engine.generate, per method."""
    return {name: [engine.generate(p, pa, spec)[0].token_ids for p, pa in zip(PROMPTS, PARAMS, strict=True)]
            for name, spec in SPECS.items()}


def test_reference_is_not_degenerate(reference):
    plain = reference["plain"]
    assert all(len(set(ids)) >= 3 for ids in plain if len(ids) >= 8)
    assert any(len(ids) < pa.max_tokens for ids, pa in zip(plain, PARAMS, strict=True))  # some stop at EOS
    assert all(v == plain for v in reference.values())  # greedy speculation is lossless


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("batch", range(1, 9))
def test_greedy_batch_matches_engine(engine, reference, method, batch):
    be = BatchEngine(engine, max_batch=batch)
    results = be.generate_batch(PROMPTS[:batch], PARAMS[:batch], SPECS[method])
    assert [r.token_ids for r in results] == reference[method][:batch]
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert be.free_slots == batch and be.kv_used_tokens == 0 and be.num_running == 0
    if method != "plain":
        assert sum(r.metrics.drafted for r in results) > 0 or method.startswith("draft-cost")
    if method == "draft" and batch == 8:  # both verification branches ran inside the batch
        assert 0 < sum(r.metrics.accepted for r in results) < sum(r.metrics.drafted for r in results)


def test_queueing_and_mixed_specs_match_engine(engine, reference):
    # 8 requests through 3 slots, each with its own method: admission as slots free up.
    be = BatchEngine(engine, max_batch=3)
    names = [list(SPECS)[i % len(SPECS)] for i in range(len(PROMPTS))]
    results = be.generate_batch(PROMPTS, PARAMS, [SPECS[n] for n in names])
    assert [r.token_ids for r in results] == [reference[n][i] for i, n in enumerate(names)]
    assert max(be.stats.rows_steps) == 3
    assert be.free_slots == 3 and be.kv_used_tokens == 0


def test_rows_with_different_k_match_plain(engine, reference):
    # Rows with different fixed k pad to the widest one; the padding must not leak into any row.
    be = BatchEngine(engine, max_batch=8)
    specs = [SpecConfig(k_policy="fixed", method="draft", k=k) for k in (1, 2, 3, 5, 8, 0, 4, 7)]
    results = be.generate_batch(PROMPTS, PARAMS, specs)
    assert [r.token_ids for r in results] == reference["plain"]


def test_chunked_prefill_matches(engine, reference):
    be = BatchEngine(engine, max_batch=4, prefill_chunk=3)
    results = be.generate_batch(PROMPTS, PARAMS, SPECS["draft"])
    assert [r.token_ids for r in results] == reference["draft"]
    assert be.stats.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)


def test_arrivals_and_cancellations_mid_flight(engine, reference):
    spec = SPECS["draft"]
    be = BatchEngine(engine, max_batch=4)
    baseline = (be.free_slots, be.kv_used_tokens)
    a = be.submit(PROMPTS[7], PARAMS[7], spec)
    b = be.submit(PROMPTS[5], PARAMS[5], spec)
    for _ in range(3):
        be.step()
    c = be.submit(PROMPTS[3], PARAMS[3], spec)  # arrives mid-flight
    be.step()
    used = be.kv_used_tokens
    assert be.num_running == 3 and not b.done
    assert b.cancel() and b.done and b.finish_reason == "cancelled"
    # Freed at once: slot and reserved tokens.
    assert be.num_running == 2 and be.free_slots == 2
    assert be.kv_used_tokens == used - (len(PROMPTS[5]) + PARAMS[5].max_tokens)
    partial = b.result().token_ids
    assert 0 < len(partial) < len(reference["draft"][5]) and partial == reference["draft"][5][:len(partial)]
    d = be.submit(PROMPTS[1], PARAMS[1], spec)  # takes the freed slot
    be.step()
    assert not b.cancel()  # already finished
    be.run_until_done()
    assert a.result().token_ids == reference["draft"][7]
    assert c.result().token_ids == reference["draft"][3]
    assert d.result().token_ids == reference["draft"][1]
    assert (be.free_slots, be.kv_used_tokens, be.num_running) == baseline + (0,)


def test_cancel_waiting_and_from_callback(engine, reference):
    be = BatchEngine(engine, max_batch=1)
    seen: list[list[int]] = []

    def stop_after_two(tokens: list[int]) -> bool:
        seen.append(tokens)
        return len(seen) < 2

    first = be.submit(PROMPTS[3], PARAMS[3], SPECS["ngram"], on_tokens=stop_after_two)
    waiting = be.submit(PROMPTS[2], PARAMS[2])
    last = be.submit(PROMPTS[4], PARAMS[4])
    assert be.num_waiting == 3  # admission happens in step()
    assert waiting.cancel() and be.num_waiting == 2
    assert waiting.result().token_ids == [] and waiting.finish_reason == "cancelled"
    be.run_until_done()
    assert first.finish_reason == "cancelled" and first.result().token_ids == sum(seen, [])
    assert last.result().token_ids == reference["plain"][4]
    assert be.free_slots == 1 and be.kv_used_tokens == 0


@pytest.mark.parametrize("spec", [SPECS["plain"], SPECS["draft"], SPECS["ngram"]], ids=["plain", "draft", "ngram"])
def test_seeded_sampling_ignores_companions(engine, spec):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = PROMPTS[3]
    alone = engine.generate(prompt, params, spec)[0].token_ids

    be = BatchEngine(engine, max_batch=8)
    solo = be.generate_batch([prompt], params, spec)[0].token_ids
    others = [replace(params, seed=s) for s in (1, 2, 3)] + [SamplingParams(max_tokens=30)] * 2
    crowd = be.generate_batch(PROMPTS[:5] + [prompt], others + [params], spec)[-1].token_ids
    mixed = be.generate_batch([PROMPTS[1], prompt, PROMPTS[7], PROMPTS[0]], [others[0], params, others[3], others[1]],
                              [SPECS["draft"], spec, SPECS["ngram"], SPECS["plain"]])[1].token_ids
    assert solo == crowd == mixed == alone


def test_seeded_sampling_with_arrivals(engine):
    spec = SPECS["draft"]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    be = BatchEngine(engine, max_batch=4)
    h = be.submit(PROMPTS[1], params, spec)
    be.step()
    be.submit(PROMPTS[2], replace(params, seed=5), spec)
    be.step()
    be.submit(PROMPTS[4], SamplingParams(max_tokens=5), spec).cancel()
    be.run_until_done()
    assert h.result().token_ids == engine.generate(PROMPTS[1], params, spec)[0].token_ids


def test_oversize_request_fails_at_submit(engine):
    be = BatchEngine(engine, max_batch=2)
    with pytest.raises(VerispecError, match="prompt \\+ max_tokens"):
        be.submit(PROMPTS[7], SamplingParams(max_tokens=MAX_LEN))
    small = BatchEngine(engine, max_batch=2, kv_budget_tokens=40)
    with pytest.raises(VerispecError, match="KV budget holds 40"):
        small.submit(PROMPTS[7], SamplingParams(max_tokens=30))
    with pytest.raises(VerispecError):  # one bad prompt: nothing is queued
        be.generate_batch([PROMPTS[0], PROMPTS[1]], [SamplingParams(), SamplingParams(max_tokens=MAX_LEN)])
    assert be.num_waiting == 0 and be.kv_used_tokens == 0
    with pytest.raises(VerispecError, match="layer-skip"):
        be.submit(PROMPTS[0], SamplingParams(max_tokens=8), SpecConfig(k_policy="fixed", method="layerskip", k=2))


def test_memory_limit_sets_slots(engine):
    one = BatchEngine(engine, max_batch=8)
    per_slot = (one.cache.nbytes() + one.draft_model.cache.nbytes()) // one.slots
    assert BatchEngine(engine, max_batch=8, memory_limit=3 * per_slot + 1).slots == 3
    with pytest.raises(VerispecError, match="memory_limit"):
        BatchEngine(engine, max_batch=8, memory_limit=per_slot // 2)


def test_kv_budget_admits_fifo(engine, reference):
    # Budget for about two requests at a time: the rest wait, in order, and still match.
    be = BatchEngine(engine, max_batch=8, kv_budget_tokens=70)
    results = be.generate_batch(PROMPTS[:6], PARAMS[:6], SPECS["ngram"])
    assert [r.token_ids for r in results] == reference["ngram"][:6]
    assert max(be.stats.rows_steps) <= 3


def test_scheduler_is_fifo_without_overtaking():
    s: Scheduler[str] = Scheduler(slots=3, budget=100, max_len=100)
    for name, tokens in (("a", 60), ("b", 60), ("c", 10)):
        s.submit(name, tokens)
    assert [a.item for a in s.admit()] == ["a"]  # c fits but must not overtake b
    s.release(0)
    assert [(a.item, a.slot) for a in s.admit()] == [("b", 0), ("c", 1)]
    assert s.used_tokens == 70 and s.free_slots == 1
    with pytest.raises(VerispecError):
        s.check(101)


# -- the concurrency-aware policy ------------------------------------------------------------

def compute_bound(ms_per_token: float = 1.0, flat_until: int = 4) -> BatchCostModel:
    """A synthetic GPU: flat (memory-bound) up to ``flat_until`` scored tokens, then linear."""
    t = ms_per_token / 1e3
    return BatchCostModel(CostCurve({1: flat_until * t, flat_until: flat_until * t, 1024: 1024 * t}, smoothing=0),
                          CostCurve({1: 0.2 * t, 64: 0.2 * t}, smoothing=0))


def test_policy_speculates_alone_and_not_when_compute_bound():
    policy = BatchPolicy(compute_bound())
    alone = [RowPlan(cap=6, acceptance=0.8)]
    crowd = [RowPlan(cap=6, acceptance=0.8)] * 16
    assert policy.choose(alone) >= 2
    assert policy.choose(crowd) == 0
    # Even perfect acceptance cannot pay on a linear curve: no probing either.
    linear = BatchPolicy(BatchCostModel(CostCurve({1: 1e-3, 100: 0.1}, smoothing=0)), probe_every=2)
    assert [linear.choose([RowPlan(6, 0.99)] * 4) for _ in range(6)] == [0] * 6
    # Nor where perfect acceptance would win less than the margin a choice needs (16 rows, k = 2:
    # 48 tokens per 0.326 s vs 16 per 0.109 s, +0.7%; measured at 16 clients on this host).
    tie = BatchPolicy(BatchCostModel(CostCurve({16: 0.109, 48: 0.255}, smoothing=0),
                                     CostCurve({16: 0.0355}, smoothing=0)), probe_every=2)
    assert tie.goodput([RowPlan(5, 0.1)] * 16, 2, optimistic=True) > tie.goodput([RowPlan(5, 0.1)] * 16, 0)
    assert [tie.choose([RowPlan(5, 0.1)] * 16) for _ in range(6)] == [0] * 6
    # Fixed-k rows keep their k and widen the step for everyone.
    mixed = [RowPlan(cap=6, acceptance=0.8), RowPlan(cap=6, fixed_k=5)]
    assert policy.goodput(mixed, 0) < policy.goodput([RowPlan(cap=6, acceptance=0.8)] * 2, 0)


def test_policy_needs_a_clear_predicted_gain_to_speculate():
    # Flat target, draft forwards at 40% of a target step: a = 0.5 at k = 1 predicts 1.07x, a = 0.45 1.04x.
    costs = BatchCostModel(CostCurve({1: 0.1, 1024: 0.1}, smoothing=0), CostCurve({1: 0.04, 64: 0.04}, smoothing=0))
    policy = BatchPolicy(costs, probe_every=1000)
    row = [RowPlan(1, 0.45)]
    assert policy.goodput(row, 1) / policy.goodput(row, 0) == pytest.approx(1.036, abs=1e-3)
    assert policy.choose([RowPlan(cap=1, acceptance=0.5)] * 4) == 1
    assert policy.choose([RowPlan(cap=1, acceptance=0.45)] * 4) == 0
    assert BatchPolicy(costs, probe_every=1000, min_gain=0.0).choose([RowPlan(cap=1, acceptance=0.45)] * 4) == 1


def test_probes_that_change_nothing_come_ever_more_rarely():
    # Flat target, cheap drafts: perfect acceptance would pay, a = 0.1 does not (1.1 tokens per 0.11 s).
    costs = BatchCostModel(CostCurve({1: 0.1, 1024: 0.1}, smoothing=0), CostCurve({1: 0.01, 64: 0.01}, smoothing=0))
    policy = BatchPolicy(costs, probe_every=2)
    poor = [RowPlan(5, 0.1)] * 2
    chosen = [policy.choose([RowPlan(5, 0.1)] * 2) for _ in range(50)]
    assert [i + 1 for i, k in enumerate(chosen) if k] == [2, 6, 14, 30, 46]  # waits 2, 4, 8, 16 = 8 * 2 at most
    assert policy.choose([RowPlan(5, 0.9)] * 2) > 0  # speculating starts the schedule over
    assert [policy.choose(list(poor)) for _ in range(4)] == [0, policy.probe_k, 0, 0]


def test_the_probe_wait_starts_over_once_the_requests_it_looked_at_have_left():
    # Perfect acceptance would pay, a = 0.1 does not: probes fail, the wait doubles to 16 steps.
    costs = BatchCostModel(CostCurve({1: 0.1, 1024: 0.1}, smoothing=0), CostCurve({1: 0.01, 64: 0.01}, smoothing=0))
    policy = BatchPolicy(costs, probe_every=2)

    def step(*requests: int) -> int:
        return policy.choose([RowPlan(5, 0.1, request=r) for r in requests])

    chosen = [step(1, 2) for _ in range(40)]
    assert [i + 1 for i, k in enumerate(chosen) if k] == [2, 6, 14, 30]
    # Request 2 stays while 3 replaces 1: the back-off still holds (probes at 46, then 62).
    chosen = [step(2, 3) for _ in range(22)]
    assert [i + 41 for i, k in enumerate(chosen) if k] == [46, 62]
    # Both requests of the last probe have left: the next probe comes after 2 plain steps again.
    assert [step(4, 5) for _ in range(4)] == [0, policy.probe_k, 0, 0]
    # Rows without ids (callers that do not say) keep one back-off throughout.
    anonymous = BatchPolicy(costs, probe_every=2)
    chosen = [anonymous.choose([RowPlan(5, 0.1)] * 2) for _ in range(50)]
    assert [i + 1 for i, k in enumerate(chosen) if k] == [2, 6, 14, 30, 46]


def test_policy_picks_k0_in_the_engine_when_compute_bound(engine, reference):
    spec = SPECS["draft-cost"]
    be = BatchEngine(engine, max_batch=8, costs=BatchCostModel(CostCurve({1: 1e-3, 100: 0.1}, smoothing=0)))
    engine.answer_lengths.recent.clear()
    results = be.generate_batch(PROMPTS, PARAMS, spec)
    assert [r.token_ids for r in results] == reference["draft-cost"]
    # Finished requests teach the engine how long answers run (the policy's horizon).
    assert sorted(n for n, _ in engine.answer_lengths.recent) == sorted(len(r.token_ids) for r in results)
    assert set(be.stats.policy_k) == {0}
    assert all(set(r.metrics.k_chosen) == {0} for r in results)

    flat = BatchCostModel(CostCurve({1: 1e-2, 1024: 1e-2}, smoothing=0), CostCurve({1: 1e-4}, smoothing=0))
    be = BatchEngine(engine, max_batch=8, costs=flat)
    results = be.generate_batch(PROMPTS, PARAMS, spec)
    assert [r.token_ids for r in results] == reference["draft-cost"]
    assert max(be.stats.policy_k) == spec.k  # memory-bound: speculate as far as allowed
    assert be.stats.summary()["policy_k"] == be.stats.policy_k
    # Each finished request that drafted records its acceptance: the spread a probe's bound uses.
    (spread,) = be._seen_spread.values()
    assert len(spread.rates) == len(PROMPTS) and all(0 <= r <= 1 for r in spread.rates)


def test_policy_keeps_a_row_plain_when_its_draft_catch_up_cannot_pay_back():
    costs = BatchCostModel(CostCurve({1: 0.1, 64: 0.1}, smoothing=0), CostCurve({1: 0.01}, smoothing=0),
                           catch_up_per_token_s=0.005)
    policy = BatchPolicy(costs)
    # Both rows must read 500 prompt tokens (a forward plus 2.5 s) first; drafting saves a few
    # hundredths of a second per token: over 10 tokens that never pays, over 1000 it does.
    short = RowPlan(cap=5, acceptance=0.8, catch_up=500, horizon=10)
    long = RowPlan(cap=5, acceptance=0.8, catch_up=500, horizon=1000)
    caught_up = RowPlan(cap=5, acceptance=0.8, catch_up=0, horizon=10)
    assert policy.choose([short, long, caught_up]) > 0
    assert (short.cap, long.cap, caught_up.cap) == (0, 5, 5)
    alone = RowPlan(cap=5, acceptance=0.8, catch_up=500, horizon=10)
    assert policy.choose([alone]) == 0 and alone.cap == 0
    assert costs.catch_up_s(500) == pytest.approx(0.01 + 2.5) and costs.catch_up_s(0) == 0
    # A catch-up that costs about one draft forward pays back over the same 10 tokens.
    cheap = BatchPolicy(BatchCostModel(costs.target, costs.draft, catch_up_per_token_s=1e-6))
    row = RowPlan(cap=5, acceptance=0.8, catch_up=3, horizon=10)
    assert cheap.choose([row]) > 0 and row.cap == 5
    # A probe (poor acceptance keeps the batch plain) takes a row whose draft must catch up only if
    # perfect acceptance would win the read back: at k = 2 two rows save 0.03 s per token, which
    # pays 2.51 s over 1000 tokens but not over 50.
    prober = BatchPolicy(costs, probe_every=1)
    far, short = (RowPlan(cap=5, acceptance=0.01, catch_up=500, horizon=1000),
                  RowPlan(cap=5, acceptance=0.01, catch_up=500, horizon=50))
    assert prober.choose([far, short]) == prober.probe_k and (far.cap, short.cap) == (5, 0)
    # Measured catch-ups: what exceeds one one-row forward each is charged per token read.
    costs.observe_catch_up(count=2, tokens=100, seconds=2 * 0.01 + 0.1)
    assert costs.catch_up_per_token_s == pytest.approx(0.005 + 0.1 * (0.001 - 0.005))


def xeon_costs() -> BatchCostModel:
    """The batch costs profiled on an Intel Xeon host with AVX-512 BF16 (dense bf16 target, int4 draft, 4 slots)."""
    target = {1: 0.1436, 2: 0.1528, 3: 0.1393, 4: 0.1548, 5: 0.1696, 6: 0.1766, 8: 0.1888, 10: 0.2362,
              12: 0.2608, 16: 0.3194, 20: 0.3859, 24: 0.4313}
    return BatchCostModel(CostCurve(target, smoothing=0), CostCurve({1: 0.0188, 2: 0.0241, 4: 0.0310}, smoothing=0),
                          catch_up_per_token_s=0.004, per_position=ContextCost(64, 1.23e-6, 1.89e-6))


def test_every_catch_up_a_step_pays_for_is_won_back_at_the_k_it_runs():
    # The Xeon host's costs and a step from its trace at 4 clients: one row drafts from a current
    # cache, three must first read their prompts. At the first pass (k = 1, every row drafting) the
    # 53- and 70-token reads pay; the 487-token one does not, and without that row drafting the
    # saving no longer pays for the other two either.
    costs = xeon_costs()
    policy = BatchPolicy(costs)

    def rows() -> list[RowPlan]:
        return [RowPlan(cap=5, acceptance=a, catch_up=c, horizon=40, context=488)
                for a, c in ((0.58, 0), (0.87, 487), (0.87, 53), (0.87, 70))]

    first = rows()
    k = policy._best_k(first, None)
    assert k == 1 and policy._saving(first, None, k) * 40 > costs.catch_up_s(70) > costs.catch_up_s(53)
    plans = rows()
    k = policy.choose(plans)
    assert [p.cap for p in plans] == [5, 0, 0, 0] and k == 0
    # The invariant behind it, with better acceptance and two longer answers: whatever k runs, every
    # row reading context first wins its read back at that k.
    plans = [RowPlan(cap=5, acceptance=0.95, catch_up=c, horizon=h, context=488)
             for c, h in ((0, 40), (487, 40), (53, 80), (70, 80))]
    k = policy.choose(plans)
    assert k > 0 and [p.cap for p in plans] == [5, 0, 5, 5]
    saving = policy._saving(plans, None, k)
    assert all(saving * p.horizon > costs.catch_up_s(p.catch_up) for p in plans if p.cap and p.must_catch_up)


def test_no_probe_runs_where_no_acceptance_it_could_show_changes_the_choice():
    # A step from the Xeon host's trace at 4 clients (its costs, as above): every row's draft lags
    # (they decoded plainly), their acceptance estimates already say drafting would pay, and what
    # keeps the batch plain is the reads. A probe could take one row (the one that wins its read
    # back fastest), but with the other three still kept out by their reads, a padded step in which
    # one row drafts never pays, whatever acceptance the probe shows: it would only cost.
    costs = xeon_costs()
    policy = BatchPolicy(costs, probe_every=1)

    def lagging() -> list[RowPlan]:
        return [RowPlan(cap=5, acceptance=0.86, catch_up=c, horizon=h, context=130, spread=0.1)
                for c, h in ((116, 10), (127, 15), (76, 17), (58, 31))]

    assert [policy.choose(lagging()) for _ in range(3)] == [0, 0, 0]
    assert policy.probes.gap == 1  # never ran, so the wait did not grow: still due for the next batch
    # The row such a probe would have taken, alone (one client) and with a poor estimate: drafting
    # from a current draft would pay at its plausible best, so it is probed, read and all.
    alone = RowPlan(cap=5, acceptance=0.1, catch_up=58, horizon=31, context=130, spread=0.25)
    assert policy.choose([alone]) == policy.probe_k and alone.cap == 5


def test_a_catch_up_is_weighed_against_the_batch_with_its_fixed_k_rows_drafting():
    # A row with a fixed k already pays for the draft forwards and the wide step; a policy row drafting
    # beside it costs next to nothing more, so its cheap prompt read pays. Weighed against an all-plain
    # step, the batch looked like it lost by drafting and the policy row never read its prompt.
    # Eight rows as the real pair's mixed-spec test starts them: the draft model at a fixed k = 4,
    # under the policy, lookups at k = 3, no drafting; each twice.
    costs = BatchCostModel(CostCurve({1: 0.1, 64: 0.1}, smoothing=0), CostCurve({1: 0.01}, smoothing=0))
    policy = BatchPolicy(costs)

    def rows() -> list[RowPlan]:
        return [RowPlan(cap=4, fixed_k=4), RowPlan(cap=4, acceptance=0.6, catch_up=6, horizon=9),
                RowPlan(cap=3, fixed_k=3, model_draft=False), RowPlan(cap=0, model_draft=False),
                RowPlan(cap=4, fixed_k=4), RowPlan(cap=4, acceptance=0.6, catch_up=16, horizon=21),
                RowPlan(cap=3, fixed_k=3, model_draft=False), RowPlan(cap=0, model_draft=False)]

    assert policy.goodput(rows(), 4) > 1.15 * policy.goodput(rows(), 0)
    plans = rows()
    assert policy.choose(plans) > 0 and plans[1].cap == plans[5].cap == 4


def test_a_lone_row_that_went_plain_is_probed_again():
    # Once plain, a lone row's draft always lags (it did not read what plain steps generated). The
    # probe takes it when perfect acceptance would win that read back, as CostK probes a request;
    # keeping it out locked one client into plain decoding for the rest of its request.
    costs = BatchCostModel(CostCurve({1: 0.1, 64: 0.1}, smoothing=0), CostCurve({1: 0.01}, smoothing=0),
                           catch_up_per_token_s=0.005)
    policy = BatchPolicy(costs, probe_every=2)
    lagging = [RowPlan(cap=5, acceptance=0.1, catch_up=8, horizon=100) for _ in range(2)]
    assert [policy.choose([p]) for p in lagging] == [0, policy.probe_k] and lagging[1].cap == 5
    # A read that even perfect acceptance cannot win back: no probe (it would learn nothing), and
    # the wait for the next one does not grow.
    hopeless = BatchPolicy(costs, probe_every=2)
    assert [hopeless.choose([RowPlan(cap=5, acceptance=0.1, catch_up=500, horizon=20)]) for _ in range(6)] == [0] * 6
    assert hopeless.probes.gap == 2


def test_a_row_the_prior_keeps_out_of_drafting_can_still_be_probed():
    # A new request at one client: at the prior acceptance (0.6) drafting saves too little to pay
    # for reading its 200-token prompt, so it decodes plainly; perfect acceptance would pay, so a
    # due probe takes it. Before, the first pass had set its cap to 0 and no probe ever could.
    costs = BatchCostModel(CostCurve({1: 0.1, 64: 0.1}, smoothing=0), CostCurve({1: 0.03}, smoothing=0),
                           catch_up_per_token_s=0.005)
    policy = BatchPolicy(costs, probe_every=2)
    row = RowPlan(cap=5, acceptance=0.6, catch_up=200, horizon=40)
    assert policy._best_k([RowPlan(cap=5, acceptance=0.6)], None) > 0  # drafting pays once caught up
    assert policy.choose([row]) == 0 and row.cap == 0
    row = RowPlan(cap=5, acceptance=0.6, catch_up=200, horizon=40)
    assert policy.choose([row]) == policy.probe_k and row.cap == 5


def test_a_probe_that_no_row_could_join_stays_due_for_the_next_request():
    # At one client the probe wait grows past an answer's length. A probe falling due near the end
    # of a request, whose few remaining tokens cannot win its draft's catch-up back, must wait for
    # the next request rather than start the whole wait over: that locked one client plain for good.
    costs = BatchCostModel(CostCurve({1: 0.1, 64: 0.1}, smoothing=0), CostCurve({1: 0.01}, smoothing=0),
                           catch_up_per_token_s=0.005)
    policy = BatchPolicy(costs, probe_every=4)
    policy.probes._gap = 16  # backed off by earlier probes that changed nothing

    def row(catch_up: int, horizon: int) -> RowPlan:
        return RowPlan(cap=5, acceptance=0.1, catch_up=catch_up, horizon=horizon)

    # One request's last 40 steps: its catch-up (0.01 + 100 * 0.005 s) never pays over 6 tokens (0.06 s each).
    assert [policy.choose([row(100, 6)]) for _ in range(40)] == [0] * 40
    # The next request, its whole answer ahead, is probed on its first step, prompt catch-up and all.
    first = row(50, 100)
    assert policy.choose([first]) == policy.probe_k and first.cap == 5
    assert policy.probes.gap == 16  # the probe ran: a wait only grows if it changes nothing
    assert policy.choose([row(1, 99)]) == 0 and policy.probes.gap == 32


def test_a_probe_pays_for_one_catch_up_at_most():
    # Three rows whose drafts lag (a shrinking batch after plain steps): perfect acceptance would
    # win each read back, but a probe only needs one row to measure the drafter, so it reads the
    # context of the row that wins its read back fastest and the others decode plainly. Before,
    # all three read their contexts.
    costs = BatchCostModel(CostCurve({1: 0.1, 64: 0.1}, smoothing=0), CostCurve({1: 0.01}, smoothing=0),
                           catch_up_per_token_s=0.001)
    policy = BatchPolicy(costs, probe_every=1)
    rows = [RowPlan(cap=5, acceptance=0.1, catch_up=c, horizon=h) for c, h in ((100, 40), (50, 40), (50, 10))]
    assert policy.choose(rows) == policy.probe_k
    assert [r.cap for r in rows] == [0, 5, 0]
    # A row whose draft is already current measures acceptance for free: no row catches up.
    policy = BatchPolicy(costs, probe_every=1)
    rows = [RowPlan(cap=5, acceptance=0.1, catch_up=50, horizon=40), RowPlan(cap=5, acceptance=0.1, horizon=40)]
    assert policy.choose(rows) == policy.probe_k
    assert [r.cap for r in rows] == [0, 5]


def test_a_full_batch_is_probed_only_if_its_mean_acceptance_could_plausibly_pay():
    # A CPU-like curve: 24 scored tokens cost 2.5x what 8 do. Eight rows drafting two tokens pay at
    # perfect acceptance (+14%), but not at 0.6 + 2 * 0.25 / sqrt(8) = 0.78, the best mean eight
    # requests plausibly reach when one request's acceptance varies by 0.25: no probe. A lone row
    # with a poor record (0.3, plain at its estimate) is plausibly at 0.8, which pays: probed.
    costs = BatchCostModel(CostCurve({1: 0.1, 8: 0.3, 24: 0.75}, smoothing=0),
                           CostCurve({1: 0.01, 8: 0.02}, smoothing=0))

    def probe(n: int, acceptance: float, spread: float | None) -> int:
        plans = [RowPlan(cap=5, acceptance=acceptance, horizon=40, spread=spread) for _ in range(n)]
        return BatchPolicy(costs, probe_every=1).choose(plans)

    assert probe(8, 0.6, None) == 2  # no spread given: perfect acceptance, as before
    assert probe(8, 0.6, 0.25) == 0
    assert probe(1, 0.3, 0.25) == 2
    # A drafter whose requests differ widely keeps a full batch's best mean high enough to look.
    assert probe(8, 0.6, 0.5) == 2


def test_a_catch_up_is_weighed_against_the_batch_the_joining_rows_make():
    # Drafting pays for one or two rows but not for eight (compute_bound()). A row whose draft must
    # first read its prompt catches up when alone, but not when seven more rows are about to join
    # (prefilling, or waiting for a slot): the full batch will decode plainly, and the read would
    # never be won back.
    costs = compute_bound()
    costs.catch_up_per_token_s = 1e-5
    policy = BatchPolicy(costs, probe_every=1000)

    def row(catch_up: int = 100) -> RowPlan:
        return RowPlan(cap=5, acceptance=0.8, catch_up=catch_up, horizon=40)

    alone, crowded, few, ready = row(), row(), row(), row(catch_up=0)
    assert policy.choose([alone]) > 0 and alone.cap == 5
    assert policy.choose([crowded], joining=7) == 0 and crowded.cap == 0
    assert policy.choose([few], joining=1) > 0 and few.cap == 5  # two rows still pay
    assert policy.choose([ready], joining=7) > 0 and ready.cap == 5  # nothing to win back: drafts meanwhile


def test_a_lone_request_is_probed_when_the_single_request_engine_would_probe_it():
    # Same costs, same poor acceptance: the batch policy at one client waits as long before each
    # probe, and backs off as far, as the single-request engine's cost policy.
    single = CostK(CostModel(draft_s=0.05, verify_s=[0.1] * 6), k_max=5,
                   acceptance=Acceptance(prior_a=0.1, prior_weight=1e9))
    batch = BatchPolicy(BatchCostModel(CostCurve({m: 0.1 for m in range(1, 7)}, smoothing=0),
                                       CostCurve({1: 0.05}, smoothing=0)))
    chosen_alone = [single.choose(5) for _ in range(100)]
    chosen_batch = [batch.choose([RowPlan(cap=5, acceptance=0.1, request=1)]) for _ in range(100)]
    assert chosen_batch == chosen_alone
    assert [i + 1 for i, k in enumerate(chosen_batch) if k] == [8, 24, 56]


def test_long_contexts_make_drafting_dearer_not_free():
    # Measured on the AVX2 host at 16 clients: 16 and 32 scored tokens cost 0.7 s and 1.34 s at a
    # 64-token context, and each scored token pays ~55 us per further position (the draft's rows
    # ~35 us). Plain steps of 16 rows near context 1000 take 1.52 s.
    def costs(per_position: bool) -> BatchCostModel:
        return BatchCostModel(CostCurve({16: 0.7, 32: 1.34}), CostCurve({16: 0.25}),
                              per_position=ContextCost(64, 55e-6, 35e-6) if per_position else ContextCost())

    def after_plain_steps(model: BatchCostModel) -> BatchPolicy:
        for _ in range(30):
            model.observe_target(16, 0.7 + 16 * 936 * 55e-6, context=1000)
        return BatchPolicy(model, probe_every=1000)

    batch = [RowPlan(cap=5, acceptance=0.7, context=1000)] * 16
    # Context-blind, the plain steps raise only the 16-token point; pooled with the 32-token one
    # (still at its short-context time) drafting one token looks nearly free, and is chosen.
    blind = after_plain_steps(costs(per_position=False))
    assert blind.costs.target(32) <= blind.costs.target(16) * 1.01
    assert blind.choose(list(batch)) > 0
    # With the per-position cost the same steps are what the model predicts: the curve keeps its
    # profiled shape, and two 1000-token-context tokens per row cost what they do: plain.
    aware = after_plain_steps(costs(per_position=True))
    assert aware.costs.target.points[16] == pytest.approx(0.7)
    assert aware.costs.step_s(16, 0, context=1000) == pytest.approx(0.7 + 16 * 936 * 55e-6)
    assert aware.costs.step_s(16, 1, context=1000) == pytest.approx(
        0.25 + 16 * 936 * 35e-6 + 1.34 + 32 * 936 * 55e-6)
    assert aware.choose(list(batch)) == 0
    # A step's context is its longest row's; a short context costs what was profiled.
    assert aware.goodput([RowPlan(5, 0.7, context=64)] * 15 + [RowPlan(5, 0.7, context=1000)], 0) == \
        pytest.approx(16 / aware.costs.step_s(16, 0, context=1000))
    assert aware.costs.step_s(16, 1, context=10) == pytest.approx(0.25 + 1.34)
    # A time the context does not explain still teaches the curve (here 0.1 s slower than predicted).
    aware.costs.observe_target(16, 0.7 + 16 * 936 * 55e-6 + 0.1, context=1000)
    assert aware.costs.target.points[16] == pytest.approx(0.71)
    with pytest.raises(ValueError):
        ContextCost(64, target_s=-1.0)


def test_cost_curve_learns_between_profiled_points_only():
    curve = CostCurve({1: 1.0, 5: 2.0}, smoothing=0.5)
    curve.observe(4, 2.75)  # read 1.75 there: an error of 1.0, shared 1/4 : 3/4 by the neighbours
    assert curve.points == {1: 1.125, 5: 2.375}
    curve.observe(9, 100.0)  # outside the profiled range: ignored
    assert curve.points == {1: 1.125, 5: 2.375}
    curve.observe(5, 2.375 + 1.0)
    assert curve.points[5] == 2.875


def test_cost_curve_pools_an_outlier_with_its_neighbours():
    assert monotone_fit([1.0, 3.0, 1.0, 1.0, 5.0]) == [1.0, 5 / 3, 5 / 3, 5 / 3, 5.0]
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # A lone request's verify curve with one slow profile point at 3 tokens (measured on this
    # host): a running maximum priced every k >= 2 at the spike and the policy drafted 1 token.
    curve = CostCurve({1: 0.0755, 2: 0.0778, 3: 0.1217, 4: 0.0782, 5: 0.0779, 6: 0.0790}, smoothing=0)
    assert curve(6) < 0.0905 and curve(2) < curve(3) <= curve(6)
    policy = BatchPolicy(BatchCostModel(curve, CostCurve({1: 0.0108}, smoothing=0)))
    assert policy.choose([RowPlan(cap=5, acceptance=0.8)]) == 5


def test_profiled_costs_are_monotone(engine):
    be = BatchEngine(engine, max_batch=4)
    costs = be.profile(k_max=3, context=32)
    # A tiny draft reads 32 tokens about as fast as one (overhead-bound): the read's cost beyond one
    # forward can be timed as 0, never below.
    assert costs.catch_up_per_token_s >= 0
    # What each further position costs is timed within a slot's length (124 here, not 8 x 32).
    assert costs.per_position.context == 32
    assert costs.per_position.target_s >= 0 and costs.per_position.draft_s >= 0
    assert set(costs.target.points) >= {1, 4, 16}
    assert costs.draft is not None
    values = [costs.target(t) for t in range(1, 40)]
    assert values == sorted(values) and values[0] > 0


# -- API: streaming, background runner, text and stop strings -----------------------------

def test_streaming_sync_async_and_background(engine, reference):
    be = BatchEngine(engine, max_batch=4)
    h = be.submit(PROMPTS[5], PARAMS[5], SPECS["draft"])
    chunks = list(h)  # drives the steps itself: no runner
    assert sum(chunks, []) == reference["draft"][5] and len(chunks) > 1

    async def consume() -> list[list[int]]:
        handles = [be.submit(p, pa, SPECS["ngram"]) for p, pa in zip(PROMPTS[:3], PARAMS[:3], strict=True)]
        streams = await asyncio.gather(*(_collect(x) for x in handles))
        assert [(await x.aresult()).token_ids for x in handles] == [sum(s, []) for s in streams]
        return [sum(s, []) for s in streams]

    assert asyncio.run(consume()) == reference["ngram"][:3]
    be.start()
    try:
        assert asyncio.run(consume()) == reference["ngram"][:3]
        h = be.submit(PROMPTS[7], PARAMS[7], SPECS["plain"])
        assert h.result(timeout=60).token_ids == reference["plain"][7]
    finally:
        be.stop()
    assert not be.running and be.free_slots == 4


def test_background_runner_with_submitters_on_many_threads(engine, reference):
    be = BatchEngine(engine, max_batch=3)
    out: dict[int, list[int]] = {}

    def client(indices: list[int]) -> None:
        handles = {i: be.submit(PROMPTS[i], PARAMS[i], SPECS["draft"]) for i in indices}
        for i, h in handles.items():
            out[i] = h.result(timeout=60).token_ids

    be.start()
    try:
        threads = [threading.Thread(target=client, args=([i, i + 4],)) for i in range(4)]
        for t in threads:
            t.start()
        victim = be.submit(PROMPTS[7], SamplingParams(max_tokens=50, ignore_eos=True))
        victim.cancel()  # from this thread, while the runner steps
        for t in threads:
            t.join(timeout=60)
    finally:
        be.stop()
    assert victim.finish_reason == "cancelled"
    assert [out[i] for i in range(len(PROMPTS))] == reference["draft"]
    assert be.free_slots == 3 and be.kv_used_tokens == 0


def test_submit_and_cancel_get_in_ahead_of_a_busy_runner(engine):
    # A runner stepping back to back must not keep other threads waiting for its lock: each
    # submit and cancel returns within the step in progress (Python's locks are not fair).
    be = BatchEngine(engine, max_batch=2)
    long = [be.submit(PROMPTS[i], SamplingParams(max_tokens=MAX_LEN - 20, ignore_eos=True)) for i in (0, 4)]
    be.start()
    try:
        waited = []
        for _ in range(20):
            before = be.stats.steps
            handle = be.submit(PROMPTS[1], SamplingParams(max_tokens=4))
            handle.cancel()
            waited.append(be.stats.steps - before)
        assert all(not h.done for h in long), "the long requests ran out before the check ended"
    finally:
        be.stop(cancel=True)
    assert max(waited) <= 2, waited  # the step in progress at each call, nothing more
    assert be.free_slots == 2 and be.kv_used_tokens == 0


async def _collect(handle) -> list[list[int]]:
    return [chunk async for chunk in handle]


def test_text_and_stop_strings_match_engine(tmp_path):
    folder = build_tok_model(tmp_path / "tok")
    engine = Engine.from_pretrained(str(folder), dtype="float32", max_len=MAX_LEN, progress=False)
    prompts = ["write a story about the cat", "what is the dog ?", "hello world"]
    plain = engine.generate(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True), chat=True)[0]
    stop = plain.text.split()[4]  # a word the greedy output is known to contain
    params = SamplingParams(max_tokens=12, stop=(stop,))
    ref = engine.generate(prompts, params, SpecConfig(k_policy="fixed", method="ngram", k=3), chat=True)
    got = BatchEngine(engine, max_batch=2).generate_batch(prompts, params, SpecConfig(k_policy="fixed",
                                                                                      method="ngram", k=3),
                                                           chat=True)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == \
        [(r.token_ids, r.text, r.finish_reason) for r in ref]


# -- faults stay with the request that causes them ------------------------------------------------


def _learned(be: BatchEngine) -> tuple:
    """The objects the engine learned into: cost model, policy and every acceptance estimate."""
    return be.costs, be.policy, dict(be._seen_acceptance), dict(be._seen_spread)


def test_a_failing_drafter_fails_only_its_request(engine, reference):
    be = BatchEngine(engine, max_batch=4)
    runs = [(0, "plain"), (1, "draft"), (3, "draft-cost")]
    handles = [be.submit(PROMPTS[i], PARAMS[i], SPECS[name]) for i, name in runs]
    bad = be.submit(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True), SPECS["ngram"],
                    drafter=FailingDrafter(after=3))
    be.step()  # the first step profiles the cost policy (rows "draft-cost" follow it)
    learned = _learned(be)
    assert learned[0] is not None and learned[1] is not None
    with pytest.raises(RuntimeError, match="injected drafter fault"):
        bad.result()
    assert sum(not h.done for h in handles) >= 2  # others were still running when it failed
    assert [h.result().token_ids for h in handles] == [reference[name][i] for i, name in runs]
    assert be.failed is None and be.stats.rows_steps.get(4, 0) >= 3
    after = _learned(be)
    assert after[0] is learned[0] and after[1] is learned[1]
    for seen_before, seen_after in zip(learned[2:], after[2:], strict=True):
        assert all(seen_after[key] is value for key, value in seen_before.items())
    # The slot it held serves new requests as before.
    again = be.generate_batch([PROMPTS[2]], PARAMS[2], SPECS["ngram"])
    assert again[0].token_ids == reference["ngram"][2]
    assert be.num_running == 0 and be.kv_used_tokens == 0


class PoisonedTarget:
    """The target, except that a decode or verification forward raises when a row's last token is ``poison``."""

    def __init__(self, target, poison: int) -> None:
        self.target, self.poison, self.raised = target, poison, 0

    def __call__(self, tokens, positions, cache, **kwargs):
        if not kwargs.get("last_only") and bool((tokens[:, 0] == self.poison).any()):
            self.raised += 1
            raise RuntimeError("injected forward fault")
        return self.target(tokens, positions, cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_a_failing_shared_forward_fails_only_the_row_that_causes_it(engine, reference):
    runs = [(0, "plain"), (1, "draft"), (4, "ngram")]
    used = {t for i, name in runs for t in PROMPTS[i] + reference[name][i]}
    poison = next(t for t in range(2, engine.target.args.vocab_size) if t not in used)
    be = BatchEngine(engine, max_batch=4)
    be.target = PoisonedTarget(be.target, poison)  # the row with the poisoned token breaks the batched forward
    handles = [be.submit(PROMPTS[i], PARAMS[i], SPECS[name]) for i, name in runs]
    bad = be.submit([5, 6, poison], SamplingParams(max_tokens=20, ignore_eos=True), SPECS["draft"])
    with pytest.raises(RuntimeError, match="injected forward fault"):
        bad.result()
    assert be.target.raised == 2  # the batched forward, then the row alone
    assert [h.result().token_ids for h in handles] == [reference[name][i] for i, name in runs]
    assert be.failed is None and be.num_running == 0 and be.kv_used_tokens == 0


def test_a_request_whose_callback_raises_fails_alone(engine, reference):
    be = BatchEngine(engine, max_batch=2)

    def broken(tokens):
        raise ValueError("the client's callback broke")

    bad = be.submit(PROMPTS[1], PARAMS[1], SPECS["draft"], on_tokens=broken)
    good = be.submit(PROMPTS[3], PARAMS[3], SPECS["draft"])
    with pytest.raises(ValueError, match="callback broke"):
        bad.result()
    assert good.result().token_ids == reference["draft"][3]


# -- wide steps and the cost policy's profile -----------------------------------------------------


def test_a_65_wide_forward_matches_one_token_at_a_time(engine):
    # k = 64 verifies 65 tokens per row at once: past SMALL_M, through whatever attention this CPU runs.
    target = engine.target
    rows = [[(7 * i + 3 + r) % target.args.vocab_size for i in range(70)] for r in range(2)]
    tokens = torch.tensor(rows)
    wide_cache, step_cache = target.new_cache(2, 80), target.new_cache(2, 80)
    pos = torch.arange(70).expand(2, -1)
    target(tokens[:, :5], pos[:, :5], wide_cache)
    wide = target(tokens[:, 5:], pos[:, 5:], wide_cache)
    assert wide.shape[:2] == (2, 65)
    one = torch.stack([target(tokens[:, i:i + 1], pos[:, i:i + 1], step_cache)[:, 0] for i in range(70)], dim=1)
    torch.testing.assert_close(wide, one[:, 5:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shape"):  # 64 tokens at 65 positions: refused, not misread
        target(tokens[:, 5:69], pos[:, 5:], wide_cache)


def test_k_64_matches_plain_in_both_engines(engine):
    spec = SpecConfig(method="draft", k=64, k_policy="fixed")
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    plain = [engine.generate(p, params)[0].token_ids for p in PROMPTS[:2]]
    assert [engine.generate(p, params, spec)[0].token_ids for p in PROMPTS[:2]] == plain
    be = BatchEngine(engine, max_batch=2)
    assert [r.token_ids for r in be.generate_batch(PROMPTS[:2], params, spec)] == plain
    assert max(be.stats.width_steps) == 65


def test_the_cost_policy_is_never_profiled_for_a_request_s_k(engine, monkeypatch):
    import verispec.engine.batch as batch_module
    from verispec.engine.policy import PROFILE_K

    profiled = []
    original = batch_module.BatchEngine.profile

    def spy(self, k_max=PROFILE_K, context=64):
        profiled.append(k_max)
        return original(self, k_max, context)

    monkeypatch.setattr(batch_module.BatchEngine, "profile", spy)
    be = BatchEngine(engine, max_batch=2)
    wide = SpecConfig(method="draft", k=40, k_policy="cost")
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    out = be.generate_batch(PROMPTS[:2], params, wide)
    assert profiled == [PROFILE_K]  # the engine's own width: a k = 40 request did not size it
    assert [r.token_ids for r in out] == [engine.generate(p, params)[0].token_ids for p in PROMPTS[:2]]
    # Profiling past the context it runs at (widths above 64 at a 16-token context) is fine too.
    assert len(be.profile(k_max=70, context=16).target.points) > 0


def test_the_one_request_cost_model_is_profiled_once(engine, monkeypatch):
    from verispec.engine.policy import PROFILE_K

    eng = make_engine_like(engine)
    calls = []
    original = eng.profile
    monkeypatch.setattr(eng, "profile", lambda *a, **kw: calls.append(a[1]) or original(*a, **kw))
    small, large = SpecConfig(method="draft", k=3), SpecConfig(method="draft", k=20)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = eng.generate(PROMPTS[1], params)[0].token_ids
    assert eng.generate(PROMPTS[1], params, small)[0].token_ids == plain
    assert eng.generate(PROMPTS[1], params, large)[0].token_ids == plain  # k = 20: priced, not re-profiled
    assert calls == [PROFILE_K]
    costs = eng.cost_model(large, eng.drafter(large))
    assert len(costs.verify_s) == PROFILE_K + 1 and costs.score_s(21) >= costs.score_s(PROFILE_K + 1)


def make_engine_like(engine: Engine) -> Engine:
    """A fresh engine over the same models (its own caches and cost models)."""
    return Engine(engine.config, engine.target, None, engine.eos_ids, draft=engine.draft)
