"""`verispec advise`, and what the engine gives the cost k policy: profiled costs and acceptance."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from verispec.advise import K_CAL, Calibration, advise, format_advice, predict
from verispec.bench.datasets import BenchPrompt
from verispec.engine import kernel_choice
from verispec.engine.costs import CostCurve, CostModel
from verispec.engine.metrics import Metrics
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


def _plain(tokens: int, step_s: float, prefill_s: float, other_s: float) -> Metrics:
    m = Metrics(generated_tokens=tokens, steps=tokens)
    m.stage_s.update(prefill=prefill_s, score=tokens * step_s)
    m.total_s = prefill_s + tokens * (step_s + other_s)
    return m


def test_prediction_from_acceptance_by_depth():
    flat = CostModel(CostCurve({1: 0.01, 8: 0.01}))  # a forward costs the same for 1 to 8 tokens
    plain = _plain(120, 0.01, prefill_s=0.0, other_s=0.0)
    perfect = Calibration("draft", hit=1.0, reach=[1.0] * K_CAL, propose_step_s=0.0, catch_up_s=0.0,
                          other_step_s=0.0, model=True)
    for k in range(1, K_CAL + 1):  # every draft accepted, drafting free: k + 1 tokens per forward
        assert predict(perfect, plain, flat, k) == pytest.approx(k + 1)
    # A drafter that never proposes costs what plain decoding does, per-step bookkeeping included.
    plain = _plain(100, 0.01, prefill_s=0.3, other_s=0.002)
    idle = replace(perfect, hit=0.0, reach=[0.0] * K_CAL, other_step_s=0.002)
    assert predict(idle, plain, flat, 3) == pytest.approx(1.0)
    # Half the drafts reach depth 1, a quarter depth 2: 1.75 tokens per step at k = 2; a draft model's time
    # grows with k (K_CAL forwards cost propose_step_s), a lookup's does not; its catch-up is paid once.
    half = replace(perfect, reach=[0.5, 0.25, 0.0, 0.0, 0.0], propose_step_s=0.005, catch_up_s=0.1)
    spec_s = 0.3 + 0.1 + 100 / 1.75 * (0.01 + 0.005 * 2 / K_CAL)
    assert predict(half, plain, flat, 2) == pytest.approx(plain.total_s / spec_s)
    lookup_s = 0.3 + 0.1 + 100 / 1.75 * (0.01 + 0.005)
    assert predict(replace(half, model=False), plain, flat, 2) == pytest.approx(plain.total_s / lookup_s)
    # The curve prices the verification forward: a forward of m tokens costing m times one is never worth it.
    linear = CostModel(CostCurve({1: 0.01, 8: 0.08}))
    assert predict(replace(half, propose_step_s=0.0, catch_up_s=0.0), _plain(100, 0.01, 0.0, 0.0), linear, 2) < 1.0


def test_advise_on_tiny_models(qwen2_tiny, qwen2_draft_tiny, tmp_path):
    from verispec import Engine

    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    progress=False)
    prompts = [BenchPrompt(str(i), "t", ids, False) for i, ids in  # type: ignore[arg-type]
               enumerate([[3, 5, 7, 9, 11, 3, 5, 7], [2, 4, 6, 8, 2, 4, 6, 8]])]
    result = advise(engine, prompts, tokens=12, measure=2, out=str(tmp_path))
    # Prefix reuse would let each configuration skip a prompt another already prefilled: the advisor runs on
    # an engine of its own without it, so the one passed in (with reuse, the default) ran nothing.
    assert engine.stats.steps == 0 and engine.stats.prefix_reused_tokens == 0
    assert result["plain_tokens_per_s"] > 0 and result["read_bandwidth_GBps"] > 0
    assert set(result["verify_cost_curve"]) == set(range(1, K_CAL + 2)) and result["verify_cost_curve"][1] == 1.0
    assert set(result["calibration"]) == {"hybrid", "draft", "suffix", "ngram"}
    for cal in result["calibration"].values():
        assert 0.0 <= cal["hit"] <= 1.0 and all(0.0 <= x <= 1.0 for x in cal["reach"])
        assert cal["reach"] == sorted(cal["reach"], reverse=True)  # reaching depth i + 1 needs depth i
    assert cal["model"] is False and result["calibration"]["draft"]["model"] is True
    predicted = {(m, k): v for m, by_k in result["predicted"].items() for k, v in by_k.items()}
    assert len(predicted) == 4 * K_CAL and all(math.isfinite(v) and v > 0 for v in predicted.values())
    labels = [c["label"] for c in result["candidates"]]
    assert labels[:2] == ["plain", "default"] and len(labels) == 4  # two best predicted measured beside them
    best = sorted(predicted, key=lambda mk: -predicted[mk])[:2]
    assert labels[2:] == [f"{m}:policy=fixed,k={k},confidence=0" for m, k in best]
    rec = result["recommended"]
    assert rec["measured"] == max(c["measured"] for c in result["candidates"])
    assert result["verdict"].startswith("speculation")
    assert (tmp_path / "advise.png").stat().st_size > 0 and (tmp_path / "advise.json").is_file()
    assert f"Recommended: `{rec['label']}`" in (tmp_path / "advise.md").read_text()
    assert "recommended:" in format_advice(result)


@pytest.mark.skipif(not kernel_choice.both_paths(), reason="this CPU runs one int4/int8 activation path only")
def test_advise_measures_the_other_activation_path_and_leaves_the_models_as_they_were(qwen2_tiny, qwen2_draft_tiny):
    from verispec import Engine

    engine = Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_draft_tiny.path, dtype="float32", max_len=256,
                                    weights="int4", draft_weights="int4", kernels="q8", progress=False,
                                    prefix_reuse=False)
    layer = kernel_choice.fast_layers(engine.draft)[0]
    layer.q8 = False  # a mixed model: the advisor must restore each layer, not one path for all
    before = [(m, m.q8) for model in (engine.target, engine.draft) for m in kernel_choice.fast_layers(model)]
    result = advise(engine, [BenchPrompt("0", "t", [3, 5, 7, 9, 3, 5, 7], False)],  # type: ignore[arg-type]
                    tokens=8, measure=1)
    other = {c["label"]: c for c in result["candidates"] if c["kernels"] != "auto"}
    assert set(other) == {"plain [bf16]", "default [bf16]"}
    assert all(c["measured"] > 0 for c in other.values())
    assert [(m, m.q8) for m, _ in before] == before
    assert "default [bf16]" in format_advice(result)


def test_advise_refuses_what_it_cannot_run(qwen2_tiny):
    from verispec import Engine
    from verispec.errors import VerispecError

    engine = Engine.from_pretrained(qwen2_tiny.path, dtype="float32", max_len=64, progress=False)
    with pytest.raises(VerispecError, match="at least one prompt"):
        advise(engine, [])
    with pytest.raises(VerispecError, match="--measure -1"):
        advise(engine, [BenchPrompt("0", "t", "x", False)], measure=-1)
