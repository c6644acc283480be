"""Hybrid drafting: routing between lookups and the engine's draft model, sub-drafter state, lossless output."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from drafters_common import (
    GREEDY,
    PROMPTS,
    build_echo_store,
    build_tok_model,
    chi_square_p,
    exact_first_two,
    make_engine,
    memory_store,
    plain_outputs,
    sampled_first_two,
)

import verispec.drafters
import verispec.engine.engine
import verispec.engine.planning
from verispec import Engine, SamplingParams, SpecConfig, VerispecError
from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.retrieval import RetrievalDrafter
from verispec.engine.costs import CostCurve, CostModel
from verispec.engine.draft_runner import MAX_LOCKSTEP_FEED, DraftRunner
from verispec.engine.policy import Acceptance
from verispec.engine.request import Request

# -- routing, with stand-in drafters ----------------------------------------------------------


class Fake(Drafter):
    """Proposes fixed tokens with a fixed match length; records the calls it gets."""

    def __init__(self, name: str, tokens: list[int], match: int = 0, max_n: int = 4) -> None:
        self.name, self.tokens, self.last_match, self.max_n = name, tokens, match, max_n
        self.calls: list[tuple] = []

    def begin(self, prompt):
        self.calls.append(("begin", len(prompt)))

    def propose(self, seq, k, params, generator):
        self.calls.append(("propose", len(seq)))
        return Proposal(self.tokens[:k])

    def commit(self, n_valid):
        self.calls.append(("commit", n_valid))


def route(ngram: Fake, retrieval: Fake | None = None, k: int = 4) -> tuple[int, list[int]]:
    """What the hybrid offers as free (a trusted lookup) and what it then proposes; (0, []) leaves the step
    to the engine's draft model (or to plain decoding without one)."""
    h = HybridDrafter(ngram, retrieval)
    return h.free_tokens([1, 2, 3], k, GREEDY, None), h.propose([1, 2, 3], k, GREEDY, None).tokens


def test_routing_rules():
    assert route(Fake("ngram", [5, 6], match=3)) == (2, [5, 6])  # long enough match
    assert route(Fake("ngram", [5, 6], match=2)) == (0, [])  # match too short: the draft model's step
    assert route(Fake("ngram", [5], match=4)) == (0, [])  # one token is not worth it
    assert route(Fake("ngram", [5], match=4), k=1) == (1, [5])  # ... unless one is all that is asked
    assert route(Fake("ngram", [5, 6], match=2, max_n=2)) == (2, [5, 6])  # threshold capped at max_n
    assert route(Fake("ngram", [5, 6], match=3), Fake("retrieval", [7, 8], match=5)) == (2, [7, 8])  # longer
    assert route(Fake("ngram", [5, 6], match=3), Fake("retrieval", [7, 8], match=3)) == (2, [5, 6])  # tie
    assert route(Fake("ngram", [], match=0), Fake("retrieval", [7, 8], match=4)) == (2, [7, 8])
    h = HybridDrafter(Fake("ngram", [], match=0))
    assert h.propose([1, 2, 3], 4, GREEDY, None).tokens == [] and h.counts == {"none": 1}


def test_begin_and_commit_reach_every_sub_drafter():
    ngram, retrieval = Fake("ngram", [5, 6], match=3), Fake("retrieval", [])
    h = HybridDrafter(ngram, retrieval)
    h.begin([1, 2])
    h.propose([1, 2], 3, GREEDY, None)
    h.commit(4)
    assert ngram.calls == [("begin", 2), ("propose", 2), ("commit", 4)]
    assert retrieval.calls == [("begin", 2), ("propose", 2), ("commit", 4)]
    assert h.counts == {"ngram": 1}


def test_a_trusted_lookup_is_offered_as_free_and_proposed_once():
    ngram = Fake("ngram", [5, 6, 7], match=3)
    h = HybridDrafter(ngram)
    h.begin([1, 2, 3])
    assert h.free_tokens([1, 2, 3], 4, GREEDY, None) == 3
    assert h.propose([1, 2, 3], 3, GREEDY, None).tokens == [5, 6, 7]  # the offered lookup, not a new one
    assert ngram.calls.count(("propose", 3)) == 1 and h.counts == {"ngram": 1}
    # An offered lookup the k policy leaves out (the row decodes plainly) is not counted as drafted.
    assert h.free_tokens([1, 2, 3, 4], 4, GREEDY, None) == 3 and h.counts == {"ngram": 1}
    short = HybridDrafter(Fake("ngram", [5, 6], match=2))
    assert short.free_tokens([1, 2, 3], 4, GREEDY, None) == 0  # untrusted: left to the k policy and the draft model
    assert short.propose([1, 2, 3], 2, GREEDY, None).tokens == []


def test_a_lookup_is_weighed_on_what_the_grammar_accepts():
    """Under a grammar, a lookup counts only its accepted tokens: refused ones leave the step to the model."""
    def allowed(ok):
        return lambda tokens: next((i for i, t in enumerate(tokens) if t not in ok), len(tokens))

    h = HybridDrafter(Fake("ngram", [5, 6, 7], match=3))
    assert h.free_tokens([1, 2, 3], 4, GREEDY, None, allowed({5, 6})) == 2
    assert h.propose([1, 2, 3], 4, GREEDY, None).tokens == [5, 6]
    model = Fake("draft", [9, 9])
    h = HybridDrafter(Fake("ngram", [5, 6, 7], match=3), model=model)
    assert h.free_tokens([1, 2, 3], 4, GREEDY, None, allowed({6, 7})) == 0  # refused at once: untrusted
    assert h.drafting() is model
    # The retrieval lookup the grammar accepts wins over a longer match it refuses.
    h = HybridDrafter(Fake("ngram", [5, 6], match=4), Fake("retrieval", [7, 8], match=3))
    assert h.free_tokens([1, 2, 3], 4, GREEDY, None, allowed({7, 8})) == 2
    assert h.propose([1, 2, 3], 4, GREEDY, None).tokens == [7, 8]


# -- with a draft model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(noisy_pair_engine) -> Engine:
    return noisy_pair_engine


@pytest.fixture(scope="module")
def plain(engine):
    return plain_outputs(engine, PROMPTS)


def watch_counts(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Counter]:
    """Watch the per-row drafters ``engine`` hands out; returns what their ``counts`` gained since."""
    seen: dict[int, tuple[Drafter, Counter]] = {}
    acquire = engine._drafters.acquire

    def watching(spec):
        drafter = acquire(spec)
        if drafter is not None and id(drafter) not in seen:
            seen[id(drafter)] = (drafter, Counter(getattr(drafter, "counts", {})))
        return drafter

    monkeypatch.setattr(engine._drafters, "acquire", watching)

    def gained() -> Counter:
        total: Counter = Counter()
        for drafter, before in seen.values():
            total.update(drafter.counts)
            total.subtract(before)
        return +total

    return gained


@pytest.mark.parametrize("k", [2, 4, 7])
def test_hybrid_with_a_draft_model_matches_plain(engine, plain, k, monkeypatch):
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=k)
    drafter = engine.drafter(spec)
    # The draft model is the hybrid's own fallback: a drafter drafting through the engine's lockstep runner.
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.model, ModelDrafter)
    assert drafter.model.lockstep is engine.draft_runner and not drafter.lookups_only
    counts = watch_counts(engine, monkeypatch)
    forwards = engine.draft_runner.forwards
    results = engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    c = counts()
    # Steps without a trusted lookup draft with the engine's draft runner: none of them decodes plainly.
    assert c["ngram"] > 0 and c["draft"] > 0 and c["none"] == 0
    assert engine.draft_runner.forwards > forwards


@torch.inference_mode()
def test_lookup_steps_leave_the_draft_model_a_catch_up(engine):
    """What lookup steps added, the draft model reads the next time it drafts: in its lockstep forward
    for a few tokens, alone (a catch-up) beyond that; it drafts as if cold."""
    vocab = engine.target.args.vocab_size
    runner = DraftRunner(engine.draft, 1, 64, vocab)
    seq = PROMPTS[0] + [7, 8, 9]
    runner.begin(0, seq)
    runner.propose([Request(seq, GREEDY, slot=0, k=2)])
    assert runner.catch_up_tokens == len(seq) - 1
    runner.commit(0, len(seq))  # no draft accepted: the target's token follows seq
    assert runner.cache.lengths[0] == len(seq)
    # A lookup step then added MAX_LOCKSTEP_FEED tokens: the lockstep forward reads them, no catch-up.
    before = runner.catch_up_tokens
    runner.propose([Request(seq + [1] * MAX_LOCKSTEP_FEED, GREEDY, slot=0, k=1)])
    assert runner.catch_up_tokens == before
    runner.commit(0, len(seq))
    # One more: all but the last (any step's own input) are read alone first.
    longer = seq + list(range(1, MAX_LOCKSTEP_FEED + 2))
    got = runner.propose([Request(longer, GREEDY, slot=0, k=3)])[0].tokens
    assert runner.catch_up_tokens - before == MAX_LOCKSTEP_FEED
    cold = DraftRunner(engine.draft, 1, 64, vocab)
    cold.begin(0, longer)
    assert got == cold.propose([Request(longer, GREEDY, slot=0, k=3)])[0].tokens


def test_lookups_run_where_the_cost_policy_keeps_the_model_plain(engine, plain, monkeypatch):
    """A draft priced far above a target step never runs, yet free lookups still speculate (losslessly)."""
    spec = SpecConfig(k_policy="cost", method="hybrid", k=4)
    # A flat target curve (a cheap draft would pay) and a draft forward a hundred target steps long.
    costs = CostModel(CostCurve({1: 0.1, 1024: 0.1}), CostCurve({1: 10.0, 64: 10.0}))
    priced = engine.with_config(costs=costs)
    counts = watch_counts(priced, monkeypatch)
    results = priced.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    c = counts()
    assert c["ngram"] > 0 and c["draft"] == 0
    assert priced.draft_runner.forwards == 0
    assert sum(r.metrics.drafted for r in results) > 0


def test_a_long_lookup_is_cut_where_scoring_stops_paying(engine, plain, monkeypatch):
    """k = 16 on a target whose every scored token past the fourth costs two steps: lookups longer
    than 3 tokens, which do not pay whole, are cut to 3 and drafted (losslessly), not dropped for a
    plain step."""
    spec = SpecConfig(k_policy="cost", method="hybrid", k=16)
    costs = CostModel(CostCurve({1: 0.1, 4: 0.1, 17: 0.1 + 13 * 0.2}),
                      CostCurve({1: 10.0, 64: 10.0}))
    priced = engine.with_config(costs=costs)
    offered: list[int] = []
    free_tokens = HybridDrafter.free_tokens

    def recording(self, *args, **kwargs):
        offered.append(free_tokens(self, *args, **kwargs))
        return offered[-1]

    monkeypatch.setattr(HybridDrafter, "free_tokens", recording)
    results = priced.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert max(offered) > 3
    ks = {k for r in results for k, n in r.metrics.k_chosen.items() if n}
    assert max(ks) == 3
    assert sum(r.metrics.drafted for r in results) == sum(min(n, 3) for n in offered) > 0


def test_lookups_are_valued_at_the_acceptance_their_request_reached(engine, plain, monkeypatch):
    """The acceptance a lookup is priced at is its own request's: the prior, then what that request's
    earlier lookup steps accepted (rows of one batch never share it)."""
    spec = SpecConfig(k_policy="cost", method="hybrid", k=8)
    priced = engine.with_config(costs=CostModel(CostCurve({1: 0.1, 1024: 0.1}),
                                                CostCurve({1: 10.0, 64: 10.0})))
    events: list[tuple] = []
    plan, advance = verispec.engine.planning.plan_row, verispec.engine.engine.Engine._advance

    def planning(req, *args):
        got = plan(req, *args)
        if req.lookup:
            events.append(("plan", id(req), got.fixed_rate))
        return got

    def advancing(self, req, report, i, now):
        if req.lookup:
            events.append(("step", id(req), report.drafted[i], report.accepted[i]))
        return advance(self, req, report, i, now)

    monkeypatch.setattr(verispec.engine.planning, "plan_row", planning)
    monkeypatch.setattr(verispec.engine.engine.Engine, "_advance", advancing)
    results = priced.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    replay: dict[int, Acceptance] = {}
    for kind, req, *rest in events:
        seen = replay.setdefault(req, Acceptance())
        if kind == "plan":
            assert rest[0] == pytest.approx(seen.rate)
        else:
            seen.update(*rest)
    assert len(replay) > 1 and sum(kind == "step" for kind, *_ in events) > 4
    assert any(rate != pytest.approx(Acceptance().rate) for kind, _, rate, *_ in events if kind == "plan")


def test_the_draft_model_stays_consistent_across_lookup_steps(engine, plain, monkeypatch):
    """Every proposal of the engine's draft runner for a hybrid row equals a fresh runner's that sees the
    sequence cold, also after lookup steps the draft model sat out and caught up on."""
    runner = engine.draft_runner
    vocab = engine.target.args.vocab_size
    begin, propose = runner.begin, runner.propose
    begun: set[int] = set()
    checked = catch_ups = 0

    def checking_begin(slot, *args, **kwargs):
        begun.add(slot)
        return begin(slot, *args, **kwargs)

    def checking_propose(rows):
        nonlocal checked, catch_ups
        for r in rows:
            # A model step leaves its row at most 2 tokens behind (all k accepted: the last draft and the
            # target's token); more means lookup steps added tokens. The first draft reads the prompt.
            if r.slot not in begun:
                catch_ups += len(r.seq) - runner.cache.lengths[r.slot] > 2
            begun.discard(r.slot)
        got = propose(rows)
        for r, p in zip(rows, got, strict=True):
            cold = DraftRunner(runner.model, 1, runner.cache.max_len, vocab)
            cold.begin(0, r.seq)
            assert p.tokens == cold.propose([Request(r.seq, r.params, slot=0, k=r.k)])[0].tokens
            checked += 1
        return got

    monkeypatch.setattr(runner, "begin", checking_begin)
    monkeypatch.setattr(runner, "propose", checking_propose)
    counts = watch_counts(engine, monkeypatch)
    results = engine.generate(PROMPTS, GREEDY, SpecConfig(k_policy="fixed", method="hybrid", k=4))
    assert [r.token_ids for r in results] == plain
    assert checked > 0 and counts()["ngram"] > 0
    assert catch_ups > 0  # the model sat out lookup steps and caught up afterwards


def test_without_a_draft_model_is_lookup_only(qwen2_tiny, plain, monkeypatch):
    engine = make_engine(qwen2_tiny.model)
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=3)
    drafter = engine.drafter(spec)
    assert isinstance(drafter, HybridDrafter) and engine.draft_runner is None
    assert drafter.model is None and drafter.lookups_only
    counts = watch_counts(engine, monkeypatch)
    results = engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    c = counts()
    assert c["ngram"] > 0 and c["draft"] == 0
    # Steps without a trusted lookup decode plainly: one scored position, nothing drafted.
    assert engine.stats.width_steps.get(1, 0) > 0
    assert sum(r.metrics.drafted for r in results) > 0


# -- with a datastore ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok_engine(tmp_path_factory) -> Engine:
    folder = build_tok_model(tmp_path_factory.mktemp("hybrid_model"))
    return Engine.from_pretrained(str(folder), dtype="float32", max_len=256, progress=False)


@pytest.mark.parametrize("k", [3, 5])
def test_hybrid_with_datastore_matches_plain(tok_engine, tmp_path_factory, k, monkeypatch):
    plain_tok = plain_outputs(tok_engine, PROMPTS)
    store = build_echo_store(tmp_path_factory.mktemp("echo"), tok_engine.tokenizer, PROMPTS, plain_tok)
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=k, datastore=str(store))
    drafter = tok_engine.drafter(spec)
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.retrieval, RetrievalDrafter)
    counts = watch_counts(tok_engine, monkeypatch)
    results = tok_engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain_tok
    assert counts()["retrieval"] > 0
    assert sum(r.metrics.accepted for r in results) > 0


def test_hybrid_does_not_fall_back_to_layer_skip(tok_engine):
    """Layer-skip is a method of its own: hybrid with ``layers`` and no draft model is refused."""
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=3, layers=1)
    with pytest.raises(VerispecError, match="layerskip"):
        tok_engine.drafter(spec)
    with pytest.raises(VerispecError, match="layerskip"):
        tok_engine.check_spec(spec)
    with pytest.raises(VerispecError, match="layerskip"):
        tok_engine.generate(PROMPTS[0], GREEDY, spec)
    assert tok_engine.drafter(replace(spec, method="layerskip")) is not None


# -- exact sampling ---------------------------------------------------------------------------

def test_hybrid_sampling_is_exact(small_vocab_target, small_vocab_close_draft, monkeypatch):
    """Steps alternate between deterministic lookups (q one-hot) and sampled model drafts (q given)."""
    target = small_vocab_target.model
    engine = make_engine(target, small_vocab_close_draft.model)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5, 6, 3, 4, 5]  # "3 4 5" recurs: the first step is a lookup
    gen = torch.Generator().manual_seed(0)
    docs = [[int(t) for t in torch.randint(0, 12, (40,), generator=gen)]]
    built: list[HybridDrafter] = []

    def with_memory_store(spec, ctx):  # the engine's hybrid drafters, with a datastore held in memory
        hybrid = HybridDrafter(NgramDrafter(spec.ngram_max, spec.ngram_min), RetrievalDrafter(memory_store(docs)),
                               model=ModelDrafter(ctx.lockstep))
        built.append(hybrid)
        return hybrid

    monkeypatch.setattr(verispec.drafters, "make_drafter", with_memory_store)
    counts = sampled_first_two(engine, prompt, params, SpecConfig(k_policy="fixed", method="hybrid", k=3), 1200)
    tally = sum((h.counts for h in built), Counter())
    assert tally["ngram"] > 0 and tally["draft"] > 0
    assert chi_square_p(counts, exact_first_two(target, prompt, params)) > 1e-3
