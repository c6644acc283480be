"""Greedy speculative decoding is lossless: token-identical to plain greedy decoding of the target.

Drafters range from one that always agrees (the target itself) through a noisy copy (mixed
accept/reject) and an unrelated model to one that is always wrong; EOS inside a draft, max_tokens
cutting a step short and a cache that runs out mid-step are covered too.
"""

from __future__ import annotations

import json

import pytest
from drafters_common import greedy_next

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.ngram import NgramDrafter
from verispec.engine.metrics import Metrics

EOS = 1  # make_tiny's eos_token_id
MAX_LEN = 256
PROMPTS = [[3, 5, 7, 9], [10, 20, 30, 40, 50, 60, 10, 20, 30], [2]]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def make_engine(target, draft=None, eos_ids=frozenset({EOS}), max_len=MAX_LEN) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=max_len, progress=False)
    return Engine(cfg, target.model, None, set(eos_ids), draft=None if draft is None else draft.model)


@pytest.fixture(scope="module")
def noisy_engine(qwen2_tiny, qwen2_noisy_draft_tiny) -> Engine:
    return make_engine(qwen2_tiny, qwen2_noisy_draft_tiny)


@pytest.fixture(scope="module")
def unrelated_engine(qwen2_tiny, qwen2_draft_tiny) -> Engine:
    return make_engine(qwen2_tiny, qwen2_draft_tiny)


@pytest.fixture(scope="module")
def same_engine(qwen2_tiny) -> Engine:
    """Draft loaded from the target's own folder: every draft must be accepted."""
    return Engine.from_pretrained(qwen2_tiny.path, draft=qwen2_tiny.path, dtype="float32", max_len=MAX_LEN,
                                  progress=False)


@pytest.fixture(scope="module")
def plain(noisy_engine):
    """Plain greedy outputs of the qwen2 target per prompt (computed once)."""
    results = noisy_engine.generate(PROMPTS, GREEDY)
    for r in results:
        assert r.metrics.drafted == 0 and r.metrics.steps == len(r.token_ids) == GREEDY.max_tokens
    return [r.token_ids for r in results]


def spec_draft(k: int) -> SpecConfig:
    return SpecConfig(k_policy="fixed", method="draft", k=k)


def test_plain_output_is_not_degenerate(plain):
    # A sequence of one repeated token would make "identical" a weak check.
    for ids in plain:
        assert len(set(ids)) >= 5


@pytest.mark.parametrize("k", range(1, 9))
def test_noisy_draft_matches_plain(noisy_engine, plain, k):
    results = noisy_engine.generate(PROMPTS, GREEDY, spec_draft(k))
    assert [r.token_ids for r in results] == plain
    m = results[0].metrics
    assert m.drafted > 0
    # The noisy copy agrees sometimes and disagrees sometimes: both verify branches ran.
    total_acc = sum(r.metrics.accepted for r in results)
    total_drafted = sum(r.metrics.drafted for r in results)
    assert 0 < total_acc < total_drafted


@pytest.mark.parametrize("policy", ["cost", "fixed"])
def test_confidence_stop_matches_plain_and_drafts_less(noisy_engine, plain, policy):
    """A draft stopped where the draft model doubts its token changes how much is drafted, never the output."""
    free = noisy_engine.generate(PROMPTS, GREEDY, SpecConfig(method="draft", k=6, k_policy="fixed"))
    stopped = noisy_engine.generate(PROMPTS, GREEDY, SpecConfig(method="draft", k=6, k_policy=policy, confidence=0.9))
    assert [r.token_ids for r in stopped] == plain
    per_step = [sum(r.metrics.drafted for r in rs) / sum(r.metrics.steps for r in rs) for rs in (free, stopped)]
    assert per_step[1] < per_step[0]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_unrelated_draft_matches_plain(unrelated_engine, plain, k):
    results = unrelated_engine.generate(PROMPTS, GREEDY, spec_draft(k))
    assert [r.token_ids for r in results] == plain


@pytest.mark.parametrize("k", [1, 4, 8])
def test_identical_draft_accepts_everything(same_engine, plain, k):
    results = same_engine.generate(PROMPTS, GREEDY, spec_draft(k))
    assert [r.token_ids for r in results] == plain
    for r in results:
        m = r.metrics
        assert m.drafted > 0
        assert m.acceptance_rate == 1.0
        assert m.mean_accepted_length > 1
        # Every step but possibly the last (clipped by max_tokens) drafts k and yields k + 1 tokens.
        assert m.steps == -(-GREEDY.max_tokens // (k + 1))


class AlwaysWrong(Drafter):
    """Proposes (target argmax + 1) mod V at every position: never accepted."""

    name = "always-wrong"

    def __init__(self, target) -> None:
        self.target = target
        self.calls = 0

    def propose(self, seq, k, params, generator) -> Proposal:
        self.calls += 1
        out: list[int] = []
        for _ in range(k):
            out.append((greedy_next(self.target, seq + out) + 1) % self.target.args.vocab_size)
        return Proposal(out)


@pytest.mark.parametrize("k", [1, 5])
def test_always_wrong_drafter(noisy_engine, qwen2_tiny, plain, k):
    drafter = AlwaysWrong(qwen2_tiny.model)
    results = noisy_engine.generate(PROMPTS, GREEDY, spec_draft(k), drafter=drafter)
    assert [r.token_ids for r in results] == plain
    assert drafter.calls > 0
    for r in results:
        assert r.metrics.drafted > 0
        assert r.metrics.accepted == 0
        assert r.metrics.acceptance_rate == 0.0
        assert r.metrics.mean_accepted_length == 1.0


class OverEager(Drafter):
    """Proposes the target's own greedy continuation, but twice as many tokens as asked."""

    name = "over-eager"

    def __init__(self, target) -> None:
        self.target = target

    def propose(self, seq, k, params, generator) -> Proposal:
        out: list[int] = []
        for _ in range(2 * k):
            out.append(greedy_next(self.target, seq + out))
        return Proposal(out)


@pytest.mark.parametrize("k", [2, 5])
def test_drafter_proposing_more_than_k_is_clipped(noisy_engine, qwen2_tiny, plain, k):
    results = noisy_engine.generate(PROMPTS, GREEDY, spec_draft(k), drafter=OverEager(qwen2_tiny.model))
    assert [r.token_ids for r in results] == plain
    for r in results:
        m = r.metrics
        assert m.acceptance_rate == 1.0
        assert len(m.drafted_by_position) <= k
        assert m.drafted <= k * m.steps


def test_ngram_matches_plain(noisy_engine, plain):
    results = noisy_engine.generate(PROMPTS, GREEDY, SpecConfig(k_policy="fixed", method="ngram", k=4))
    assert [r.token_ids for r in results] == plain
    assert sum(r.metrics.drafted for r in results) > 0


@pytest.mark.parametrize("k", [1, 3])
def test_llama_target_with_qwen2_draft(llama_tiny, qwen2_noisy_draft_tiny, k):
    # Same vocabulary size and no tokenizers: any architecture may draft for any other.
    engine = make_engine(llama_tiny, qwen2_noisy_draft_tiny)
    ref = engine.generate(PROMPTS, GREEDY)
    results = engine.generate(PROMPTS, GREEDY, spec_draft(k))
    assert [r.token_ids for r in results] == [r.token_ids for r in ref]


# -- EOS inside a draft ---------------------------------------------------------------------

def pick_mid_eos(ids: list[int], at: int = 5) -> tuple[int, int]:
    """A token first produced at index >= ``at``; returns (token, index of its first occurrence)."""
    for i in range(at, len(ids)):
        if ids[i] not in ids[:i]:
            return ids[i], i
    raise AssertionError(f"no fresh token after index {at} in {ids}")


@pytest.mark.parametrize("draft", ["same", "noisy", "ngram"])
@pytest.mark.parametrize("k", [3, 6])
def test_eos_inside_draft(qwen2_tiny, qwen2_noisy_draft_tiny, plain, draft, k):
    prompt = PROMPTS[0]
    eos, cut = pick_mid_eos(plain[0])
    drafter_model = {"same": qwen2_tiny, "noisy": qwen2_noisy_draft_tiny, "ngram": None}[draft]
    engine = make_engine(qwen2_tiny, drafter_model, eos_ids={eos})
    params = SamplingParams(max_tokens=32)
    spec = SpecConfig(k_policy="fixed", method="ngram", k=k) if draft == "ngram" else spec_draft(k)
    ref = engine.generate(prompt, params)[0]
    assert ref.finish_reason == "stop"
    assert ref.token_ids == plain[0][:cut]
    got = engine.generate(prompt, params, spec)[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == ref.token_ids
    if draft == "same":
        # EOS was proposed and accepted inside a draft, not produced as the bonus token.
        assert got.metrics.accepted > 0 and got.metrics.steps < cut + 1


def test_eos_is_ignored_when_asked(qwen2_tiny, plain):
    eos, _ = pick_mid_eos(plain[0])
    engine = make_engine(qwen2_tiny, qwen2_tiny, eos_ids={eos})
    got = engine.generate(PROMPTS[0], GREEDY, spec_draft(4))[0]
    assert got.token_ids == plain[0]
    assert got.finish_reason == "length"


# -- max_tokens and the cache bound ---------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
@pytest.mark.parametrize("which", ["same", "noisy"])
def test_max_tokens_cuts_a_step_short(same_engine, noisy_engine, plain, max_tokens, which):
    engine = same_engine if which == "same" else noisy_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt, ref in zip(PROMPTS, plain, strict=True):
        r = engine.generate(prompt, params, spec_draft(5))[0]
        assert len(r.token_ids) == max_tokens
        assert r.token_ids == ref[:max_tokens]
        assert r.finish_reason == "length"
        # Drafts are clipped to what max_tokens leaves, so no step produces tokens it must drop.
        assert r.metrics.accepted + r.metrics.steps == max_tokens


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_cache_runs_out_mid_generation(qwen2_tiny, k, method):
    max_len = 20
    engine = make_engine(qwen2_tiny, qwen2_tiny, max_len=max_len)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    prompt = PROMPTS[1]
    ref = engine.generate(prompt, params)[0]
    got = engine.generate(prompt, params, SpecConfig(k_policy="fixed", method=method, k=k))[0]
    assert len(ref.token_ids) == max_len - len(prompt)
    assert ref.finish_reason == got.finish_reason == "length"
    assert got.token_ids == ref.token_ids


def test_requests_do_not_leak_state(noisy_engine, plain):
    # The drafter (and its KV cache / n-gram index) is reused across requests.
    for spec in (spec_draft(4), SpecConfig(k_policy="fixed", method="ngram", k=3)):
        order = [2, 0, 1, 0, 2]
        results = noisy_engine.generate([PROMPTS[i] for i in order], GREEDY, spec)
        assert [r.token_ids for r in results] == [plain[i] for i in order]


def test_k_zero_and_method_none_are_plain(noisy_engine, plain):
    for spec in (SpecConfig(k_policy="fixed", method="draft", k=0), SpecConfig(k_policy="fixed", method="none", k=5)):
        r = noisy_engine.generate(PROMPTS[0], GREEDY, spec)[0]
        assert r.token_ids == plain[0]
        assert r.metrics.drafted == 0


# -- metrics --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [spec_draft(3), spec_draft(7), SpecConfig(k_policy="fixed", method="ngram", k=4)],
                         ids=["draft-k3", "draft-k7", "ngram-k4"])
def test_metrics_are_consistent(noisy_engine, spec):
    results = noisy_engine.generate(PROMPTS, GREEDY, spec)
    for r in results:
        m = r.metrics
        assert m.requests == 1
        assert m.prompt_tokens == len(r.prompt_token_ids)
        assert m.generated_tokens == len(r.token_ids) == GREEDY.max_tokens
        assert 0 <= m.accepted <= m.drafted <= spec.k * m.steps
        assert m.steps * m.mean_accepted_length == pytest.approx(m.generated_tokens)
        # Each step yields its accepted drafts plus one target token; nothing is cut (ignore_eos, max_tokens).
        assert m.generated_tokens == m.accepted + m.steps
        assert sum(m.drafted_by_position) == m.drafted
        assert sum(m.accepted_by_position) == m.accepted
        assert sum(m.k_chosen.values()) == m.steps
        # Greedy verification accepts a prefix: acceptance counts cannot increase with position.
        acc = m.accepted_by_position
        assert all(a >= b for a, b in zip(acc, acc[1:], strict=False))
        assert m.ttft_s > 0 and m.total_s >= m.ttft_s
    merged = results[0].metrics
    for r in results[1:]:
        merged.merge(r.metrics)
    assert merged.requests == len(PROMPTS)
    assert merged.generated_tokens == len(PROMPTS) * GREEDY.max_tokens


def test_acceptance_by_position_when_late_positions_are_never_accepted():
    # Three positions drafted, only the first accepted: the per-position lists differ in length.
    m = Metrics()
    m.record_step(3, 3, 1)
    m.record_step(3, 2, 0)
    assert m.drafted_by_position == [2, 2, 1]
    assert m.acceptance_by_position == [0.5, 0.0, 0.0]
    json.dumps(m.summary())


def test_summary_after_a_speculative_run(noisy_engine):
    r = noisy_engine.generate(PROMPTS[0], GREEDY, spec_draft(7))[0]
    m = r.metrics
    summary = m.summary()
    json.dumps(summary)
    rates = summary["acceptance_by_position"]
    assert m.drafted > 0 and len(rates) == len(m.drafted_by_position) == 7
    assert all(0.0 <= a <= 1.0 for a in rates)
    assert summary["mean_accepted_length"] == pytest.approx(m.generated_tokens / m.steps)


# -- the n-gram drafter on hand-made sequences ------------------------------------------------

def propose(drafter: NgramDrafter, seq: list[int], k: int) -> list[int]:
    p = drafter.propose(seq, k, GREEDY, None)
    assert p.probs is None  # deterministic: q is one-hot
    assert len(p.tokens) <= k
    return p.tokens


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    # (1, 2) occurs at 0..1 and 4..5; the latest is followed by 3, 5, 1, 2.
    assert propose(d, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2], 3) == [3, 5, 1]


def test_ngram_prefers_the_longest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    # The suffix (1, 2) was followed by 9; the shorter suffix (2,) more recently by 5.
    assert propose(d, [7, 1, 2, 9, 8, 2, 5, 1, 2], 2) == [9, 8]


def test_ngram_proposal_stops_at_the_end_of_the_sequence():
    d = NgramDrafter(max_n=2, min_n=1)
    assert propose(d, [4, 6, 4], 5) == [6, 4]


def test_ngram_no_match_and_min_n():
    assert propose(NgramDrafter(max_n=3, min_n=1), [1, 2, 3, 4], 3) == []
    assert propose(NgramDrafter(max_n=3, min_n=2), [5, 1, 2, 5], 3) == []
    assert propose(NgramDrafter(max_n=3, min_n=1), [5, 1, 2, 5], 3) == [1, 2, 5]


def test_ngram_index_is_incremental_and_resets_on_a_new_sequence():
    d = NgramDrafter(max_n=2, min_n=1)
    seq = [1, 2, 3, 1]
    assert propose(d, seq, 2) == [2, 3]
    seq += [2, 8, 3]  # (3,) is now followed by 1 at index 2 ... and the latest (2,) by 8
    assert propose(d, seq, 2) == [1, 2]
    assert propose(d, seq + [2], 2) == [8, 3]
    d.begin([4, 1])
    assert propose(d, [4, 1], 3) == []  # nothing from the previous request survives
    d2 = NgramDrafter(max_n=2, min_n=1)
    assert propose(d2, [1, 2, 3, 1], 2) == [2, 3]
    assert propose(d2, [4, 1], 3) == []  # a shorter sequence is a new one even without begin()
