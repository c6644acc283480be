"""Suffix decoding: the request and output indexes, the drafter's choices, lossless output, its options."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
from drafters_common import (
    GREEDY,
    PROMPTS,
    chi_square_p,
    exact_first_two,
    make_engine,
    plain_outputs,
    sampled_first_two,
)

import verispec.engine.step
from verispec import SamplingParams, SpecConfig, VerispecError
from verispec.bench.methods import parse_method
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.suffix import MAX_DRAFT, MAX_MATCH, OutputIndex, RequestIndex, SuffixDrafter
from verispec.engine.costs import CostCurve, CostModel
from verispec.sampling import sample

SUFFIX = SpecConfig(method="suffix", k=8, k_policy="fixed")


def brute_force(seq: list[int], k: int, min_prob: float, factor: float) -> tuple[list[int], int]:
    """What the drafter should propose, from the definition: the longest earlier match of the suffix, then
    token by token the most frequent next token (ties: the smallest id) while the path's share holds."""
    n = len(seq)
    for length in range(min(MAX_MATCH, n - 1), 0, -1):
        ends = [e for e in range(length, n) if seq[e - length:e] == seq[-length:]]
        if ends:
            break
    else:
        return [], 0
    path, prob = [], 1.0
    for j in range(min(k, MAX_DRAFT, math.ceil(factor * length))):
        nexts = [seq[e + j] for e in ends if e + j < n]
        if not nexts:
            break
        counts = Counter(nexts)
        tok = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[tok] / len(nexts)
        if prob < min_prob:
            break
        path.append(tok)
        ends = [e for e in ends if e + j < n and seq[e + j] == tok]
    return path, length


# -- the request's own index ------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_lookup_is_the_most_frequent_continuation_of_the_longest_match(seed):
    rng = random.Random(seed)
    d = SuffixDrafter(None, min_prob=0.0, factor=64.0)
    for _ in range(40):
        # Short sequences over few ids: many repeats, but fewer occurrences than the drafter reads per step.
        seq = [rng.randrange(3 + seed % 3) for _ in range(rng.randrange(1, 60))]
        d.begin(seq)
        assert d.lookup(seq, 40) == brute_force(seq, 40, 0.0, 64.0)
        assert d.last_match == brute_force(seq, 40, 0.0, 64.0)[1]
    thresholded = SuffixDrafter(None, min_prob=0.3, factor=1.5)
    for _ in range(40):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        thresholded.begin(seq)
        assert thresholded.lookup(seq, 6) == brute_force(seq, 6, 0.3, 1.5)


def test_frequencies_pick_the_majority_and_the_threshold_ends_the_draft():
    # After [1, 2]: 5 twice, 6 once; after [1, 2, 5]: 7 once, 8 once.
    seq = [1, 2, 5, 7, 1, 2, 6, 9, 1, 2, 5, 8, 1, 2]
    assert SuffixDrafter(None, min_prob=0.0).lookup(seq, 8) == ([5, 7], 2)  # tie on the second: smallest id
    assert SuffixDrafter(None, min_prob=0.5).lookup(seq, 8) == ([5], 2)  # 2/3, then 2/3 * 1/2 < 0.5
    assert SuffixDrafter(None, min_prob=0.7).lookup(seq, 8) == ([], 2)
    assert SuffixDrafter(None, min_prob=0.0, factor=0.5).lookup(seq, 8) == ([5], 2)  # one token per two matched


def test_draft_length_never_exceeds_k_nor_32():
    seq = list(range(40)) * 3
    d = SuffixDrafter(None, factor=64.0)
    assert d.lookup(seq, 64)[0] == list(range(MAX_DRAFT))
    assert d.lookup(seq, 3)[0] == [0, 1, 2] and d.lookup(seq, 0) == ([], 0)
    assert d.last_match == 0
    assert d.lookup(seq, 64)[1] == MAX_MATCH  # the longest match looked for


def test_free_tokens_offers_the_proposal_it_then_makes():
    seq = [4, 5, 6, 7, 8, 4, 5, 6]
    d = SuffixDrafter(None)
    d.begin(seq)
    assert d.free_tokens(seq, 8, GREEDY, None) == 3
    assert d.propose(seq, 8, GREEDY, None).tokens == [7, 8, 4]
    assert d.propose(seq, 8, GREEDY, None).probs is None  # deterministic
    assert d.free_tokens(seq, 8, GREEDY, None) == 3 and d.propose(seq, 2, GREEDY, None).tokens == [7, 8]
    assert SuffixDrafter(None).free_tokens([1, 2, 3], 8, GREEDY, None) == 0  # nothing occurred before
    # Under a grammar the offer holds only what it accepts (here: the first token).
    assert d.free_tokens(seq, 8, GREEDY, None, lambda tokens: 1) == 1 and d.propose(seq, 8, GREEDY, None).tokens == [7]


def fresh(tokens: list[int]) -> RequestIndex:
    index = RequestIndex()
    index.extend(tokens)
    return index


def test_commit_rolls_the_index_back():
    rng = random.Random(0)
    base = [rng.randrange(5) for _ in range(30)]
    d = SuffixDrafter(None)
    d.begin(base[:10])
    d.lookup(base[:10], 4)
    for n_valid in (25, 12, 30, 3, 30):  # extend past, roll back, and again
        d.lookup(base + [9, 9, 9], 4)  # a longer sequence than will be kept
        d.commit(n_valid)
        assert d.index.tokens == fresh(base[:n_valid]).tokens and d.index.grams == fresh(base[:n_valid]).grams
        seq = base[:n_valid]
        assert d.lookup(seq, 6) == SuffixDrafter(None).lookup(seq, 6)
    d.commit(40)  # past what it holds: nothing to undo
    assert len(d.index) == 30


# -- the output index shared across requests ------------------------------------------------------------

def postings(index: OutputIndex) -> set:
    """Every (n-gram key, document tokens, position) the index holds, whatever the documents' ids."""
    return {(key, tuple(index.docs[code >> 32]), code & 0xFFFFFFFF)
            for key, codes in index.grams.items() for code in codes}


def rebuilt(index: OutputIndex) -> OutputIndex:
    again = OutputIndex(index.budget)
    for tokens in index.docs.values():
        again.add(tokens)
    return again


def test_output_index_evicts_the_least_recently_used_within_its_budget():
    index = OutputIndex(budget=20)
    index.add([1, 2, 3, 4, 5, 6])  # doc 0
    index.add([7, 8, 9, 10, 11, 12])  # doc 1
    index.add([13, 14, 15, 16, 17, 18])  # doc 2
    assert index.n_tokens == 18 and list(index.docs) == [0, 1, 2]
    assert index.occurrences((8, 9, 10, 11), 10) == [(1, 5)]
    index.touch([0])  # doc 0 was used: doc 1 is now the oldest
    index.add([19, 20, 21, 22, 23])  # 23 tokens: one must go
    assert list(index.docs) == [2, 0, 3] and index.n_tokens == 17 <= index.budget
    assert index.occurrences((8, 9, 10, 11), 10) == []  # nothing of doc 1 is left
    assert postings(index) == postings(rebuilt(index)) and len(postings(index)) == 2 + 2 + 1
    index.add(list(range(100, 130)))  # longer than the whole budget: its last 20 tokens, alone
    assert [list(d) for d in index.docs.values()] == [list(range(110, 130))] and index.n_tokens == 20
    assert postings(index) == postings(rebuilt(index))
    index.add([5, 6, 7, 8])  # no 4-gram is followed by anything: not kept
    assert index.n_tokens == 20
    for bad in (0, 2**32):
        with pytest.raises(ValueError):
            OutputIndex(bad)


def test_output_index_matches_four_tokens_or_more_newest_first():
    index = OutputIndex(100)
    index.add([1, 2, 3, 4, 9, 1, 2, 3, 4, 8])
    index.add([1, 2, 3, 4, 7])
    assert index.occurrences((1, 2, 3, 4), 10) == [(1, 4), (0, 9), (0, 4)]
    assert index.occurrences((1, 2, 3, 4), 2) == [(1, 4), (0, 9)]
    assert index.occurrences((2, 3, 4), 10) == []  # shorter matches are the request's own


def test_drafts_count_the_request_and_earlier_outputs_together():
    outputs = OutputIndex(1000)
    first = SuffixDrafter(outputs)
    prompt = [40, 41, 42, 43]
    first.begin(prompt)
    first.end(prompt + [1, 2, 3, 4, 50, 51])
    # The prompt's last tokens come along as the context of the output's first ones.
    assert [list(d) for d in outputs.docs.values()] == [prompt + [1, 2, 3, 4, 50, 51]]
    seq = [9, 9, 1, 2, 3, 4, 60, 61, 7, 1, 2, 3, 4]  # its own context continues [1, 2, 3, 4] with 60, 61, 7, 1
    assert SuffixDrafter(None, min_prob=0.5).lookup(seq, 8) == ([60, 61, 7, 1], 4)
    second = SuffixDrafter(outputs, min_prob=0.5)
    second.begin(seq[:2])
    assert second.lookup(seq, 8) == ([50, 51], 4)  # one occurrence each: the tie goes to the smaller id
    outputs.add([0, 1, 2, 3, 4, 60, 61, 62])
    assert second.lookup(seq, 8) == ([60, 61], 4)  # 2/3, 2/3, then 1/3 for 7 (or 62): below 0.5
    # A match in a prompt's tail, longer than the request's own ([42, 43], followed by 9), wins.
    third = SuffixDrafter(outputs, factor=2.0)
    assert third.lookup([42, 43, 9, 40, 41, 42, 43], 8) == ([1, 2, 3, 4, 50, 51], 4)
    assert SuffixDrafter(None).lookup([42, 43, 9, 40, 41, 42, 43], 8) == ([9, 40], 2)


def test_with_the_global_index_off_nothing_is_shared(qwen2_tiny):
    engine = make_engine(qwen2_tiny.model)
    off = replace(SUFFIX, suffix_global=0)
    drafter = engine.drafter(off)
    assert isinstance(drafter, SuffixDrafter) and drafter.outputs is None
    engine.generate(PROMPTS, GREEDY, off)
    assert engine._drafters.ctx.shared == {}
    on = engine.drafter(SUFFIX)
    assert on.outputs is engine.drafter(SUFFIX).outputs  # one index per engine and budget
    assert on.outputs is not engine.drafter(replace(SUFFIX, suffix_global=100)).outputs
    assert on.outputs is not make_engine(qwen2_tiny.model).drafter(SUFFIX).outputs  # another engine: its own


# -- through the engine: lossless --------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(qwen2_tiny):
    return make_engine(qwen2_tiny.model)


@pytest.fixture(scope="module")
def plain(engine):
    return plain_outputs(engine, PROMPTS)


@pytest.mark.parametrize("k", [1, 3, 8, 32])
def test_greedy_matches_plain(engine, plain, k):
    before = engine.stats.requests.accepted
    results = engine.generate(PROMPTS, GREEDY, replace(SUFFIX, k=k))
    assert [r.token_ids for r in results] == plain
    assert all(r.metrics.drafted <= k * r.metrics.steps for r in results)
    assert engine.stats.requests.accepted > before  # drafts were made and accepted


def test_greedy_matches_plain_batched_under_the_cost_policy(engine, plain):
    # Measured-looking costs, so the policy (which decides the steps without a draft) needs no profile.
    batched = engine.with_config(max_batch=3, costs=CostModel(CostCurve({1: 0.01, 1024: 0.02})))
    spec = SpecConfig(method="suffix", k=16)
    assert [r.token_ids for r in batched.generate(PROMPTS, GREEDY, spec)] == plain
    assert [r.token_ids for r in batched.generate(PROMPTS, GREEDY, replace(spec, suffix_global=0))] == plain


def test_finished_requests_feed_the_engines_index(qwen2_tiny):
    engine = make_engine(qwen2_tiny.model)
    prompt = [11, 12, 13, 14, 15]
    out = engine.generate(prompt, GREEDY, SUFFIX)[0].token_ids
    outputs = engine.drafter(SUFFIX).outputs
    assert [list(d) for d in outputs.docs.values()] == [prompt + out]
    # The same prompt again: its first draft is the earlier answer's start.
    drafter = engine.drafter(SUFFIX)
    drafter.begin(prompt)
    n = drafter.free_tokens(prompt, 8, GREEDY, None)
    assert n == len(prompt) and drafter.propose(prompt, 8, GREEDY, None).tokens == out[:n]  # factor 1


class BrokenEnd(SuffixDrafter):
    """Drafts as the suffix drafter does, then fails when its request ends."""

    def end(self, seq):
        raise RuntimeError("injected end fault")


def test_a_failing_end_hook_leaves_the_answer_and_the_engine_intact(engine, plain):
    result = engine.generate(PROMPTS[0], GREEDY, SUFFIX, drafter=BrokenEnd(None))[0]
    assert result.token_ids == plain[0] and result.metrics.accepted > 0
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY, SUFFIX)] == plain


@pytest.mark.parametrize("k", [3, 6])
def test_hybrid_with_the_suffix_lookup_matches_plain(noisy_pair_engine, qwen2_tiny, plain, k):
    spec = SpecConfig(method="hybrid", lookup="suffix", k=k, k_policy="fixed")
    for eng in (noisy_pair_engine, make_engine(qwen2_tiny.model)):  # with a draft model, and lookup only
        drafter = eng.drafter(spec)
        assert isinstance(drafter, HybridDrafter) and isinstance(drafter.lookup, SuffixDrafter)
        assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY, spec)] == plain
        counts = sum((d.counts for d in eng._drafters.free[spec.drafter_key]), Counter())
        assert counts["suffix"] > 0 and "ngram" not in counts
        assert eng.drafter(spec).lookup.outputs.docs  # hybrid's suffix lookup feeds the engine's index too


# -- sampled output keeps the target's distribution ----------------------------------------------

SAMPLED_PROMPT = [3, 4, 5, 3, 4]  # the request's own repeat drafts from the first step on


def always_accept(draft, draft_probs, target_probs, generator):
    """A wrong verifier: keeps every draft token whatever p and q say."""
    return len(draft), sample(target_probs[len(draft)], generator)


@pytest.fixture
def sampling_engine(small_vocab_target):
    return make_engine(small_vocab_target.model)


def test_sampling_is_exact(sampling_engine, small_vocab_target):
    """Drafts from the request and from earlier samples (so they vary) keep samples distributed as the target's."""
    params = SamplingParams(temperature=1.0)
    spec = SpecConfig(method="suffix", k=2, k_policy="fixed", suffix_min_prob=0.0, suffix_factor=2.0)
    counts = sampled_first_two(sampling_engine, SAMPLED_PROMPT, params, spec, 1200)
    m = sampling_engine.stats.requests
    assert 0 < m.accepted < m.drafted  # both branches of the rejection rule ran
    assert len(sampling_engine.drafter(spec).outputs.docs) > 1
    assert chi_square_p(counts, exact_first_two(small_vocab_target.model, SAMPLED_PROMPT, params)) > 1e-3


def test_negative_control_a_wrong_verifier_is_caught(sampling_engine, small_vocab_target, monkeypatch):
    monkeypatch.setattr(verispec.engine.step, "verify_sampling", always_accept)
    params = SamplingParams(temperature=1.0)
    spec = SpecConfig(method="suffix", k=2, k_policy="fixed", suffix_min_prob=0.0, suffix_factor=2.0)
    counts = sampled_first_two(sampling_engine, SAMPLED_PROMPT, params, spec, 1200)
    m = sampling_engine.stats.requests
    assert m.accepted == m.drafted > 0  # the patch is in effect
    assert chi_square_p(counts, exact_first_two(small_vocab_target.model, SAMPLED_PROMPT, params)) < 1e-3


# -- options --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "message"), [
    ({"suffix_global": -1}, "suffix_global"),
    ({"suffix_global": 1.5}, "suffix_global"),
    ({"suffix_global": True}, "suffix_global"),
    ({"suffix_min_prob": 1.5}, "suffix_min_prob"),
    ({"suffix_min_prob": float("nan")}, "suffix_min_prob"),
    ({"suffix_factor": 0}, "suffix_factor"),
    ({"suffix_factor": "2"}, "suffix_factor"),
    ({"lookup": "trie"}, "unknown hybrid lookup 'trie'"),
])
def test_bad_options_are_clear_errors(fields, message):
    with pytest.raises(VerispecError, match=message):
        SpecConfig(method="suffix", **fields)


def test_method_strings_and_cli_flags(qwen2_tiny):
    spec = parse_method("suffix:global=0,min_prob=0.25,factor=2").spec
    assert (spec.method, spec.suffix_global, spec.suffix_min_prob, spec.suffix_factor) == ("suffix", 0, 0.25, 2.0)
    assert parse_method("hybrid:lookup=suffix").spec.lookup == "suffix"
    with pytest.raises(VerispecError, match="suffix_min_prob"):
        parse_method("suffix:min_prob=2")
    from verispec.cli import _spec_from, build_parser

    base = ["generate", "--model", qwen2_tiny.path, "--prompt", "x"]
    spec = _spec_from(build_parser().parse_args([*base, "--method", "suffix", "--suffix-global", "0",
                                                 "--suffix-min-prob", "0.25", "--suffix-factor", "2"]))
    assert (spec.method, spec.suffix_global, spec.suffix_min_prob, spec.suffix_factor) == ("suffix", 0, 0.25, 2.0)
    spec = _spec_from(build_parser().parse_args([*base, "--method", "hybrid", "--lookup", "suffix"]))
    assert spec.lookup == "suffix" and spec.suffix_global == SpecConfig().suffix_global
    with pytest.raises(VerispecError, match="suffix_factor"):
        _spec_from(build_parser().parse_args([*base, "--method", "suffix", "--suffix-factor", "-1"]))


def test_equal_specs_share_one_index_and_other_specs_their_own(qwen2_tiny):
    engine = make_engine(qwen2_tiny.model)
    first, again = engine.drafter(SUFFIX), engine.drafter(SUFFIX)
    other = engine.drafter(replace(SUFFIX, suffix_min_prob=0.2))
    assert first.outputs is again.outputs
    assert other.outputs is not first.outputs  # a method in a benchmark never drafts from another's answers
    engine.generate(PROMPTS[:1], GREEDY, SUFFIX)
    assert first.outputs.n_tokens > 0 and other.outputs.n_tokens == 0
