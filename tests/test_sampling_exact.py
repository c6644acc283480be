"""Speculative sampling is lossless: its output is distributed exactly as the target's.

A 12-token target lets us enumerate the exact joint distribution of the first two generated
tokens (144 outcomes) under each SamplingParams transform. Thousands of seeded speculative
samples are then compared to it with a chi-square goodness-of-fit test; a verifier that always
accepts drafts serves as the negative control and must be caught by the same test.

Each request asks for k + 1 tokens so that the first step drafts the full k (the engine clips k
to what max_tokens leaves): the first two tokens then come from position 1 and 2 of a k-draft,
exercising acceptance, rejection with the residual max(p - q, 0) and the bonus token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import verispec.engine.step
from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.sampling import probs_from_logits, sample
from verispec.verify import verify_greedy, verify_sampling

N = 3000  # samples per goodness-of-fit test
ALPHA = 1e-3
PROMPT = [3, 5, 7, 2]
# A prompt whose suffix recurs: the n-gram drafter proposes [9, 10] after it, and the target gives
# those tokens substantial but not overwhelming probability (checked below).
NGRAM_PROMPT = [11, 9, 10, 11]


def make_engine(target, draft=None) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=32, progress=False)
    return Engine(cfg, target.model, None, {1}, draft=None if draft is None else draft.model)


@torch.inference_mode()
def last_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """Logits at the last position of each row (equal lengths), from a fresh cache."""
    tokens = torch.tensor(rows)
    cache = model.new_cache(len(rows), tokens.shape[1])
    positions = torch.arange(tokens.shape[1]).expand(len(rows), -1)
    return model(tokens, positions, cache)[:, -1]


def exact_joint(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(first token = a, second token = b) as a ``[V, V]`` array, by enumeration."""
    vocab = model.args.vocab_size
    p1 = probs_from_logits(last_logits(model, [prompt])[0], params)
    p2 = probs_from_logits(last_logits(model, [prompt + [a] for a in range(vocab)]), params)
    joint = (p1[:, None] * p2).double().numpy()
    assert abs(joint.sum() - 1) < 1e-5
    return joint


def draw(engine: Engine, prompt: list[int], spec: SpecConfig | None, n: int = N, seed0: int = 0, **sampling):
    """``n`` seeded generations of k + 1 tokens; returns (counts of the first two tokens, summed metrics)."""
    vocab = engine.target.args.vocab_size
    k = spec.k if spec is not None else 1
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    drafted = accepted = 0
    for i in range(n):
        params = SamplingParams(max_tokens=k + 1, ignore_eos=True, seed=seed0 + i, **sampling)
        r = engine.generate(prompt, params, spec)[0]
        assert len(r.token_ids) == k + 1
        counts[r.token_ids[0], r.token_ids[1]] += 1
        drafted += r.metrics.drafted
        accepted += r.metrics.accepted
    return counts, drafted, accepted


def gof_pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells expected fewer than 5 times into one.

    Samples in cells of probability zero (cut by top-k / top-p) fail outright.
    """
    obs, exp = counts.ravel().astype(float), joint.ravel() * counts.sum()
    impossible = exp == 0
    assert obs[impossible].sum() == 0, "a sample landed on an outcome of probability zero"
    obs, exp = obs[~impossible], exp[~impossible]
    small = exp < 5
    o, e = list(obs[~small]), list(exp[~small])
    if small.any():
        o.append(obs[small].sum())
        e.append(exp[small].sum())
        if e[-1] < 5:  # fold a still-small pool into the smallest regular cell
            j = int(np.argmin(e[:-1]))
            o[j] += o.pop()
            e[j] += e.pop()
    assert len(e) >= 5, "too few cells for a meaningful test"
    o_arr, e_arr = np.array(o), np.array(e)
    return float(chisquare(o_arr, e_arr * o_arr.sum() / e_arr.sum()).pvalue)


def entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


@pytest.fixture(scope="module")
def engine(small_vocab_target, small_vocab_close_draft) -> Engine:
    return make_engine(small_vocab_target, small_vocab_close_draft)


def test_target_distribution_is_informative(small_vocab_target, small_vocab_close_draft):
    vocab = small_vocab_target.model.args.vocab_size
    for prompt in (PROMPT, NGRAM_PROMPT):
        p = torch.softmax(last_logits(small_vocab_target.model, [prompt])[0], -1)
        h = entropy(p)
        assert 0.3 < h < 0.85 * math.log(vocab), f"entropy {h:.3f} of {p}"
        assert float(p.max()) < 0.9
    # The close draft differs from the target (TV well above 0) without being unrelated.
    p = torch.softmax(last_logits(small_vocab_target.model, [PROMPT])[0], -1)
    q = torch.softmax(last_logits(small_vocab_close_draft.model, [PROMPT])[0], -1)
    tv = float((p - q).abs().sum() / 2)
    assert 0.1 < tv < 0.6, tv


def test_harness_accepts_plain_sampling(engine, small_vocab_target):
    # Positive control of the statistics: plain sampling is the target's distribution by construction.
    joint = exact_joint(small_vocab_target.model, PROMPT, SamplingParams(temperature=1.0))
    counts, drafted, _ = draw(engine, PROMPT, None, n=1500, temperature=1.0)
    assert drafted == 0
    assert gof_pvalue(counts, joint) > ALPHA


CASES = {
    "t1-k2": (dict(temperature=1.0), 2),
    "t0.7-top_p0.9-k3": (dict(temperature=0.7, top_p=0.9), 3),
    "top_k3-k2": (dict(temperature=1.0, top_k=3), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draft_sampling_matches_target(engine, small_vocab_target, case):
    sampling, k = CASES[case]
    joint = exact_joint(small_vocab_target.model, PROMPT, SamplingParams(**sampling))
    counts, drafted, accepted = draw(engine, PROMPT, SpecConfig(k_policy="fixed", method="draft", k=k), **sampling)
    # Both branches of the rejection rule ran many times.
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    p = gof_pvalue(counts, joint)
    assert p > ALPHA, f"speculative samples deviate from the target distribution (p = {p:.2e})"


def test_unrelated_draft_sampling_matches_target(small_vocab_target, small_vocab_draft):
    engine = make_engine(small_vocab_target, small_vocab_draft)
    joint = exact_joint(small_vocab_target.model, PROMPT, SamplingParams(temperature=1.0))
    counts, drafted, accepted = draw(engine, PROMPT, SpecConfig(k_policy="fixed", method="draft", k=2), n=2000,
                                     temperature=1.0)
    assert 0 < accepted < drafted
    assert gof_pvalue(counts, joint) > ALPHA


def test_ngram_sampling_matches_target(engine, small_vocab_target):
    params = SamplingParams(temperature=1.0)
    spec = SpecConfig(k_policy="fixed", method="ngram", k=2)
    # The n-gram drafter's deterministic proposal, and the target's view of it.
    assert engine.drafter(spec).propose(NGRAM_PROMPT, 2, params, None).tokens == [9, 10]
    joint = exact_joint(small_vocab_target.model, NGRAM_PROMPT, params)
    assert 0.1 < joint[9].sum() < 0.9 and 0.05 < joint[9, 10] < 0.9
    counts, drafted, accepted = draw(engine, NGRAM_PROMPT, spec, temperature=1.0)
    assert drafted > 0 and 0 < accepted < drafted
    p = gof_pvalue(counts, joint)
    assert p > ALPHA, f"n-gram speculative samples deviate from the target distribution (p = {p:.2e})"


def always_accept(draft, draft_probs, target_probs, generator):
    """A wrong verifier: keeps every draft token whatever p and q say."""
    return len(draft), sample(target_probs[len(draft)], generator)


def resample_from_p(draft, draft_probs, target_probs, generator):
    """A subtler wrong verifier: the right acceptance test, but a rejection redraws from p, not max(p - q, 0)."""
    k = len(draft)
    for i, x in enumerate(draft):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand(1, generator=generator)) * q_x > float(target_probs[i, x]):
            return i, sample(target_probs[i], generator)
    return k, sample(target_probs[k], generator)


@pytest.mark.parametrize(("verifier", "case"), [(always_accept, "t1-k2"), (always_accept, "top_k3-k2"),
                                                (resample_from_p, "t1-k2")])
def test_negative_control_wrong_verifier_is_caught(engine, small_vocab_target, monkeypatch, verifier, case):
    sampling, k = CASES[case]
    monkeypatch.setattr(verispec.engine.step, "verify_sampling", verifier)
    joint = exact_joint(small_vocab_target.model, PROMPT, SamplingParams(**sampling))
    counts, drafted, accepted = draw(engine, PROMPT, SpecConfig(k_policy="fixed", method="draft", k=k), n=1500,
                                     **sampling)
    if verifier is always_accept:
        assert accepted == drafted > 0  # the patch is in effect
    # Samples on impossible outcomes (outside top-k) are a detection too; else the chi-square test must fire.
    if not ((joint == 0) & (counts > 0)).any():
        p = gof_pvalue(counts, joint)
        assert p < ALPHA, f"the goodness-of-fit test missed a biased verifier (p = {p:.2e})"


@pytest.mark.parametrize("spec", [None, SpecConfig(k_policy="fixed", method="draft", k=3),
                                  SpecConfig(k_policy="fixed", method="ngram", k=3)],
                         ids=["plain", "draft", "ngram"])
def test_seeded_runs_are_reproducible(engine, spec):
    prompt = NGRAM_PROMPT
    runs = {}
    for seed in (11, 12, 13, 14, 15, 16):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        first = engine.generate(prompt, params, spec)[0].token_ids
        again = engine.generate(prompt, params, spec)[0].token_ids
        assert first == again
        runs[seed] = tuple(first)
    assert len(set(runs.values())) > 1  # and the seed matters


def test_greedy_sampling_params_are_greedy(engine):
    # temperature 0 ignores the seed and equals plain greedy, speculative or not.
    ref = engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    for seed in (1, 2):
        for spec in (None, SpecConfig(k_policy="fixed", method="draft", k=3)):
            params = SamplingParams(max_tokens=8, ignore_eos=True, seed=seed)
            assert engine.generate(PROMPT, params, spec)[0].token_ids == ref


# -- the verification rules on hand-made distributions ------------------------------------------

def test_verify_greedy_keeps_the_matching_prefix():
    logits = torch.full((4, 6), -1.0)
    for i, t in enumerate([2, 4, 1, 5]):
        logits[i, t] = 1.0
    assert verify_greedy([2, 4, 1], logits) == ([0, 1, 2], 5)
    assert verify_greedy([2, 3, 1], logits) == ([0], 4)
    assert verify_greedy([0, 4, 1], logits) == ([], 2)
    assert verify_greedy([], logits[:1]) == ([], 2)


def test_verify_sampling_accepts_everything_when_p_equals_q():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 8, generator=g), -1)
    for _ in range(200):
        draft = [sample(p[i], g) for i in range(3)]
        n, extra = verify_sampling(draft, p[:3], p, g)
        assert n == 3 and 0 <= extra < 8


def test_verify_sampling_rejects_impossible_tokens_and_uses_the_residual():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.0, 1.0]])
    for draft_probs in (q, None):  # a sampled draft, and a deterministic one (q one-hot)
        for _ in range(200):
            n, extra = verify_sampling([2], draft_probs, p, g)
            assert n == 0 and extra in (0, 1)


def test_verify_sampling_residual_distribution():
    # p = (0.6, 0.3, 0.1), q = (0.2, 0.7, 0.1): the output must be distributed as p.
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.7, 0.1])
    target = torch.stack([p, p])
    counts = np.zeros(3)
    n_draws = 6000
    for _ in range(n_draws):
        x = sample(q, g)
        n, extra = verify_sampling([x], q[None], target, g)
        counts[x if n == 1 else extra] += 1
    expected = p.double().numpy()
    assert chisquare(counts, expected / expected.sum() * n_draws).pvalue > ALPHA


def test_verify_sampling_never_accepts_a_zero_probability_token(monkeypatch):
    # Keep x with probability min(1, p(x)/q(x)): a token the target forbids (p(x) = 0, e.g. cut by
    # top-k) must never be kept, including when the uniform draw u is exactly 0 (torch.rand's range
    # is [0, 1), so u = 0 happens about once per 2**24 draws).
    monkeypatch.setattr(torch, "rand", lambda n, generator=None, **kw: torch.zeros(n))
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    for draft_probs in (torch.tensor([[0.0, 0.0, 1.0]]), None):
        n, extra = verify_sampling([2], draft_probs, p, torch.Generator().manual_seed(0))
        assert n == 0 and extra in (0, 1)
