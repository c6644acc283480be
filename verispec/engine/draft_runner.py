"""The draft model's runner: one KV cache row per engine slot, every drafting row in lockstep forwards.

All rows draft together: iteration j feeds every still-drafting row its latest token in one
forward, so drafting k tokens for B rows costs k forwards, not B * k; one row is the B = 1 case.

Rows catch up on what their draft cache has not seen yet (the target's bonus token, the last
accepted draft) in the first iteration. Catch-ups differ per row, so that iteration is right-padded
to the longest one and each row's logits are read at its own last real position; a row lagging by
more than a few tokens (it ran plain steps for a while) first catches up alone, so it never makes
every other row pad. Slots in the forward's row span that are not drafting get dummy tokens at
positions from their own cache length on: attention masks by position, so such entries are never
read before they are overwritten (the same argument as the cache's O(1) rollback).

Rows begun with a reduced draft vocabulary (``begin(slot, prompt, draft_vocab)``, see
:mod:`verispec.drafters.vocab`) share one reduced head per forward when all drafting rows use the
same ``draft_vocab``: the first ``draft_vocab`` ids plus the special tokens plus the union of the
rows' prompt ids. Each row's logits are then cut to its own subset (prefix, specials, its own
prompt's ids), so a row drafts what it would draft alone. A forward mixing such rows with
full-vocabulary rows (or other sizes) runs the full head and cuts the reduced rows' logits the same
way: still each row's own subset, just no saving.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from verispec.drafters.base import DraftingRow, Proposal
from verispec.drafters.vocab import DraftVocab, SubsetHead, check_draft_vocab
from verispec.drafters.window import DraftWindow
from verispec.engine.metrics import sync
from verispec.engine.prefix import SlotPrefixes, held_tokens
from verispec.models.llama import Transformer, span_forward
from verispec.sampling import probs_from_logits, sample

# A row whose catch-up exceeds this many tokens catches up alone before the lockstep.
MAX_LOCKSTEP_FEED = 3


@dataclass(eq=False)
class _Draft:
    """One row's draft while the runner makes it."""

    row: DraftingRow
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    slot = property(lambda self: self.row.slot)
    seq = property(lambda self: self.row.seq)
    k = property(lambda self: self.row.k)
    params = property(lambda self: self.row.params)
    min_confidence = property(lambda self: self.row.min_confidence)


class DraftRunner:
    """Drafts for the engine's rows with one model and one ``slots``-row KV cache.

    ``full_span``: every forward covers all slots (a compiled model's static shapes), not only the
    span of the drafting rows.
    """

    def __init__(self, model: Transformer, slots: int, cache_len: int, vocab_size: int | None = None,
                 special_ids: Iterable[int] = (), full_span: bool = False, prefix_reuse: bool = True) -> None:
        self.model = model
        self.full_span, self.prefix_reuse = full_span, prefix_reuse
        self.cache = model.new_cache(slots, cache_len)
        # Draft and target embeddings may differ in padding rows; q must live on the target's vocabulary.
        self.vocab_size = vocab_size or model.args.vocab_size
        self.forwards = 0  # lockstep forwards run (the policy's draft cost is per forward)
        self.catch_ups = 0  # rows that caught up alone, the context they read and the seconds it took
        self.catch_up_tokens = 0
        self.catch_up_s = 0.0
        # Per slot: (the request's generator, a generator of our own on the draft's device).
        self._local_gens: dict[int, tuple[torch.Generator, torch.Generator]] = {}
        # Reduced draft vocabularies: ids every reduced head scores, the builders per size, and per slot
        # (size, the row's extra ids as a tensor); _epoch tells a slot's successive requests apart.
        self.special_ids = frozenset(special_ids)
        self._vocabs: dict[int, DraftVocab] = {}
        self._row_vocab: dict[int, tuple[int, torch.Tensor]] = {}
        self._epoch: dict[int, int] = {}
        self._head_key: tuple | None = None
        self._head: SubsetHead | None = None
        self.reduced_forwards = 0  # lockstep forwards that ran a reduced head
        self._windows: dict[int, DraftWindow] = {}  # per slot: the part of its sequence the draft reads
        self.prefixes = SlotPrefixes()  # per free slot: the draft tokens its row holds
        self.reused_tokens = 0  # prompt tokens rows held from their slot's previous sequence at begin

    def begin(self, slot: int, prompt: list[int] | None = None, draft_vocab: int | None = None,
              window: int | None = None) -> int:
        """A new sequence takes ``slot``; ``draft_vocab`` drafts it with a reduced head (its prompt's ids
        included), ``window`` reads only the ends of a long prompt (:mod:`verispec.drafters.window`).

        Returns how many of the tokens the draft reads of ``prompt`` its row already holds from the
        slot's previous draft sequence (see :meth:`release`); the first draft catches up on the rest.
        """
        self._local_gens.pop(slot, None)
        reads = self._windows[slot] = DraftWindow.for_prompt(len(prompt or ()), window)
        # What the row holds is the K/V of the tokens the previous sequence's draft read, at positions
        # 0, 1, ...: valid for any later sequence whose own read starts with them (window or not; the
        # head, full or reduced, only maps the last hidden state to logits and leaves K/V alone).
        self.cache.lengths[slot] = self.prefixes.claim(slot, reads.view(list(prompt or ())))
        self.reused_tokens += self.cache.lengths[slot]
        self._epoch[slot] = self._epoch.get(slot, 0) + 1
        check_draft_vocab(draft_vocab)
        if draft_vocab is None or draft_vocab >= self.model.args.vocab_size:
            self._row_vocab.pop(slot, None)
            return self.cache.lengths[slot]
        vocab = self._vocabs.get(draft_vocab)
        if vocab is None:
            vocab = self._vocabs[draft_vocab] = DraftVocab(self.model, draft_vocab, self.special_ids)
        extra = torch.tensor(vocab.extra_ids(prompt or ()), dtype=torch.long, device=self.model.device)
        self._row_vocab[slot] = (draft_vocab, extra)
        return self.cache.lengths[slot]

    def release(self, slot: int, seq: list[int] | None = None) -> None:
        """The sequence in ``slot`` is done; its row keeps the K/V of what its draft read of ``seq``
        (its final sequence) for the slot's next draft sequence. ``seq`` None (or no prefix reuse) keeps nothing."""
        if seq is None or not self.prefix_reuse:
            self.prefixes.forget(slot)
            self.cache.reset(slot)
        else:
            held = held_tokens(self._window(slot).view(seq), self.cache.lengths[slot])
            self.prefixes.record(slot, held)
            self.cache.lengths[slot] = len(held)
        self._local_gens.pop(slot, None)
        self._row_vocab.pop(slot, None)
        self._windows.pop(slot, None)

    def _head_for(self, rows: list[_Draft]) -> tuple[SubsetHead | None, dict[int, tuple[int, torch.Tensor]]]:
        """The head for a forward drafting ``rows`` and the slots whose logits must be cut to their own subset."""
        vocabs = [self._row_vocab.get(r.slot) for r in rows]
        reduced = {r.slot: v for r, v in zip(rows, vocabs, strict=True) if v is not None}
        if not reduced:
            return None, {}
        sizes = {n for n, _ in reduced.values()}
        if len(reduced) < len(rows) or len(sizes) > 1:
            return None, reduced  # mixed: the full head, each reduced row cut to its subset
        key = (next(iter(sizes)), tuple((r.slot, self._epoch.get(r.slot, 0)) for r in rows))
        if key != self._head_key:  # the same requests as last step reuse the head
            union = sorted(set().union(*(extra.tolist() for _, extra in reduced.values())))
            self._head_key, self._head = key, self._vocabs[key[0]].head_for(union)
        assert self._head is not None
        n_union = int(self._head.extra_ids.numel())
        return self._head, {slot: v for slot, v in reduced.items() if int(v[1].numel()) < n_union}

    def _generator(self, slot: int, generator: torch.Generator | None) -> torch.Generator | None:
        # A request's generator lives on the target's device; drafting elsewhere samples from one of
        # our own on the draft's device, seeded once per request from the request's.
        device = self.model.device
        if generator is None or generator.device == device:
            return generator
        own = self._local_gens.get(slot)
        if own is None or own[0] is not generator:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            own = self._local_gens[slot] = (generator, torch.Generator(device=device).manual_seed(seed))
        return own[1]

    def commit(self, slot: int, n_valid: int) -> None:
        """The first ``n_valid`` tokens of ``slot``'s sequence are final."""
        self.cache.lengths[slot] = min(self.cache.lengths[slot], self._window(slot).draft_len(n_valid))

    def _window(self, slot: int) -> DraftWindow:
        return self._windows.get(slot) or DraftWindow()

    @torch.inference_mode()
    def propose(self, requests: list[DraftingRow]) -> list[Proposal]:
        """Draft up to ``row.k`` tokens for every row; one proposal per row, in order."""
        device, lengths = self.model.device, self.cache.lengths
        rows = [_Draft(r, r.generator if r.params.greedy else self._generator(r.slot, r.generator)) for r in requests]
        feeds: dict[int, list[int]] = {}
        head, cut = self._head_for([r for r in rows if r.k > 0])
        # Only name the head when there is one: a compiled forward (engine.compiled) takes no head argument.
        head_arg = {} if head is None else {"head": head}
        for r in rows:
            if r.k <= 0:
                continue
            seq = self._window(r.slot).view(r.seq)
            start = min(lengths[r.slot], len(seq) - 1)
            lengths[r.slot] = start
            if len(seq) - start > MAX_LOCKSTEP_FEED:
                # A long lag: catch up alone (prefill-like, logits of the last position only).
                lag = seq[start:-1]
                pos = torch.arange(start, start + len(lag), device=device).unsqueeze(0)
                sync(device)
                t0 = time.perf_counter()
                self.model(torch.tensor([lag], device=device), pos, self.cache, rows=slice(r.slot, r.slot + 1),
                           last_only=True, **head_arg)
                sync(device)
                self.catch_up_s += time.perf_counter() - t0
                self.catch_up_tokens += len(lag)
                self.catch_ups += 1
                start = lengths[r.slot] = len(seq) - 1
            feeds[r.slot] = seq[start:]
        active = [r for r in rows if r.k > 0]
        while active:
            width = max(len(feeds[r.slot]) for r in active)
            # Keys up to the drafting rows' last position: an idle slot's dummies may sit further out;
            # they are written all the same, and what their queries attend to is never read.
            kv_len = max(lengths[r.slot] for r in active) + width
            logits, lo = span_forward(self.model, self.cache, {r.slot: feeds[r.slot] for r in active},
                                      {r.slot: lengths[r.slot] for r in active}, kv_len, self.full_span,
                                      last_only=width == 1, **head_arg)
            self.forwards += 1
            self.reduced_forwards += int(head is not None)
            # Each row's logits at its own last real position: [len(active), V].
            at = torch.tensor([len(feeds[r.slot]) - 1 if width > 1 else 0 for r in active], device=logits.device)
            picked = logits[torch.tensor([r.slot - lo for r in active], device=logits.device), at]
            for i, r in enumerate(active):
                if r.slot in cut:
                    _restrict(picked[i], *cut[r.slot])
            if picked.shape[-1] != self.vocab_size:
                picked = _fit_vocab(picked, self.vocab_size)
            for r in active:
                lengths[r.slot] += len(feeds[r.slot])
            picking = _processed(active, picked)
            self._pick([active[i] for i in picking], picked[picking])
            for r in active:
                feeds[r.slot] = r.tokens[-1:]
            active = [r for r in active if not r.done]
        return [Proposal(r.tokens, torch.stack(r.probs) if r.probs else None) for r in rows]

    @staticmethod
    def _pick(rows: list[_Draft], logits: torch.Tensor) -> None:
        # Each row's choice depends on its own logits only, so a row drafts the same tokens alone or in
        # a batch; greedy rows share one argmax (one device sync for the whole batch).
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


def _processed(rows: list[_Draft], logits: torch.Tensor) -> list[int]:
    """Process (in place) the draft logits of rows whose target logits are processed, as the target's
    are at the same position; the rows that can draft on (a row its grammar allows nothing is done)."""
    picking = []
    for i, r in enumerate(rows):
        proc = r.row.processor
        if proc is not None:
            logits[i] = proc.apply(logits[i : i + 1], r.seq, [r.tokens])[0]
            if not bool(torch.isfinite(logits[i]).any()):
                r.done = True
                continue
        picking.append(i)
    return picking


def _restrict(logits: torch.Tensor, n: int, extra: torch.Tensor) -> None:
    """Cut one row's logits (in place) to its own subset: the first ``n`` ids and ``extra``."""
    keep = logits[extra].clone()
    logits[n:] = float("-inf")
    logits[extra] = keep


def _fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    # Draft and target embeddings may differ in padding rows: drop a larger table's, pad a smaller one with -inf.
    if logits.shape[-1] > size:
        return logits[..., :size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))
