"""probs_from_logits finds the top-p nucleus from a few candidates, and gives what a full sort gives.

The reference is the rule written the obvious way: sort the whole row by descending probability,
drop each token once the mass before it reaches top_p, renormalize. On rows without ties at the
cut the result is the same token for token; where equal probabilities straddle the cut, which of
them stay is torch.topk's choice, and the nucleus must still be one the rule allows.
"""

from __future__ import annotations

import pytest
import torch

from verispec.sampling import TOP_P_CANDIDATES, SamplingParams, probs_from_logits

TOP_PS = (0.1, 0.5, 0.9, 0.95, 0.999)


def full_sort_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution with the nucleus found by sorting every row's whole vocabulary."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def zipf_logits(shape: tuple[int, ...], slope: float, seed: int) -> torch.Tensor:
    """Logits ``-slope * ln(rank)`` plus a little noise, over a random permutation of each row."""
    g = torch.Generator().manual_seed(seed)
    vocab = shape[-1]
    ranked = -slope * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    rows = [ranked[torch.randperm(vocab, generator=g)] for _ in range(int(torch.tensor(shape[:-1]).prod()))]
    return (torch.stack(rows) + 0.1 * torch.randn(len(rows), vocab, generator=g)).view(shape)


@pytest.fixture
def widths(monkeypatch) -> list[int]:
    """The candidate counts of every torch.topk call (top-p's passes; a top_k cut's own call too)."""
    seen: list[int] = []
    topk = torch.Tensor.topk

    def spy(self: torch.Tensor, k: int, *args, **kwargs):
        seen.append(k)
        return topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    return seen


@pytest.mark.parametrize("shape", [(151936,), (3, 4096), (2, 2, 1000), (5, 100), (40,)])
@pytest.mark.parametrize("slope", [2.0, 1.2, 0.6], ids=["peaked", "medium", "flat"])
def test_equals_the_full_sort(shape, slope):
    logits = zipf_logits(shape, slope, seed=len(shape) + shape[-1])
    for top_p in TOP_PS:
        for top_k in (0, 5, TOP_P_CANDIDATES + 44):
            params = SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k)
            got = probs_from_logits(logits, params)
            assert got.shape == logits.shape and got.dtype == torch.float32
            assert torch.equal(got, full_sort_probs(logits, params))


def test_peaked_rows_stay_among_the_candidates_and_flat_ones_grow_them(widths):
    peaked = zipf_logits((4, 151936), 2.0, seed=0)
    for top_p in TOP_PS:
        params = SamplingParams(temperature=0.8, top_p=top_p)
        assert torch.equal(probs_from_logits(peaked, params), full_sort_probs(peaked, params))
    assert set(widths) == {TOP_P_CANDIDATES}  # one pass of 256 candidates each time
    widths.clear()
    flat = zipf_logits((3, 151936), 0.9, seed=1)  # nucleus of thousands of tokens
    params = SamplingParams(temperature=0.8, top_p=0.9)
    got = probs_from_logits(flat, params)
    assert torch.equal(got, full_sort_probs(flat, params))
    assert ((got > 0).sum(-1) > 1000).all()
    assert widths[0] == TOP_P_CANDIDATES and max(widths) < 151936  # grown, but no full sort


def test_a_batch_mixing_both_paths_equals_its_rows_alone():
    rows = torch.cat([zipf_logits((2, 20000), 2.0, seed=2), zipf_logits((2, 20000), 0.6, seed=3)])[[0, 2, 1, 3]]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    batch = probs_from_logits(rows, params)
    for i, row in enumerate(rows):
        assert torch.equal(batch[i], probs_from_logits(row, params))


@pytest.mark.parametrize("kind", ["bf16", "integers"])
def test_ties_at_the_cut_give_a_nucleus_the_rule_allows(kind):
    # bf16 logits and integer ones make runs of equal probabilities, some straddling the cut.
    g = torch.Generator().manual_seed(4)
    for scale, vocab in ((1.0, 40), (3.0, 5000), (10.0, 151936)):
        logits = torch.randn(3, vocab, generator=g) * scale
        logits = logits.bfloat16() if kind == "bf16" else logits.round()
        for top_p in TOP_PS:
            params = SamplingParams(temperature=0.8, top_p=top_p)
            got = probs_from_logits(logits, params)
            assert torch.equal(got, probs_from_logits(logits, params))  # deterministic
            full = probs_from_logits(logits, SamplingParams(temperature=0.8))
            reference = full_sort_probs(logits, params)
            for p, q, ref in zip(full, got, reference, strict=True):
                kept = q > 0
                # As many tokens as the rule keeps, each at least as likely as any dropped one, and
                # (renormalized) in proportion to the full distribution.
                assert int(kept.sum()) == int((ref > 0).sum())
                assert p[kept].min() >= (p[~kept].max() if (~kept).any() else 0)
                assert torch.allclose(q[kept], p[kept] / p[kept].sum())


def test_the_first_token_always_stays_and_a_top_k_row_keeps_its_support():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.equal(got[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert sorted(got[1].tolist()) == [0.0, 0.0, 0.0, 1.0]  # one of four equals, whole
    # A top_p the API accepts (> 0) but that is 0 in fp32: still the most likely token, never NaN.
    for tiny in (1e-300, 5e-324):
        got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=tiny))
        assert torch.equal(got[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
        assert sorted(got[1].tolist()) == [0.0, 0.0, 0.0, 1.0]
    # top_k 3 of a wide row, with top_p so close to 1 that the mass of the three may stay below it:
    # every one of them stays, and nothing else.
    logits = zipf_logits((2, 151936), 1.0, seed=5)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1 - 1e-9)
    got = probs_from_logits(logits, params)
    assert torch.equal(got, full_sort_probs(logits, params))
    assert ((got > 0).sum(-1) == 3).all()


def test_greedy_is_one_hot_on_the_argmax():
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(6)).bfloat16()
    got = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert got.dtype == torch.float32
    assert torch.equal(got, full_sort_probs(logits, SamplingParams(temperature=0.0)))
