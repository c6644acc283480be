"""The self-speculative layer-skip drafter: lossless output, the shared cache's invariant, settings."""

from __future__ import annotations

import pytest
import torch
from drafters_common import (
    GREEDY,
    PROMPTS,
    build_tiny,
    chi_square_p,
    exact_first_two,
    make_engine,
    plain_outputs,
    sampled_first_two,
)

from verispec import SamplingParams, SpecConfig, VerispecError
from verispec.drafters.layerskip import LayerSkipDrafter, default_layers
from verispec.engine.request import Request
from verispec.engine.step import speculative_step

N_LAYERS = 4


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 4-layer Qwen2 target, so every exit layer L in 1..3 can draft."""
    return build_tiny(tmp_path_factory.mktemp("deep"), arch="qwen2", vocab=96, layers=N_LAYERS, dim=64, heads=4,
                      kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def engine(deep):
    return make_engine(deep)


@pytest.fixture(scope="module")
def plain(engine):
    return plain_outputs(engine, PROMPTS)


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_layerskip_greedy_matches_plain(engine, plain, layers, k):
    results = engine.generate(PROMPTS, GREEDY, SpecConfig(k_policy="fixed", method="layerskip", k=k, layers=layers))
    assert [r.token_ids for r in results] == plain
    assert all(r.metrics.drafted > 0 for r in results)


def test_deeper_exits_agree_more(engine):
    # Not a law, but on this model the 3-layer draft should beat the 1-layer one: the drafts are real.
    rates = []
    for layers in (1, 3):
        rs = engine.generate(PROMPTS, GREEDY, SpecConfig(k_policy="fixed", method="layerskip", k=4, layers=layers))
        rates.append(sum(r.metrics.accepted for r in rs) / sum(r.metrics.drafted for r in rs))
    assert rates[1] > rates[0] and rates[1] > 0


@torch.inference_mode()
def shallow_greedy(model, seq: list[int], layers: int, k: int) -> list[int]:
    """Greedy early-exit continuation computed from scratch (fresh cache every token)."""
    out: list[int] = []
    for _ in range(k):
        ids = seq + out
        cache = model.new_cache(1, len(ids))
        logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache, last_only=True,
                       n_layers=layers)
        out.append(int(logits[0, -1].argmax()))
    return out


@torch.inference_mode()
def test_shared_cache_invariant(engine, deep):
    """Drafting leaves the target cache's length and verified K/V alone; a step then leaves the cache
    exactly as a fresh prefill of the accepted sequence would."""
    layers, k = 2, 5
    drafter = LayerSkipDrafter(deep, engine.cache, layers)
    cache = engine.cache
    seq = list(PROMPTS[1])
    cache.reset(0)
    deep(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1).unsqueeze(0), cache)
    cache.lengths[0] = len(seq) - 1
    for _ in range(6):
        start = len(seq) - 1
        k_before, v_before = torch.stack(cache.k), torch.stack(cache.v)
        proposal = drafter.propose(seq, k, GREEDY, None)
        assert cache.lengths[0] == start
        ck, cv = torch.stack(cache.k), torch.stack(cache.v)
        assert proposal.tokens == shallow_greedy(deep, seq, layers, k)
        # Verified positions are untouched at every layer; layers >= L are untouched everywhere.
        assert torch.equal(ck[:, :, :, :start], k_before[:, :, :, :start])
        assert torch.equal(cv[:, :, :, :start], v_before[:, :, :, :start])
        assert torch.equal(ck[layers:], k_before[layers:]) and torch.equal(cv[layers:], v_before[layers:])
        # The drafts' shallow K/V went past the valid length, where verification overwrites them.
        assert not torch.equal(ck[:layers, :, :, start:start + k], k_before[:layers, :, :, start:start + k])

        row = Request(seq, GREEDY, slot=0, drafter=drafter, k=k)
        new = speculative_step(deep, cache, [row], None).new_tokens[0]
        seq += new
        assert cache.lengths[0] == len(seq) - 1
        ref = deep.new_cache(1, cache.max_len)
        deep(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1).unsqueeze(0), ref)
        n = len(seq) - 1
        ck, rk = torch.stack(cache.k), torch.stack(ref.k)
        torch.testing.assert_close(ck[:, :, :, :n], rk[:, :, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.stack(cache.v)[:, :, :, :n], torch.stack(ref.v)[:, :, :, :n], rtol=1e-5,
                                   atol=1e-5)


def test_propose_refuses_a_cache_out_of_step(engine, deep):
    drafter = LayerSkipDrafter(deep, engine.cache, 1)
    engine.cache.lengths[0] = 0
    with pytest.raises(RuntimeError, match="expected 3"):
        drafter.propose([5, 6, 7, 8], 2, GREEDY, None)


@pytest.mark.parametrize("layers", [0, -1, N_LAYERS, N_LAYERS + 3])
def test_layers_out_of_range(engine, layers):
    with pytest.raises(VerispecError, match=r"1 <= layers < 4"):
        engine.generate([3, 4], GREEDY, SpecConfig(k_policy="fixed", method="layerskip", k=2, layers=layers))


def test_one_layer_target_cannot_skip(tmp_path):
    shallow = build_tiny(tmp_path / "one", vocab=12, layers=1, dim=32, heads=2, kv_heads=1)
    with pytest.raises(VerispecError, match="at least 2 layers"):
        make_engine(shallow).generate([3, 4], GREEDY, SpecConfig(k_policy="fixed", method="layerskip", k=2))


def test_default_layers():
    assert [default_layers(n) for n in (2, 3, 4, 8, 24, 28, 30, 32)] == [1, 1, 1, 2, 6, 7, 7, 8]
    for n in range(2, 80):
        assert 1 <= default_layers(n) < n


def test_sampled_drafts_return_their_distributions(engine, deep):
    drafter = LayerSkipDrafter(deep, engine.cache, 2)
    seq = [4, 5, 6]
    engine.cache.reset(0)
    deep(torch.tensor([seq[:-1]]), torch.arange(2).unsqueeze(0), engine.cache)
    engine.cache.lengths[0] = 2
    p = drafter.propose(seq, 4, SamplingParams(temperature=0.8, top_k=20), torch.Generator().manual_seed(0))
    assert p.probs is not None and p.probs.shape == (4, 96)
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(4))
    assert all(p.probs[i, t] > 0 for i, t in enumerate(p.tokens))
    assert all((row > 0).sum() <= 20 for row in p.probs)  # top-k applied to q as to p


def test_layerskip_sampling_is_exact(tmp_path):
    target = build_tiny(tmp_path / "t", vocab=12, layers=3, dim=32, heads=2, kv_heads=1, seed=0, scale=4.0)
    engine = make_engine(target)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5]
    spec = SpecConfig(k_policy="fixed", method="layerskip", k=3, layers=2)
    counts = sampled_first_two(engine, prompt, params, spec, 1200)
    assert chi_square_p(counts, exact_first_two(target, prompt, params)) > 1e-3
