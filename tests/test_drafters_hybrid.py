"""The hybrid drafter: routing between lookup and model drafts, sub-drafter state, lossless output."""

from __future__ import annotations

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

from verispec import Engine, SamplingParams, SpecConfig
from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.retrieval import RetrievalDrafter

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


def route(ngram: Fake, model: Fake | None, retrieval: Fake | None = None, k: int = 4) -> list[int]:
    return HybridDrafter(ngram, model, retrieval).propose([1, 2, 3], k, GREEDY, None).tokens


def test_routing_rules():
    model = Fake("draft", [9, 9, 9, 9])
    assert route(Fake("ngram", [5, 6], match=3), model) == [5, 6]  # long enough match
    assert route(Fake("ngram", [5, 6], match=2), model) == [9, 9, 9, 9]  # match too short
    assert route(Fake("ngram", [5], match=4), model) == [9, 9, 9, 9]  # one token is not worth it
    assert route(Fake("ngram", [5], match=4), model, k=1) == [5]  # ... unless one is all that is asked
    assert route(Fake("ngram", [5, 6], match=2, max_n=2), model) == [5, 6]  # threshold capped at max_n
    assert route(Fake("ngram", [5, 6], match=3), model, Fake("retrieval", [7, 8], match=5)) == [7, 8]  # longer
    assert route(Fake("ngram", [5, 6], match=3), model, Fake("retrieval", [7, 8], match=3)) == [5, 6]  # tie
    assert route(Fake("ngram", [], match=0), model, Fake("retrieval", [7, 8], match=4)) == [7, 8]
    assert route(Fake("ngram", [], match=0), None) == []  # lookup only


def test_begin_and_commit_reach_every_sub_drafter():
    ngram, model, retrieval = Fake("ngram", [5, 6], match=3), Fake("draft", [9]), Fake("retrieval", [])
    h = HybridDrafter(ngram, model, retrieval)
    h.begin([1, 2])
    h.propose([1, 2], 3, GREEDY, None)
    h.commit(4)
    assert model.calls == [("begin", 2), ("commit", 4)]  # not asked to draft, yet told what is final
    assert ngram.calls == [("begin", 2), ("propose", 2), ("commit", 4)]
    assert retrieval.calls == [("begin", 2), ("propose", 2), ("commit", 4)]
    assert h.counts == {"ngram": 1}


def test_a_trusted_lookup_is_offered_as_free_and_proposed_once():
    ngram, model = Fake("ngram", [5, 6, 7], match=3), Fake("draft", [9, 9])
    h = HybridDrafter(ngram, model)
    h.begin([1, 2, 3])
    assert h.free_tokens([1, 2, 3], 4, GREEDY, None) == 3
    assert h.propose([1, 2, 3], 3, GREEDY, None).tokens == [5, 6, 7]  # the offered lookup, not a new one
    assert ngram.calls.count(("propose", 3)) == 1 and h.counts == {"ngram": 1}
    assert not [c for c in model.calls if c[0] == "propose"]
    short = HybridDrafter(Fake("ngram", [5, 6], match=2), model)
    assert short.free_tokens([1, 2, 3], 4, GREEDY, None) == 0  # untrusted: left to the k policy
    assert short.propose([1, 2, 3], 2, GREEDY, None).tokens == [9, 9]


# -- with a draft model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(noisy_pair_engine) -> Engine:
    return noisy_pair_engine


@pytest.fixture(scope="module")
def plain(engine):
    return plain_outputs(engine, PROMPTS)


@pytest.mark.parametrize("k", [2, 4, 7])
def test_hybrid_with_a_draft_model_matches_plain(engine, plain, k):
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=k)
    drafter = engine.drafter(spec)
    drafter.counts.clear()
    results = engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert isinstance(drafter.model, ModelDrafter)
    assert drafter.counts["ngram"] > 0 and drafter.counts["draft"] > 0


def test_the_model_catch_up_is_the_hybrids(engine):
    hybrid = engine.drafter(SpecConfig(k_policy="fixed", method="hybrid", k=3))
    seq = PROMPTS[0] + [7, 8, 9]
    hybrid.begin(seq)
    assert hybrid.catch_up_tokens(seq) == hybrid.model.catch_up_tokens(seq) == len(seq) - 1
    hybrid.model.propose(seq, 2, GREEDY, None)
    hybrid.commit(len(seq))
    # A lookup step then added three tokens: the model reads two of them (the last is any step's own).
    assert hybrid.catch_up_tokens(seq + [1, 2, 3]) == 2


def test_lookups_run_where_the_cost_policy_keeps_the_model_plain(engine, plain):
    """A draft priced far above a target step never runs, yet free lookups still speculate (losslessly)."""
    spec = SpecConfig(k_policy="cost", method="hybrid", k=4)
    drafter = engine.drafter(spec)
    costs = engine.cost_model(spec, drafter)
    costs.draft_s = 100 * costs.verify_s[-1]
    drafter.counts.clear()
    results = engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert drafter.counts["ngram"] > 0 and drafter.counts["draft"] == 0
    assert sum(r.metrics.drafted for r in results) > 0


class CheckedModelDrafter(ModelDrafter):
    """A model drafter whose every proposal is checked against a fresh drafter that sees ``seq`` cold."""

    def __init__(self, model, max_len: int) -> None:
        super().__init__(model, max_len)
        self.checked = 0
        self.catch_ups = 0  # proposals that had to feed more than the last token first

    def propose(self, seq, k, params, generator):
        self.catch_ups += len(seq) - self.cache.lengths[0] > 1
        got = super().propose(seq, k, params, generator)
        fresh = ModelDrafter(self.model, self.cache.max_len)
        assert got.tokens == fresh.propose(seq, k, params, generator).tokens
        self.checked += 1
        return got


def test_model_drafter_cache_stays_consistent_across_lookup_steps(engine, plain, qwen2_noisy_draft_tiny):
    checked = CheckedModelDrafter(qwen2_noisy_draft_tiny.model, engine.config.max_len)
    hybrid = HybridDrafter(NgramDrafter(), checked)
    results = engine.generate(PROMPTS, GREEDY, SpecConfig(k_policy="fixed", method="hybrid", k=4), drafter=hybrid)
    assert [r.token_ids for r in results] == plain
    assert checked.checked > 0 and hybrid.counts["ngram"] > 0
    assert checked.catch_ups > 0  # the model sat out lookup steps and caught up afterwards


def test_without_draft_or_layers_is_lookup_only(qwen2_tiny, plain):
    engine = make_engine(qwen2_tiny.model)
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=3)
    drafter = engine.drafter(spec)
    assert drafter.model is None
    results = engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert drafter.counts["ngram"] > 0 and drafter.counts["none"] > 0


# -- with a datastore and the layer-skip fallback ---------------------------------------------

@pytest.fixture(scope="module")
def tok_engine(tmp_path_factory) -> Engine:
    folder = build_tok_model(tmp_path_factory.mktemp("hybrid_model"))
    return Engine.from_pretrained(str(folder), dtype="float32", max_len=256, progress=False)


@pytest.mark.parametrize("k", [3, 5])
def test_hybrid_with_datastore_and_layerskip_matches_plain(tok_engine, tmp_path_factory, k):
    plain_tok = plain_outputs(tok_engine, PROMPTS)
    store = build_echo_store(tmp_path_factory.mktemp("echo"), tok_engine.tokenizer, PROMPTS, plain_tok)
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=k, datastore=str(store), layers=1)
    drafter = tok_engine.drafter(spec)
    assert isinstance(drafter.retrieval, RetrievalDrafter) and isinstance(drafter.model, LayerSkipDrafter)
    results = tok_engine.generate(PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain_tok
    assert drafter.counts["retrieval"] > 0 and drafter.counts["layerskip"] > 0
    assert sum(r.metrics.accepted for r in results) > 0


# -- exact sampling ---------------------------------------------------------------------------

def test_hybrid_sampling_is_exact(small_vocab_target, small_vocab_close_draft):
    """Steps alternate between deterministic lookups (q one-hot) and sampled model drafts (q given)."""
    target = small_vocab_target.model
    engine = make_engine(target, small_vocab_close_draft.model)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5, 6, 3, 4, 5]  # "3 4 5" recurs: the first step is a lookup
    gen = torch.Generator().manual_seed(0)
    docs = [[int(t) for t in torch.randint(0, 12, (40,), generator=gen)]]
    hybrid = HybridDrafter(NgramDrafter(), ModelDrafter(small_vocab_close_draft.model, engine.config.max_len),
                           RetrievalDrafter(memory_store(docs)))
    counts = sampled_first_two(engine, prompt, params, SpecConfig(k_policy="fixed", method="hybrid", k=3), 1200,
                               drafter=hybrid)
    assert hybrid.counts["ngram"] > 0 and hybrid.counts["draft"] > 0
    assert chi_square_p(counts, exact_first_two(target, prompt, params)) > 1e-3

