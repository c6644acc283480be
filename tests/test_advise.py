"""`verispec advise`, and what the engine gives the cost k policy: profiled costs and acceptance."""

from __future__ import annotations

import math
import random

import pytest

from verispec.advise import advise, format_advice
from verispec.engine.policy import Acceptance, expected_tokens


def test_expected_tokens_matches_the_geometric_sum():
    for a in (0.0, 0.3, 0.8, 0.99):
        for k in range(6):
            assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5.0


def test_the_engine_profiles_its_cost_curves(qwen2_tiny, qwen2_draft_tiny):
    from verispec import Engine, SamplingParams, SpecConfig
    from verispec.engine.costs import PROFILE_WIDE

    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    progress=False)
    spec = SpecConfig("draft", k=3, k_policy="cost")
    costs = engine.profile(k_max=3, context=16)
    assert set(costs.target.curves[1].points) == {1, 2, 3, 4, *PROFILE_WIDE}
    assert costs.draft_s(1) > 0 and all(t > 0 for t in costs.target.curves[1].points.values())
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


