"""Predicted outputs: the prediction drafter's alignment, and exact output whatever the prediction says."""

from __future__ import annotations

import pytest
import torch
from drafters_common import (
    GREEDY,
    build_tiny,
    chi_square_p,
    exact_first_two,
    make_engine,
)

from verispec import SamplingParams, SpecConfig, VerispecError
from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.prediction import PredictionDrafter

REF = list(range(10, 40))  # a prediction of 30 distinct tokens
PROMPT = [3, 4, 5]


def offer(d: PredictionDrafter, out: list[int], k: int = 8) -> list[int]:
    """What the drafter offers after ``out`` (the prompt is PROMPT) and then proposes."""
    seq = PROMPT + out
    n = d.free_tokens(seq, k, GREEDY, None)
    tokens = d.propose(seq, k, GREEDY, None).tokens
    assert len(tokens) == n
    return tokens


def started(ref: list[int] = REF, inner: Drafter | None = None) -> PredictionDrafter:
    d = PredictionDrafter(ref, inner, inner_k=4)
    d.begin(PROMPT)
    return d


def test_a_new_answer_is_offered_the_prediction_from_its_start():
    assert offer(started(), []) == REF[:8]


def test_under_a_grammar_the_prediction_offers_what_it_accepts():
    d = started()
    assert d.free_tokens(PROMPT, 8, GREEDY, None, lambda tokens: 3) == 3
    assert d.propose(PROMPT, 8, GREEDY, None).tokens == REF[:3]
    inner = started()  # a prediction refused at once leaves the step to its inner drafter
    d = PredictionDrafter(REF, inner, inner_k=4)
    d.begin(PROMPT)
    assert d.free_tokens(PROMPT, 8, GREEDY, None, lambda tokens: 0) == 0 and not d.offering


def test_the_cursor_follows_an_output_that_repeats_the_prediction():
    d = started()
    assert offer(d, []) == REF[:8]
    d.commit(len(PROMPT) + 8)  # all accepted, then the target's own token, the prediction's next
    assert offer(d, REF[:9], k=5) == REF[9:14]
    assert (d.accepted, d.rejected) == (8, 0)


def test_after_a_deleted_passage_it_skips_ahead():
    out = REF[:5] + REF[12:16]  # the answer left out REF[5:12]
    assert offer(started(), out) == REF[16:24]


def test_after_an_inserted_passage_it_waits_then_realigns():
    d = started()
    assert offer(d, REF[:5] + [90, 91]) == []  # nothing in the prediction matches the inserted text
    assert offer(d, REF[:5] + [90, 91] + REF[5:8]) == REF[8:16]


def test_a_repeated_passage_realigns_to_the_nearest_occurrence_ahead():
    ref = [50, 51, 52, 60, 61, 50, 51, 52, 70, 71, 72, 73]
    d = started(ref)
    assert offer(d, [50, 51, 52, 60, 61, 50, 51, 52]) == [70, 71, 72, 73]  # followed: the cursor says where
    d = started(ref)
    assert offer(d, [99, 50, 51, 52]) == [60, 61, 50, 51, 52, 70, 71, 72]  # realigned: the first ahead


def test_short_matches_are_not_trusted():
    d = started()
    assert offer(d, [99, 98, 10, 11]) == []  # two tokens: below min_match
    assert offer(d, [99, 98, 10, 11, 12]) == REF[3:11]


def test_an_unrelated_prediction_stops_after_its_first_probe():
    d = started([70, 71, 72, 73, 74, 75])
    assert offer(d, []) == [70, 71, 72, 73, 74, 75]
    d.commit(len(PROMPT))  # rejected at its first token
    assert (d.accepted, d.rejected) == (0, 6)
    out: list[int] = []
    for t in [20, 21, 22, 23, 24, 25, 70, 26]:
        out.append(t)
        assert offer(d, out) == []


def test_counts_what_verification_kept():
    d = started()
    offer(d, [])
    d.commit(len(PROMPT) + 3)
    assert (d.accepted, d.rejected) == (3, 5)


class Fixed(Drafter):
    name = "fixed"

    def __init__(self) -> None:
        self.began: list[int] | None = None
        self.commits: list[int] = []

    def begin(self, prompt):
        self.began = list(prompt)

    def propose(self, seq, k, params, generator):
        return Proposal([7] * k)

    def commit(self, n_valid):
        self.commits.append(n_valid)


def test_where_the_prediction_has_nothing_the_inner_drafter_drafts():
    inner = Fixed()
    d = started(inner=inner)
    assert inner.began == PROMPT
    assert d.free_tokens(PROMPT + [90, 91, 92], 8, GREEDY, None) == 0 and not d.offering
    assert d.propose(PROMPT + [90, 91, 92], 3, GREEDY, None).tokens == [7, 7, 7]
    d.commit(7)
    assert inner.commits == [7] and (d.accepted, d.rejected) == (0, 0)
    assert offer(d, []) == REF[:8] and d.offering


def test_bad_arguments():
    with pytest.raises(ValueError):
        PredictionDrafter([])
    with pytest.raises(ValueError):
        PredictionDrafter([1, 2], min_match=0)


# -- the engine: output exact whatever the prediction ----------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pred")
    target = build_tiny(root / "t", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=0, scale=3.0)
    draft = build_tiny(root / "d", vocab=96, layers=1, dim=32, heads=2, kv_heads=1, seed=1, scale=3.0)
    return target, draft


@pytest.fixture(scope="module")
def engine(models):
    return make_engine(*models)


PROMPTS = [[3, 5, 7, 9, 3, 5, 7], [10, 20, 30, 40, 50, 60, 10, 20, 30], [2]]
SPECS = [None, SpecConfig(method="ngram", k=4), SpecConfig(method="draft", k=3),
         SpecConfig(method="hybrid", k=5, k_policy="cost"), SpecConfig(method="suffix", k=8, k_policy="fixed")]


def predictions(plain: list[int]) -> dict[str, list[int]]:
    """A correct, a partly correct (a changed token, a deleted and an inserted passage) and an unrelated one."""
    partly = plain[:6] + [(plain[6] + 1) % 96] + plain[7:14] + plain[18:24] + [5, 6, 7] + plain[24:]
    return {"correct": plain, "partly": partly, "unrelated": [(t * 7 + 3) % 96 for t in range(40)]}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "plain" if s is None else s.method)
def test_greedy_output_is_plain_decoding_whatever_the_prediction(engine, spec):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(PROMPTS, params)]
    for name in ("correct", "partly", "unrelated"):
        preds = [predictions(p)[name] for p in plain]
        results = engine.generate(PROMPTS, params, spec, prediction=preds)
        assert [r.token_ids for r in results] == plain, name
        m = results[0].metrics
        if name == "correct":  # the answer was drafted from the prediction, in long runs
            assert m.accepted_prediction_tokens >= 30 and m.steps <= 12
        if name == "unrelated":
            assert m.accepted_prediction_tokens <= 2


def test_batched_predictions_match_each_alone(engine):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(PROMPTS, params)]
    preds = [predictions(p)["partly"] for p in plain]
    spec = SpecConfig(method="hybrid", k=4, k_policy="fixed")  # the cost policy's k depends on the batch
    together = engine.generate(PROMPTS, params, spec, prediction=preds)
    alone = [engine.generate(p, params, spec, prediction=pr)[0] for p, pr in zip(PROMPTS, preds, strict=True)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone] == plain
    assert [r.metrics.accepted_prediction_tokens for r in together] == \
        [r.metrics.accepted_prediction_tokens for r in alone]


@pytest.mark.parametrize("spec", [None, SpecConfig(method="draft", k=2, k_policy="fixed")], ids=["plain", "draft"])
def test_sampled_output_is_distributed_as_the_target(models, spec):
    target, draft = models
    engine = make_engine(target, draft)
    prompt = [3, 5, 7]
    params = SamplingParams(temperature=1.0)
    exact = exact_first_two(target, prompt, params)
    likely = int(exact.argmax())  # the most likely pair: a prediction that is often, not always, right
    prediction = [likely // 96, likely % 96, 11, 12]
    vocab = target.args.vocab_size
    counts = torch.zeros(vocab * vocab, dtype=torch.float64).numpy()
    accepted = 0
    for seed in range(1500):
        r = engine.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True),
                            spec, prediction=prediction)[0]
        counts[r.token_ids[0] * vocab + r.token_ids[1]] += 1
        accepted += r.metrics.accepted_prediction_tokens
    assert accepted > 0  # the prediction was drafted and sometimes accepted
    assert chi_square_p(counts, exact) > 1e-3


def test_bad_predictions_are_refused_before_any_work(engine):
    with pytest.raises(VerispecError, match="prediction"):
        engine.submit([3, 4], GREEDY, prediction=[1] * (engine.max_len + 1))
    with pytest.raises(VerispecError, match="prediction"):
        engine.submit([3, 4], GREEDY, prediction=[1, 200])
    with pytest.raises(VerispecError, match="prediction"):
        engine.submit([3, 4], GREEDY, prediction={"type": "content"})  # type: ignore[arg-type]
    with pytest.raises(VerispecError, match="tokenizer"):
        engine.submit([3, 4], GREEDY, prediction="some text")
    assert not engine.has_work
