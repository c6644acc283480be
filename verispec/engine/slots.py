"""What the engine's slots hold: each slot's KV rows (target and draft model), the prefix a finished
request left there for the next one, and the running request's drafter.

A request's row is set up when it is admitted (:meth:`Slots.start`), its prompt prefilled in chunks
(:meth:`Slots.prefill`), and the slot released when it finishes (:meth:`Slots.release`): its KV stays
as a cached prefix unless the request failed (a failed step may have left K/V that never finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from verispec.drafters import DrafterPool
from verispec.drafters.prediction import PredictionDrafter
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.metrics import EngineStats
from verispec.engine.prefix import MIN_MATCH, SlotPrefixes, common_prefix, held_tokens
from verispec.engine.request import Request
from verispec.log import logger
from verispec.models import linear
from verispec.models.kv_cache import KVCache
from verispec.models.llama import SMALL_M, Transformer, span_forward


@dataclass(frozen=True)
class Chunk:
    """The part of a request's prompt one prefill forward writes: ``n`` tokens from position ``start``."""

    req: Request
    start: int
    n: int

    @property
    def tokens(self) -> list[int]:
        return self.req.prompt[self.start:self.start + self.n]


def forward_path(n: int) -> int:
    """Which forward path a chunk of ``n`` tokens per row takes: the fused small-M path, the prefill path on
    the matmul kernels, or the prefill path at or above the large-M threshold (dequantized weights, save
    layers that :func:`verispec.models.linear.large_m` keeps on their kernels). A row's numbers depend on
    its path, so only chunks on one path share a forward: padded to the widest, each row still takes the
    path it takes alone."""
    return 0 if n <= SMALL_M else 1 if n < linear.PREFILL_M else 2


# Padded tokens at most in one shared forward below the large-M threshold, on the matmul kernels: their
# time per token grows with the rows they multiply. 4 prompts of n tokens each, one forward against one per
# prompt (int4 1.5B, 8-bit activations, 2-core Zen 4): 1.26x at n = 16, 1.08x at 40, 1.04x at 100, 0.97x
# at 200, 0.93x at 300. At or above it the bound is left to the step's prefill budget (``prefill_chunk``,
# 512 tokens by default), since there the dequantize + GEMM path shares its expansion of the weights.
SHARED_TOKENS = 512


def prefill_batches(chunks: list[Chunk], max_len: int, batch: bool = True) -> list[list[Chunk]]:
    """``chunks`` grouped into forwards: runs of adjacent slots (a forward spans a contiguous run of cache
    rows) on one :func:`forward_path`, each row's padding inside its cache, at most :data:`SHARED_TOKENS`
    padded tokens on the kernels; every chunk alone without ``batch``."""
    groups: list[list[Chunk]] = []
    for c in sorted(chunks, key=lambda c: c.req.slot):
        last = groups[-1] if groups and batch else None
        if last is not None and c.req.slot == last[-1].req.slot + 1 and forward_path(c.n) == forward_path(last[0].n):
            joined = [*last, c]
            width = max(x.n for x in joined)
            if ((forward_path(c.n) == 2 or len(joined) * width <= SHARED_TOKENS)
                    and all(x.start + width <= max_len for x in joined)):
                last.append(c)
                continue
        groups.append([c])
    return groups


class Slots:
    """The per-slot state of an engine's caches; the engine decides which request holds which slot."""

    def __init__(self, target: Transformer, cache: KVCache, draft_runner: DraftRunner | None, drafters: DrafterPool,
                 stats: EngineStats, prefix_reuse: bool, batch_prefill: bool = True) -> None:
        self.target, self.cache, self.draft_runner, self.drafters = target, cache, draft_runner, drafters
        self.stats, self.prefix_reuse, self.batch_prefill = stats, prefix_reuse, batch_prefill
        self.prefixes = SlotPrefixes()  # per free slot: the tokens its target row holds

    def choose(self, req: Request, free: list[int]) -> int:
        """The scheduler's pick among the free slots: where the request's prompt is cached longest."""
        return self.prefixes.choose(req.prompt, free)

    def start(self, req: Request, slot: int) -> None:
        """Set ``req``'s row up in ``slot``: what the slot holds of its prompt, its generator and drafters."""
        req.handle.admitted_at = time.perf_counter()
        # The row keeps what the slot's previous request left that this prompt starts with; prefill
        # goes on from there. Without a record (reuse off, a fresh slot) that is nothing.
        reused = self.cache.lengths[slot] = self.prefixes.claim(slot, req.prompt)
        req.metrics.prefix_reused_tokens = reused
        self.stats.prefix_hits += int(reused > 0)
        self.stats.prefix_reused_tokens += reused
        spec = req.spec
        # On the target's device: verification samples there (the draft runner keeps its own if elsewhere).
        req.generator = None if req.params.greedy else req.params.generator(self.target.device)
        if spec.enabled:
            req.drafter = req.own_drafter or self.drafters.acquire(spec)
            req.min_confidence = spec.min_confidence
        if req.prediction is not None:  # the prediction drafts where it matches, the method's drafter elsewhere
            req.predictor = req.drafter = PredictionDrafter(req.prediction, req.drafter, spec.k)
        if req.drafter is not None:
            before = self.draft_runner.reused_tokens if self.draft_runner is not None else 0
            req.drafter.use_row(slot)
            req.drafter.begin(req.prompt)
            if self.draft_runner is not None:  # what a draft model's row kept of the slot's previous prompt
                self.stats.prefix_draft_reused_tokens += self.draft_runner.reused_tokens - before
        req.slot = slot

    def prefill(self, requests: list[Request], budget: int, running: list[Request] = ()) -> list[tuple[Request,
                                                                                                         Exception]]:
        """Prefill up to ``budget`` prompt tokens of ``requests``, in order; the requests whose forward raised.

        A row holds all but its prompt's last token when prefilled: the first step scores that one
        with the first drafts. A row first copies what another of the ``running`` rows already holds of
        its prompt (``n`` choices of one request, prompts sharing a system prompt): copies cost no budget.
        Each row's chunk is what the budget leaves it; chunks of adjacent rows that take the same forward
        path share one forward (:func:`prefill_batches`). A prompt that shares at least
        :data:`~verispec.engine.prefix.MIN_MATCH` tokens with one ahead of it waits for that one's
        forward and copies them instead.
        """
        t0 = time.perf_counter()
        chunks: list[Chunk] = []
        failed: list[tuple[Request, Exception]] = []
        for req in requests:
            held = self.cache.lengths[req.slot]
            if any(common_prefix(req.prompt, c.req.prompt) - held >= MIN_MATCH for c in chunks):
                failed += self._run(chunks)  # this prompt then copies what they wrote instead of computing it
                chunks = []
            self._borrow(req, running)
            done = self.cache.lengths[req.slot]
            n = min(len(req.prompt) - 1 - done, budget)
            if n > 0:
                chunks.append(Chunk(req, done, n))
                budget -= n
        failed += self._run(chunks)
        for req in requests:
            req.prefilled = self.cache.lengths[req.slot] == len(req.prompt) - 1
        self.stats.prefill_s += time.perf_counter() - t0
        return failed

    def _run(self, chunks: list[Chunk]) -> list[tuple[Request, Exception]]:
        return [f for group in prefill_batches(chunks, self.cache.max_len, self.batch_prefill)
                for f in self._forward(group)]

    def _forward(self, group: list[Chunk]) -> list[tuple[Request, Exception]]:
        """One forward over ``group``'s chunks; where it raises, each chunk alone, so a fault is its own row's."""
        t1 = time.perf_counter()
        width = max(c.n for c in group)
        try:
            span_forward(self.target, self.cache, {c.req.slot: c.tokens for c in group},
                         {c.req.slot: c.start for c in group}, max(c.start for c in group) + width, last_only=True)
        except Exception as e:  # noqa: BLE001 (these prompts' forward; their lengths stay where they were)
            if len(group) > 1:
                return [f for c in group for f in self._forward([c])]
            return [(group[0].req, e)]
        share = (time.perf_counter() - t1) / sum(c.n for c in group)
        for c in group:
            self.cache.lengths[c.req.slot] = c.start + c.n
            c.req.metrics.stage_s["prefill"] += share * c.n
            self.stats.prefill_tokens += c.n
        return []

    def _borrow(self, req: Request, running: list[Request]) -> None:
        """Copy into ``req``'s row the longest run of its prompt past what it holds that another row holds."""
        slot, want = req.slot, len(req.prompt) - 1
        best, source = self.cache.lengths[slot], None
        for other in running:
            have = min(self.cache.lengths[other.slot], want) if other is not req and other.slot is not None else 0
            if have > best and (n := common_prefix(req.prompt[:have], other.seq[:have])) > best:
                best, source = n, other.slot
        if source is not None:
            shared = best - self.cache.lengths[slot]
            self.cache.copy(source, slot, self.cache.lengths[slot], best)
            req.metrics.prefix_reused_tokens += shared
            self.stats.prefix_reused_tokens += shared

    def release(self, req: Request, error: BaseException | None) -> None:
        """Free ``req``'s slot, keeping its KV as a cached prefix unless it failed, and pool its drafter."""
        slot = req.slot
        if self.prefix_reuse and error is None:
            held = held_tokens(req.seq, self.cache.lengths[slot])
            self.prefixes.record(slot, held)
            self.cache.lengths[slot] = len(held)
        else:
            self.prefixes.forget(slot)
            self.cache.reset(slot)
        # A drafter goes back to the pool unless it was the caller's own, or its request (or its end hook)
        # failed: it may be what failed. Its end hook releases a draft model's row (keeping its prefix).
        drafter: Any = req.drafter
        if drafter is not None and error is None:
            try:
                drafter.end(req.seq)
            except Exception:  # noqa: BLE001 (the answer is complete; only this drafter is suspect)
                logger.warning("drafter %s failed to end request %d", drafter.name, req.handle.id, exc_info=True)
                drafter = None
        if self.draft_runner is not None and (error is not None or (req.drafter is not None and drafter is None)):
            self.draft_runner.release(slot)  # the draft row keeps nothing of a failed request
        if req.predictor is not None:  # a prediction's drafter is its request's alone
            drafter = req.predictor.inner if drafter is not None else None
        if drafter is not None and req.own_drafter is None and error is None:
            self.drafters.release(req.spec, drafter)

    def clear(self, slot: int) -> None:
        """Forget what ``slot`` holds: no cached prefix, empty KV rows."""
        self.prefixes.forget(slot)
        self.cache.reset(slot)
        if self.draft_runner is not None:
            self.draft_runner.release(slot)
