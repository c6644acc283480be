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

import time
from dataclasses import dataclass, field

import torch

from verispec.drafters.base import Proposal
from verispec.engine.metrics import sync
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
        self.catch_ups = 0  # rows that caught up alone, the context they read and the seconds it took
        self.catch_up_tokens = 0
        self.catch_up_s = 0.0
        # Per slot: (the request's generator, a generator of our own on the draft's device).
        self._local_gens: dict[int, tuple[torch.Generator, torch.Generator]] = {}

    def begin(self, slot: int) -> None:
        """A new sequence takes ``slot``."""
        self.cache.reset(slot)
        self._local_gens.pop(slot, None)

    def _generator(self, slot: int, generator: torch.Generator | None) -> torch.Generator | None:
        # As ModelDrafter: a request generator on another device seeds, once per request, one on ours.
        device = self.model.device
        if generator is None or generator.device == device:
            return generator
        own = self._local_gens.get(slot)
        if own is None or own[0] is not generator:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            own = self._local_gens[slot] = (generator, torch.Generator(device=device).manual_seed(seed))
        return own[1]

    def catch_up_needed(self, slot: int, seq: list[int]) -> int:
        """Tokens of ``seq`` the row in ``slot`` must read alone before drafting (0: it keeps up in lockstep)."""
        lag = len(seq) - min(self.cache.lengths[slot], len(seq) - 1)
        return lag - 1 if lag > MAX_LOCKSTEP_FEED else 0

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
            if not r.params.greedy:
                r.generator = self._generator(r.slot, r.generator)
            start = min(lengths[r.slot], len(r.seq) - 1)
            lengths[r.slot] = start
            if len(r.seq) - start > MAX_LOCKSTEP_FEED:
                # A long lag: catch up alone (prefill-like, logits of the last position only).
                lag = r.seq[start:-1]
                pos = torch.arange(start, start + len(lag), device=device).unsqueeze(0)
                sync(device)
                t0 = time.perf_counter()
                self.model(torch.tensor([lag], device=device), pos, self.cache, rows=slice(r.slot, r.slot + 1),
                           last_only=True)
                sync(device)
                self.catch_up_s += time.perf_counter() - t0
                self.catch_up_tokens += len(lag)
                self.catch_ups += 1
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
            # Each row's logits at its own last real position: [len(active), V].
            at = torch.tensor([len(feeds[r.slot]) - 1 if width > 1 else 0 for r in active], device=logits.device)
            picked = logits[torch.tensor([r.slot - lo for r in active], device=logits.device), at]
            if picked.shape[-1] != self.vocab_size:
                picked = _fit_vocab(picked, self.vocab_size)
            for r in active:
                lengths[r.slot] += len(feeds[r.slot])
            self._pick(active, picked)
            for r in active:
                feeds[r.slot] = r.tokens[-1:]
            active = [r for r in active if not r.done]
        return [Proposal(r.tokens, torch.stack(r.probs) if r.probs else None) for r in rows]

    @staticmethod
    def _pick(rows: list[DraftRow], logits: torch.Tensor) -> None:
        # Exactly ModelDrafter's choice per row, so a row drafts the same tokens alone or in a batch;
        # greedy rows share one argmax (one device sync for the whole batch).
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            g = logits[greedy]
            toks = g.argmax(-1)
            conf = torch.softmax(g, -1).gather(-1, toks[:, None])[:, 0].tolist() \
                if any(rows[i].min_confidence for i in greedy) else [1.0] * len(greedy)
            for i, tok, c in zip(greedy, toks.tolist(), conf, strict=True):
                r = rows[i]
                if r.min_confidence and r.tokens and c < r.min_confidence:
                    r.done = True
                    continue
                r.tokens.append(tok)
                r.done = len(r.tokens) >= r.k
        for i, r in enumerate(rows):
            if r.params.greedy:
                continue
            q = probs_from_logits(logits[i], r.params)
            if r.min_confidence and r.tokens and float(q.max()) < r.min_confidence:
                r.done = True
                continue
            r.tokens.append(sample(q, r.generator))
            r.probs.append(q)
            r.done = len(r.tokens) >= r.k


def _fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    # As ModelDrafter's: drop padding rows of a larger table, or pad a smaller one with -inf.
    if logits.shape[-1] > size:
        return logits[..., :size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))
