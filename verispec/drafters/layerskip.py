"""Self-speculative drafting by early exit (after LayerSkip, Elhoushi et al. 2024, and Draft & Verify,
Zhang et al. 2023): the target's first L layers, its final norm and lm_head draft; no second model.

The drafter shares the target's KV cache. At layers < L the K/V of verified positions are exactly
what the shallow model needs, because the full model computes those layers the same way; so there
is nothing to catch up on but the last token, which the step has not scored yet. Drafting writes
layer < L K/V at positions from ``len(seq) - 1`` on, past the cache's valid length; the verify
forward then rewrites every one of those positions at every layer before attending to them, and
the cache's length is never touched here, so the step's invariant (the cache holds ``seq[:-1]``)
and its O(1) rollback are unaffected.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, Proposal, draft_token
from verispec.errors import VerispecError
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer
from verispec.sampling import SamplingParams


def default_layers(n_layers: int) -> int:
    """The default exit layer: a quarter of the depth, at least 1 (and below ``n_layers``).

    Not tuned: models trained without early-exit losses predict poorly from shallow layers (on
    smollm2-135m, 30 layers, greedy acceptance was ~0 up to L = 15 and 0.2-0.3 only at L = 28;
    see docs/drafters.md), so the best L, and whether any L pays, depends on the model. A
    quarter keeps a draft token at about 1/4 of a target token's cost, so k = 4 drafts cost
    about one target forward, which suits checkpoints trained for early exit.
    """
    return max(1, min(n_layers // 4, n_layers - 1))


def check_layers(layers: int, n_layers: int) -> None:
    """Raise a :class:`VerispecError` unless 1 <= layers < n_layers."""
    if not isinstance(layers, int) or not 1 <= layers < n_layers:
        raise VerispecError(f"layerskip needs 1 <= layers < {n_layers} (the target's depth); got {layers!r}")


class LayerSkipDrafter(Drafter):
    """Drafts with the first ``layers`` layers of ``model`` over ``cache`` (the target's own cache, in
    the row of its request's slot).

    Greedy requests get greedy drafts; sampled ones are drawn from ``probs_from_logits`` of the
    early-exit logits under the request's settings, and those distributions are returned as q.
    ``min_confidence`` stops a draft early once the top probability falls below it.
    """

    name = "layerskip"

    def __init__(self, model: Transformer, cache: KVCache, layers: int | None = None,
                 min_confidence: float = 0.0) -> None:
        n = model.args.n_layers
        if n < 2:
            raise VerispecError("layerskip needs a target with at least 2 layers")
        self.layers = default_layers(n) if layers is None else layers
        check_layers(self.layers, n)
        self.model, self.cache, self.min_confidence = model, cache, min_confidence
        self.forward_fraction = self.layers / n
        self.slot = 0

    def use_row(self, slot: int) -> None:
        self.slot = slot

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        start = len(seq) - 1
        if self.cache.lengths[self.slot] != start:
            # The target cache must hold exactly seq[:-1], or shallow K/V would be missing or stale.
            raise RuntimeError(f"layerskip: target cache holds {self.cache.lengths[self.slot]} positions, "
                               f"expected {start}")
        k = min(k, self.cache.max_len - len(seq))
        device = self.model.device
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        tok = seq[-1]
        for i in range(k):
            pos = start + i
            logits = self.model(torch.tensor([[tok]], device=device), torch.tensor([[pos]], device=device),
                                self.cache, kv_len=pos + 1, rows=slice(self.slot, self.slot + 1),
                                n_layers=self.layers)[0, -1]
            tok, q = draft_token(logits, params, generator, self.min_confidence if tokens else 0.0)
            if tok is None:
                break
            if q is not None:
                probs.append(q)
            tokens.append(tok)
        return Proposal(tokens, torch.stack(probs) if probs else None)
