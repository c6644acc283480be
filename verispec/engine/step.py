"""The speculative step: propose, score, verify, roll back. Plain decoding is the k = 0 case."""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.engine.metrics import Metrics
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer
from verispec.sampling import SamplingParams, probs_from_logits
from verispec.verify import verify_greedy, verify_sampling


@torch.inference_mode()
def speculative_step(target: Transformer, cache: KVCache, seq: list[int], drafter: Drafter | None, k: int,
                     params: SamplingParams, generator: torch.Generator | None, metrics: Metrics) -> list[int]:
    """Extend ``seq`` by one step; return the new tokens (1 to k + 1 of them).

    Invariant: the target's cache holds ``seq[:-1]``; the last token has no K/V yet. The
    target scores [last token, d1..dk] in one forward, which yields a distribution for each
    draft position plus one more, so even an all-rejected step still produces a token.
    """
    # 1. Propose.
    with metrics.timed("propose"):
        proposal = drafter.propose(seq, k, params, generator) if drafter is not None and k > 0 else Proposal([])
    draft = proposal.tokens[:k]

    # 2. Score: one target forward over k + 1 positions.
    start = len(seq) - 1
    with metrics.timed("score"):
        tokens = torch.tensor([[seq[-1], *draft]], device=target.device)
        positions = torch.arange(start, start + len(draft) + 1, device=target.device).unsqueeze(0)
        logits = target(tokens, positions, cache, kv_len=start + len(draft) + 1)[0]

    # 3. Verify: longest valid prefix plus one token from the target.
    with metrics.timed("verify"):
        if params.greedy:
            n, extra = verify_greedy(draft, logits)
        else:
            # The draft's distributions cross to the target's device once per step (a no-op when they share one).
            q = None if proposal.probs is None else proposal.probs[: len(draft)].to(logits.device)
            n, extra = verify_sampling(draft, q, probs_from_logits(logits, params), generator)

    # 4. Roll both back to what was accepted: the target keeps K/V for seq[-1] and d1..dn.
    cache.lengths[0] = start + 1 + n
    if drafter is not None:
        drafter.commit(len(seq) + n)
    metrics.record_step(k, len(draft), n)
    return draft[:n] + [extra]
