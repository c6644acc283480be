"""Verification: decide how many drafted tokens the target keeps, and the token it adds.

Greedy keeps the longest prefix that matches the target's argmax. Sampling uses the
rejection rule of Leviathan et al. (2023) and Chen et al. (2023): keep draft token x with
probability min(1, p(x)/q(x)); at the first rejection draw from norm(max(p - q, 0)); if all
k survive draw a bonus token from p. The output is then distributed exactly as p.
"""

from __future__ import annotations

import torch

from verispec.sampling import sample


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Return (accepted count, next token) for ``draft`` against logits ``[len(draft)+1, V]``."""
    target = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, target[n]


def verify_sampling(draft: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection-sample ``draft`` against target distributions ``[len(draft)+1, V]``.

    ``draft_probs`` holds the distributions q the drafts were drawn from (``[len(draft), V]``);
    None means the drafter is deterministic (n-gram, datastore), i.e. q is one-hot on x.
    """
    k = len(draft)
    if k == 0:
        return 0, sample(target_probs[0], generator)
    device = target_probs.device
    idx = torch.tensor(draft, device=device)
    rows = torch.arange(k, device=device)
    p_x = target_probs[rows, idx]
    q_x = torch.ones(k, device=device) if draft_probs is None else draft_probs[rows, idx]
    u = torch.rand(k, generator=generator, device=device)
    # Accept iff u < p/q; written without the division, and ">=" so a token with p(x) = 0 never survives u = 0.
    rejected = (u * q_x >= p_x).nonzero()
    if len(rejected) == 0:
        return k, sample(target_probs[k], generator)
    n = int(rejected[0])
    p = target_probs[n]
    if draft_probs is None:
        residual = p.clone()
        residual[draft[n]] = 0.0
    else:
        residual = (p - draft_probs[n]).clamp_(min=0.0)
    total = residual.sum()
    # Rounding can leave no residual mass when p and q (almost) coincide; p is then exact.
    return n, sample(residual / total if total > 0 else p, generator)
