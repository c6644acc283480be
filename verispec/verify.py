"""Verification: decide how many drafted tokens the target keeps, and the token it adds.

Greedy keeps the longest prefix that matches the target's argmax. Sampling uses the
rejection rule of Leviathan et al. (2023) and Chen et al. (2023): keep draft token x with
probability min(1, p(x)/q(x)); at the first rejection draw from norm(max(p - q, 0)); if all
k survive draw a bonus token from p. The output is then distributed exactly as p.

A token tree (``parents``: each draft token's parent, -1 for the row's last real token, parents
before children) is verified along one root path. Greedy follows the child that equals the target's
argmax. Sampling takes deterministic candidates (q one-hot, as lookups propose): at each node the
children are tried in order, child x kept with probability p(x) / mass(p), else p(x) is set to 0; if
none is kept, the token is drawn from what is left of p. This is SpecInfer's multi-candidate rule
for one-hot q, and it samples each step's token exactly from p.
"""

from __future__ import annotations

import torch

from verispec.sampling import sample


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Children of each node in order (-1: the root), checking that every parent precedes its child."""
    kids: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft token {i} has parent {parent}: parents must come before their children")
        kids.setdefault(parent, []).append(i)
    return kids


def chain(n: int) -> list[int]:
    """The parents of a chain of ``n`` draft tokens."""
    return list(range(-1, n - 1))


def verify_greedy(draft: list[int], target_logits: torch.Tensor,
                  parents: list[int] | None = None) -> tuple[list[int], int]:
    """(accepted draft indices, next token) for ``draft`` against logits ``[len(draft)+1, V]``.

    Row 0 of the logits belongs to the root, row i + 1 to draft token i. ``parents`` None: a chain,
    and the accepted indices are the matching prefix 0..n-1.
    """
    kids = _children(chain(len(draft)) if parents is None else parents)
    target = target_logits.argmax(-1).tolist()
    path, node = [], -1
    while True:
        nxt = next((c for c in kids.get(node, ()) if draft[c] == target[node + 1]), None)
        if nxt is None:
            return path, target[node + 1]
        path.append(nxt)
        node = nxt


def verify_tree_sampling(draft: list[int], parents: list[int], target_probs: torch.Tensor,
                         generator: torch.Generator | None) -> tuple[list[int], int]:
    """(accepted draft indices, next token) for a tree of deterministic candidates against target
    distributions ``[len(draft)+1, V]`` (see the module for the rule)."""
    kids = _children(parents)
    device = target_probs.device
    path, node = [], -1
    while True:
        p = target_probs[node + 1].clone()
        kept = None
        for c in kids.get(node, ()):
            x = draft[c]
            u = float(torch.rand(1, generator=generator, device=device))
            # Keep iff u < p(x) / mass, without the division; ">=" so a token with p(x) = 0 never survives u = 0.
            if u * float(p.sum()) < float(p[x]):
                kept = c
                break
            p[x] = 0.0
        if kept is None:
            total = p.sum()
            # Rounding can leave no mass when the candidates held (almost) all of it; p is then exact.
            return path, sample(p / total if total > 0 else target_probs[node + 1], generator)
        path.append(kept)
        node = kept


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
