"""A draft model drafting for many sequences at once: one KV cache row per batch slot, lockstep forwards.

The single-request :class:`~verispec.drafters.model.ModelDrafter` owns a one-row cache; a batch
would need one drafter (and one forward per draft token) per row. Here all rows draft together:
iteration j feeds every still-drafting row its latest token in one forward, so drafting k tokens
for B rows costs k forwards, not B * k.

Rows catch up on what their draft cache has not seen yet (the target's bonus token, the last
accepted draft) in the first iteration. Catch-ups differ per row, so that iteration is right-padded
to the longest one and each row's logits are read at its own last real position; a row lagging by
more than a few tokens (it ran plain steps for a while) first catches up alone, so it never makes
every other row pad. Slots in the forward's row span that are not drafting get dummy tokens at
positions from their own cache length on: attention masks by position, so such entries are never
read before they are overwritten (the same argument as the cache's O(1) rollback).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.drafters.base import Proposal
from verispec.models.llama import Transformer
from verispec.sampling import SamplingParams, probs_from_logits, sample

# A row whose catch-up exceeds this many tokens catches up alone before the lockstep.
MAX_LOCKSTEP_FEED = 3


@dataclass
class DraftRow:
    """One row's drafting request: its slot, full sequence, k and sampling settings."""

    slot: int
    seq: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None
    min_confidence: float = 0.0  # stop drafting once the top probability falls below this
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    done: bool = False


class BatchDraftModel:
    """Drafts for the rows of a batch with one model and one ``slots``-row KV cache."""

    def __init__(self, model: Transformer, slots: int, cache_len: int, vocab_size: int | None = None) -> None:
        self.model = model
        self.cache = model.new_cache(slots, cache_len)
        # Draft and target embeddings may differ in padding rows; q must live on the target's vocabulary.
        self.vocab_size = vocab_size or model.args.vocab_size
        self.forwards = 0  # lockstep forwards run (the policy's draft cost is per forward)

    def begin(self, slot: int) -> None:
        """A new sequence takes ``slot``."""
        self.cache.reset(slot)

    def commit(self, slot: int, n_valid: int) -> None:
        """The first ``n_valid`` tokens of ``slot``'s sequence are final."""
        self.cache.lengths[slot] = min(self.cache.lengths[slot], n_valid)

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> list[Proposal]:
        """Draft up to ``row.k`` tokens for every row; one proposal per row, in order."""
        device, lengths = self.model.device, self.cache.lengths
        feeds: dict[int, list[int]] = {}
        for r in rows:
            if r.k <= 0:
                continue
            start = min(lengths[r.slot], len(r.seq) - 1)
            lengths[r.slot] = start
            if len(r.seq) - start > MAX_LOCKSTEP_FEED:
                # A long lag: catch up alone (prefill-like, logits of the last position only).
                lag = r.seq[start:-1]
                pos = torch.arange(start, start + len(lag), device=device).unsqueeze(0)
                self.model(torch.tensor([lag], device=device), pos, self.cache, rows=slice(r.slot, r.slot + 1),
                           last_only=True)
                start = lengths[r.slot] = len(r.seq) - 1
            feeds[r.slot] = r.seq[start:]
        active = [r for r in rows if r.k > 0]
        while active:
            lo, hi = min(r.slot for r in active), max(r.slot for r in active) + 1
            width = max(len(feeds[r.slot]) for r in active)
            # Every slot in [lo, hi) runs: idle ones write dummies past their length (never read).
            starts = list(lengths[lo:hi])
            tokens = torch.zeros(hi - lo, width, dtype=torch.long)
            for r in active:
                f = feeds[r.slot]
                tokens[r.slot - lo] = torch.tensor(f + [f[-1]] * (width - len(f)))
            pos = torch.tensor(starts).unsqueeze(1) + torch.arange(width)
            logits = self.model(tokens.to(device), pos.to(device), self.cache, kv_len=int(pos.max()) + 1,
                                rows=slice(lo, hi), last_only=width == 1)
            self.forwards += 1
            for r in active:
                n = len(feeds[r.slot])
                lengths[r.slot] += n
                self._pick(r, logits[r.slot - lo, (n - 1) if width > 1 else -1])
                feeds[r.slot] = r.tokens[-1:]
            active = [r for r in active if not r.done]
        return [Proposal(r.tokens, torch.stack(r.probs) if r.probs else None) for r in rows]

    def _pick(self, r: DraftRow, logits: torch.Tensor) -> None:
        # Exactly ModelDrafter's choice, so a row drafts the same tokens alone or in a batch.
        if logits.shape[-1] != self.vocab_size:
            logits = _fit_vocab(logits, self.vocab_size)
        if r.params.greedy:
            tok = int(logits.argmax())
            if r.min_confidence and r.tokens and torch.softmax(logits, -1)[tok] < r.min_confidence:
                r.done = True
                return
        else:
            q = probs_from_logits(logits, r.params)
            if r.min_confidence and r.tokens and float(q.max()) < r.min_confidence:
                r.done = True
                return
            tok = sample(q, r.generator)
            r.probs.append(q)
        r.tokens.append(tok)
        r.done = len(r.tokens) >= r.k


def _fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    # As ModelDrafter's: drop padding rows of a larger table, or pad a smaller one with -inf.
    if logits.shape[-1] > size:
        return logits[:size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))
