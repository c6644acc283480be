"""`verispec advise` and the cost model behind the `cost` k policy."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from verispec.advise import advise, format_advice
from verispec.engine.policy import (
    MIN_GAIN,
    Acceptance,
    AcceptanceSpread,
    AnswerLengths,
    ContextCost,
    CostK,
    CostModel,
    expected_tokens,
    per_position_s,
)


def test_expected_tokens_matches_the_geometric_sum():
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in range(6):
            assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5.0


def test_cost_model_prefers_plain_when_drafts_are_expensive_and_deep_k_when_cheap():
    flat = [0.1] * 9
    assert CostModel(draft_s=0.2, verify_s=list(flat)).best_k(0.5, 8) == 0  # a draft token costs 2 target steps
    assert CostModel(draft_s=0.001, verify_s=list(flat)).best_k(0.9, 8) == 8  # free drafts, flat verification
    steep = [0.1 * (1 + m) for m in range(9)]  # verification compute-bound: every scored token costs a step
    assert CostModel(draft_s=0.001, verify_s=steep).best_k(0.6, 8) == 0


def test_a_marginal_predicted_gain_stays_plain():
    costs = CostModel(draft_s=0.01, verify_s=[0.1, 0.1, 0.1])
    # a = 0.13: k = 1 is predicted 1.03x plain decoding, k = 2 less.
    assert costs.speedup(0.13, 1) == pytest.approx(1.03, abs=0.01)
    assert costs.best_k(0.13, 2) == 1
    assert costs.best_k(0.13, 2, min_gain=0.05) == 0
    assert costs.best_k(0.5, 2, min_gain=0.05) == 2  # 1.46x: clears the bar
    assert CostK(costs, k_max=2, acceptance=Acceptance(prior_a=0.13, prior_weight=1e9)).choose(2) == 0


def test_online_timings_rescale_the_whole_curve():
    costs = CostModel(draft_s=0.01, verify_s=[0.1, 0.11, 0.12])
    for _ in range(200):
        costs.observe(k=1, drafted=1, propose_s=0.01, score_s=0.22)  # the machine got twice as slow
    assert costs.verify_s[0] == pytest.approx(0.2, rel=1e-3)
    assert costs.verify_s[2] == pytest.approx(0.24, rel=1e-3)  # never observed, corrected with the rest


def test_long_contexts_make_a_lone_requests_drafts_dearer():
    # Each scored token (draft token) pays per position beyond the profiled 64: at 1000 positions
    # three scored tokens cost 0.14 s more than at 64, where one costs 0.05 s more.
    costs = CostModel(draft_s=0.01, verify_s=[0.1, 0.1, 0.1], per_position=ContextCost(64, 50e-6, 20e-6))
    assert costs.step_s(2, context=1000) == pytest.approx(2 * (0.01 + 936 * 20e-6) + 0.1 + 3 * 936 * 50e-6)
    assert costs.step_s(2, context=10) == costs.step_s(2) == pytest.approx(0.12)
    assert costs.best_k(0.5, 2, MIN_GAIN) == 2
    assert costs.best_k(0.5, 2, MIN_GAIN, context=1000) == 0
    # Plain steps at 1000 positions take what the context explains: the curve's level holds.
    # Context-blind, the same steps raise it by half and the drafts (whose cost stays) look cheap.
    blind = CostModel(draft_s=0.01, verify_s=[0.1, 0.1, 0.1])
    for model in (costs, blind):
        for _ in range(100):
            model.observe(0, 0, 0.0, 0.1 + 936 * 50e-6, context=1000)
    assert costs.verify_s == pytest.approx([0.1, 0.1, 0.1])
    assert blind.verify_s[0] == pytest.approx(0.1468, rel=1e-3)
    policies = [CostK(m, k_max=2, acceptance=Acceptance(prior_a=0.5, prior_weight=1e9)) for m in (costs, blind)]
    assert [p.choose(2, context=1000) for p in policies] == [0, 2]
    # A time the context does not explain still moves the level.
    costs.observe(0, 0, 0.0, 0.11 + 936 * 50e-6, context=1000)
    assert costs.verify_s[0] == pytest.approx(0.101)


def test_per_position_cost_is_the_median_slope_never_negative():
    short = {(1, 1): 0.1, (1, 3): 0.12, (4, 1): 0.2}
    long = {(1, 1): 0.1 + 100 * 1e-4, (1, 3): 0.12 + 3 * 100 * 2e-4, (4, 1): 0.2 + 4 * 100 * 3e-4}
    assert per_position_s(short, long, 64, 164) == pytest.approx(2e-4)
    assert per_position_s(short, {(1, 1): 0.09}, 64, 164) == 0.0  # noise made the long forward faster
    assert per_position_s(short, long, 64, 64) == 0.0 and per_position_s(short, {}, 64, 164) == 0.0
    with pytest.raises(ValueError):
        ContextCost(64, draft_s=-1.0)


def test_the_engine_profiles_what_each_further_position_costs(qwen2_tiny, qwen2_draft_tiny):
    from verispec import Engine, SamplingParams, SpecConfig

    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    progress=False)
    spec = SpecConfig("draft", k=3, k_policy="cost")
    costs = engine.profile(engine.drafter(spec), k_max=3, context=16)
    assert costs.per_position.context == 16 and len(costs.verify_s) == 4
    assert costs.per_position.target_s >= 0 and costs.per_position.draft_s >= 0
    assert costs.draft_s > 0 and all(t > 0 for t in costs.verify_s)
    # No room for a longer context: no per-position term (and no error).
    assert engine.profile(None, k_max=3, context=16, long_context=8).per_position.target_s == 0.0
    # The profile leaves the engine ready: a request afterwards decodes as before.
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert engine.generate([3, 4, 5], params, spec)[0].token_ids == engine.generate([3, 4, 5], params)[0].token_ids


def test_cost_policy_probes_after_a_run_of_plain_steps():
    # Poor acceptance keeps it plain, but cheap drafts could pay: probe after 4 plain steps. Each
    # probe that leaves the policy plain doubles the wait (8, 16, then 32 = 8 * probe_every at most).
    policy = CostK(CostModel(draft_s=0.05, verify_s=[0.1] * 6), k_max=5, acceptance=Acceptance(prior_a=0.1),
                   probe_every=4, probe_k=2)
    chosen = [policy.choose(5) for _ in range(130)]
    probes = [i + 1 for i, k in enumerate(chosen) if k]
    assert probes == [4, 12, 28, 60, 92, 124] and {chosen[i - 1] for i in probes} == {2}
    # Once speculating pays (acceptance rose), probes start over at every 4th plain step.
    policy.acceptance = Acceptance(prior_a=0.9)
    assert policy.choose(5) > 0
    policy.acceptance = Acceptance(prior_a=0.1)
    assert [policy.choose(5) for _ in range(8)] == [0, 0, 0, 2, 0, 0, 0, 0]
    # Drafts dearer than what even perfect acceptance saves: no probing at all.
    policy = CostK(CostModel(draft_s=1.0, verify_s=[0.1] * 6), k_max=5, probe_every=4, probe_k=2)
    assert [policy.choose(5) for _ in range(8)] == [0] * 8
    # Perfect acceptance would win only 2% (under the 5% a choice needs): a probe could never lead
    # to speculating, so none runs. 3 tokens / (2 * 0.097 + 0.1) = 10.2 tokens/s vs 10.
    policy = CostK(CostModel(draft_s=0.097, verify_s=[0.1] * 6), k_max=5, acceptance=Acceptance(prior_a=0.1),
                   probe_every=4, probe_k=2)
    assert policy.costs.speed(1.0, 2) > policy.costs.speed(1.0, 0)
    assert [policy.choose(5) for _ in range(8)] == [0] * 8


def test_acceptance_estimate_is_unbiased_for_prefix_acceptance():
    # Greedy verification judges draft tokens until the first rejection: with a = 0.9 and k = 5
    # accepted / drafted reads about 0.74; the estimate must recover a itself.
    rng = random.Random(0)
    est = Acceptance(prior_a=0.5, decay=1.0)
    drafted = accepted = 0
    for _ in range(4000):
        n = 0
        while n < 5 and rng.random() < 0.9:
            n += 1
        est.update(5, n)
        drafted, accepted = drafted + 5, accepted + n
    assert accepted / drafted < 0.78
    assert est.rate == pytest.approx(0.9, abs=0.01)
    est.update(0, 0)  # a step that drafted nothing teaches nothing
    assert est.rate == pytest.approx(0.9, abs=0.01)


def test_cost_policy_skips_a_draft_prefill_it_cannot_win_back():
    costs = CostModel(draft_s=0.01, verify_s=[0.1] * 6, catch_up_per_token_s=0.002)
    policy = CostK(costs, k_max=5, acceptance=Acceptance(prior_a=0.8))
    # 2000 prompt tokens to read (4 s) against 16 tokens left: stay plain.
    assert policy.choose(5, remaining=16, catch_up=2000) == 0
    # The same prompt with 1000 tokens to go pays back; a drafter already caught up always may draft.
    assert policy.choose(5, remaining=1000, catch_up=2000) > 0
    assert policy.choose(5, remaining=16, catch_up=0) > 0


def test_cost_policy_does_not_probe_into_a_draft_prefill_it_cannot_win_back():
    costs = CostModel(draft_s=0.01, verify_s=[0.1] * 6, catch_up_per_token_s=0.002)
    policy = CostK(costs, k_max=5, acceptance=Acceptance(prior_a=0.8), probe_every=2)
    assert [policy.choose(5, remaining=16, catch_up=2000) for _ in range(6)] == [0] * 6


def test_cost_policy_probe_that_cannot_pay_stays_due_until_it_can():
    # A probe falling due while the prompt read cannot pay back waits for a step where it can (a
    # longer expected answer), instead of starting the whole wait over.
    costs = CostModel(draft_s=0.01, verify_s=[0.1] * 6, catch_up_per_token_s=0.002)
    policy = CostK(costs, k_max=5, acceptance=Acceptance(prior_a=0.1), probe_every=2)
    assert [policy.choose(5, remaining=16, catch_up=2000) for _ in range(6)] == [0] * 6
    assert policy.choose(5, remaining=10_000, catch_up=2000) == policy.probe_k


def test_a_draft_prefill_does_not_count_as_draft_cost():
    costs = CostModel(draft_s=0.01, verify_s=[0.1] * 6, catch_up_per_token_s=0.001)
    policy = CostK(costs, k_max=5, acceptance=Acceptance(prior_a=0.9))
    policy.choose(5, remaining=1000, catch_up=500)  # a probe that first reads 500 tokens of context
    policy.update(2, 2, 2, propose_s=0.52, score_s=0.1)
    assert costs.draft_s == pytest.approx(0.01)
    policy.choose(5, remaining=1000, catch_up=1)  # an ordinary step: its timing counts
    policy.update(2, 2, 2, propose_s=0.04, score_s=0.1)
    assert costs.draft_s == pytest.approx(0.011)


def test_answer_lengths_estimate_the_tokens_still_to_come():
    lengths = AnswerLengths(window=4)
    assert lengths.expected_remaining(0, 64) == 64  # no history: the limit
    for n in (20, 30):
        lengths.add(n, cut=False)
    assert lengths.expected_remaining(0, 64) == 25
    assert lengths.expected_remaining(25, 39) == 5  # only answers longer than 25 tokens say how long it goes on
    assert lengths.expected_remaining(40, 24) == 24  # longer than every answer seen: the limit again
    lengths.add(64, cut=True)  # cut by its limit: it would have run at least that long
    assert lengths.expected_remaining(0, 200) == round((20 + 30 + 200) / 3)
    for n in (5, 5, 5):
        lengths.add(n, cut=False)
    assert list(lengths.recent) == [(64, True), (5, False), (5, False), (5, False)]  # a window of the latest


def test_the_engine_gives_the_cost_policy_the_expected_answer_length(qwen2_tiny, qwen2_draft_tiny, monkeypatch):
    # With a history of short answers the horizon a draft prefill must pay back over is what
    # answers usually take, not max_tokens.
    import verispec.engine.engine as engine_module
    from verispec import Engine, SamplingParams, SpecConfig

    seen: list[int | None] = []
    contexts: list[int] = []

    class Spy(CostK):
        def choose(self, k_cap: int, remaining: int | None = None, catch_up: int = 0, context: int = 0) -> int:
            seen.append(remaining)
            contexts.append(context)
            return 0

    monkeypatch.setattr(engine_module, "make_policy", lambda spec, costs, prior: Spy(costs, k_max=spec.k))
    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    progress=False)
    spec, params = SpecConfig("draft", k=4, k_policy="cost"), SamplingParams(max_tokens=40, ignore_eos=True)
    engine.generate([3, 4, 5, 6], params, spec)
    assert seen[0] == 40 and seen[-1] == 1  # no history yet: the limit, counting down
    assert contexts == list(range(4, 44))  # the tokens the sequence holds: what a step attends to
    for _ in range(3):
        engine.answer_lengths.add(6, cut=False)
    seen.clear()
    engine.generate([3, 4, 5, 6], params, spec)
    assert seen[0] == round((40 + 3 * 6) / 4)  # the first answer ran to its limit, three stopped at 6


def test_advise_on_tiny_models(qwen2_tiny, qwen2_draft_tiny, tmp_path):
    from verispec import Engine

    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    progress=False)
    prompts = [[3, 5, 7, 9, 11, 3, 5, 7], [2, 4, 6, 8, 2, 4, 6, 8]]
    result = advise(engine, prompts, k_max=4, tokens=12, chat=False, out=str(tmp_path), measure_ks=(1, 2))
    assert result["read_bandwidth_GBps"] > 0 and result["plain_tokens_per_s"] > 0
    assert set(result["verify_cost_curve"]) == {1, 2, 3, 4, 5} and result["verify_cost_curve"][1] == 1.0
    assert {m["method"] for m in result["methods"]} == {"draft", "ngram"}
    for m in result["methods"]:
        assert 0.0 <= m["acceptance"] <= 1.0 and 0.0 <= m["hit"] <= 1.0
        assert m["predicted"][0] == pytest.approx(1.0)
        assert all(math.isfinite(v) and v > 0 for v in m["predicted"].values())
    rec = result["recommended"]
    assert rec["method"] in ("draft", "ngram") and 0 <= rec["k"] <= 4
    assert result["verdict"].startswith("speculation")
    assert (tmp_path / "advise.png").stat().st_size > 0 and (tmp_path / "advise.json").is_file()
    assert "recommended:" in format_advice(result)


def test_acceptance_spread_is_the_prior_until_enough_requests_drafted():
    spread = AcceptanceSpread(prior_sd=0.25, min_requests=4)
    spread.add(Acceptance(accepted=1, rejected=0))  # one judged token shows no rate: ignored
    for accepted, rejected in ((9, 1), (1, 1), (9, 1)):
        spread.add(Acceptance(accepted=accepted, rejected=rejected))
    assert list(spread.rates) == [0.9, 0.5, 0.9] and spread.sd == 0.25  # three requests: still the prior
    spread.add(Acceptance(accepted=1, rejected=1))
    assert spread.sd == pytest.approx(statistics.stdev([0.9, 0.5, 0.9, 0.5]))
