"""What the engine's slots hold: each slot's KV rows (target and draft model), the prefix a finished
request left there for the next one, and the running request's drafter.

A request's row is set up when it is admitted (:meth:`Slots.start`), its prompt prefilled in chunks
(:meth:`Slots.prefill`), and the slot released when it finishes (:meth:`Slots.release`): its KV stays
as a cached prefix unless the request failed (a failed step may have left K/V that never finished).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from verispec.drafters import DrafterPool
from verispec.drafters.prediction import PredictionDrafter
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.metrics import EngineStats
from verispec.engine.prefix import SlotPrefixes, common_prefix, held_tokens
from verispec.engine.request import Request
from verispec.log import logger
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer


class Slots:
    """The per-slot state of an engine's caches; the engine decides which request holds which slot."""

    def __init__(self, target: Transformer, cache: KVCache, draft_runner: DraftRunner | None, drafters: DrafterPool,
                 stats: EngineStats, prefix_reuse: bool) -> None:
        self.target, self.cache, self.draft_runner, self.drafters = target, cache, draft_runner, drafters
        self.stats, self.prefix_reuse = stats, prefix_reuse
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
        """
        t0 = time.perf_counter()
        failed: list[tuple[Request, Exception]] = []
        device = self.target.device
        for req in requests:
            self._borrow(req, running)
            if budget <= 0:
                req.prefilled = self.cache.lengths[req.slot] == len(req.prompt) - 1
                continue
            slot, target_len = req.slot, len(req.prompt) - 1
            done = self.cache.lengths[slot]
            n = min(target_len - done, budget)
            if n > 0:
                t1 = time.perf_counter()
                pos = torch.arange(done, done + n, device=device).unsqueeze(0)
                try:
                    self.target(torch.tensor([req.prompt[done:done + n]], device=device), pos, self.cache,
                                rows=slice(slot, slot + 1), last_only=True)
                except Exception as e:  # noqa: BLE001 (this prompt's forward; its length stays where it was)
                    failed.append((req, e))
                    continue
                self.cache.lengths[slot] = done + n
                budget -= n
                req.metrics.stage_s["prefill"] += time.perf_counter() - t1
                self.stats.prefill_tokens += n
            req.prefilled = self.cache.lengths[slot] == target_len
        self.stats.prefill_s += time.perf_counter() - t0
        return failed

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
