"""sample draws an id with probability proportional to its weight (inverse transform on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from verispec.sampling import sample

BLOCK = 256  # any width: the supports below lie at and across its multiples


def test_draws_follow_the_weights():
    # Unnormalized weights with zeros between them and at the end.
    g = torch.Generator().manual_seed(0)
    weights = torch.zeros(2 * BLOCK + 40)
    support = [0, 5, BLOCK - 1, BLOCK, 300, 2 * BLOCK + 1, 2 * BLOCK + 30]
    weights[support] = torch.tensor([3.0, 0.5, 1.0, 2.0, 0.25, 1.5, 4.0])
    counts = np.zeros(len(weights))
    for _ in range(20000):
        counts[sample(weights, g)] += 1
    assert counts[weights.numpy() == 0].sum() == 0
    expected = weights.double().numpy()[support]
    assert chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue > 1e-3


def test_the_extreme_uniforms_land_on_the_first_and_last_ids_with_weight(monkeypatch):
    weights = torch.zeros(3 * BLOCK + 7)
    weights[[2, 100, 2 * BLOCK + 3]] = torch.tensor([0.2, 0.5, 0.3])
    for u, expected in ((0.0, 2), (1 - 2**-53, 2 * BLOCK + 3)):
        monkeypatch.setattr(torch, "rand", lambda n, *a, u=u, **kw: torch.full((n,), u, dtype=torch.float64))
        assert sample(weights, None) == expected


def test_a_distribution_without_mass_is_refused():
    with pytest.raises(ValueError, match="summing to"):
        sample(torch.zeros(10), None)
    with pytest.raises(ValueError, match="summing to"):
        sample(torch.tensor([0.5, float("nan")]), None)
