"""`verispec advise`, and what the engine gives the cost k policy: profiled costs, acceptance, answer lengths."""

from __future__ import annotations

import math
import random

import pytest

from verispec.advise import advise, format_advice
from verispec.engine.costs import ContextCost, per_position_s
from verispec.engine.policy import Acceptance, AnswerLengths, CostPolicy, expected_tokens


def test_expected_tokens_matches_the_geometric_sum():
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in range(6):
            assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5.0


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
    costs = engine.profile(k_max=3, context=16)
    assert costs.per_position.context == 16 and set(costs.target.curves[1].points) == {1, 2, 3, 4}
    assert costs.per_position.target_s >= 0 and costs.per_position.draft_s >= 0
    assert costs.draft_s(1) > 0 and all(t > 0 for t in costs.target.curves[1].points.values())
    # No room for a longer context: no per-position term (and no error).
    assert engine.with_config(max_len=20).profile(k_max=3, context=16).per_position.target_s == 0.0
    # The profile leaves the engine ready: a request afterwards decodes as before.
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert engine.generate([3, 4, 5], params, spec)[0].token_ids == engine.generate([3, 4, 5], params)[0].token_ids


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
    # With a history of short answers the horizon a draft catch-up must pay back over is what
    # answers usually take, not max_tokens.
    from verispec import Engine, SamplingParams, SpecConfig

    seen: list[int | None] = []
    contexts: list[int] = []

    def spy(self, plans, span=None):
        (plan,) = plans
        seen.append(plan.horizon)
        contexts.append(plan.context)
        return [0]

    monkeypatch.setattr(CostPolicy, "choose", spy)
    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    progress=False)
    spec, params = SpecConfig("draft", k=4, k_policy="cost"), SamplingParams(max_tokens=40, ignore_eos=True)
    engine.generate([3, 4, 5, 6], params, spec)
    # No history yet: the limit, counting down. The policy is asked while the row can still draft,
    # so not for the last token (a step that can only add one token has nothing to decide).
    assert seen[0] == 40 and seen[-1] == 2
    assert contexts == list(range(4, 43))  # the tokens the sequence holds: what a step attends to
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


