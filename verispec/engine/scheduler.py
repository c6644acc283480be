"""Admission control for continuous batching: a FIFO waiting queue, batch slots and a KV token budget.

Pure bookkeeping, no tensors. A request needs a slot (a row of the static KV caches) and reserves
``prompt + max_tokens`` tokens of the budget for its whole life, so an admitted request can never
run out of cache mid-generation and nothing ever needs preempting. Admission is strictly FIFO: if
the request at the head of the queue does not fit yet, later (smaller) ones wait behind it, so a
long request cannot be starved by a stream of short ones.

A free slot may still hold an earlier request's KV (prefix reuse, :mod:`verispec.engine.prefix`):
it is free all the same, and those cached tokens reserve no budget. Which free slot an admitted
request gets is the ``choose`` callback's decision (default: the lowest).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from verispec.errors import VerispecError

T = TypeVar("T")


@dataclass
class Admission(Generic[T]):
    """A request the scheduler let in, and the slot it got."""

    item: T
    slot: int


class Scheduler(Generic[T]):
    """Slots ``0..slots-1`` and ``budget`` KV tokens shared by running requests.

    ``max_len`` is the longest sequence one slot holds. ``choose(item, free)`` picks the slot an
    admitted item gets among the free ones (ascending); by default the lowest, which keeps running
    rows packed at the start of the cache (the batched forward covers the span from the lowest to
    the highest running slot).
    """

    def __init__(self, slots: int, budget: int, max_len: int,
                 choose: Callable[[T, list[int]], int] | None = None) -> None:
        if slots < 1:
            raise VerispecError("a batch needs at least one slot")
        self.slots, self.budget, self.max_len = slots, budget, max_len
        self.choose = choose
        self.waiting: deque[tuple[T, int]] = deque()
        self.running: dict[int, tuple[T, int]] = {}  # slot -> (item, reserved tokens)
        self._free = list(range(slots))

    @property
    def used_tokens(self) -> int:
        """Tokens reserved by running requests."""
        return sum(tokens for _, tokens in self.running.values())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check(self, tokens: int) -> None:
        """Raise a :class:`VerispecError` if a request of ``tokens`` could never be admitted."""
        limit = min(self.max_len, self.budget)
        if tokens > limit:
            what = "context" if self.max_len <= self.budget else "KV budget"
            raise VerispecError(f"the request needs {tokens} tokens (prompt + max_tokens) but the {what} holds "
                                f"{limit}; shorten the prompt or lower max_tokens")

    def submit(self, item: T, tokens: int) -> None:
        """Queue ``item``, which will reserve ``tokens`` KV tokens while it runs."""
        self.check(tokens)
        self.waiting.append((item, tokens))

    def admit(self) -> list[Admission[T]]:
        """Move queue heads into free slots while slots and budget allow (FIFO, no overtaking)."""
        admitted: list[Admission[T]] = []
        used = self.used_tokens
        while self.waiting and self._free and used + self.waiting[0][1] <= self.budget:
            item, tokens = self.waiting.popleft()
            slot = self._free[0] if self.choose is None else self.choose(item, list(self._free))
            self._free.remove(slot)
            self.running[slot] = (item, tokens)
            used += tokens
            admitted.append(Admission(item, slot))
        return admitted

    def release(self, slot: int) -> None:
        """The request in ``slot`` is done (finished or cancelled); its slot and tokens are free at once."""
        del self.running[slot]
        self._free.append(slot)
        self._free.sort()

    def remove_waiting(self, item: T) -> bool:
        """Drop ``item`` from the queue; False if it was not waiting."""
        for i, (queued, _) in enumerate(self.waiting):
            if queued is item:
                del self.waiting[i]
                return True
        return False
