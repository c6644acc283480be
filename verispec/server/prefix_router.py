"""Which replica serves a request: the longest cached prompt prefix, else the same user, else the least loaded.

A prompt is cut into blocks of ``block_size`` token ids and each full block gets a chained hash (the
hash of the previous block's hash and this block's ids), as the vLLM and SGLang routers do: block i's
hash names the whole prefix up to block i, so "replica r holds block i's hash" means r has seen that
entire prefix, and the longest cached prefix is the last of the prompt's hashes found in r's table.

A replica's table is what it last reported its cache rows hold (:meth:`PrefixRouter.report`, which
replaces the table: rows evicted since are forgotten) plus what the router sent it since
(:meth:`PrefixRouter.sent`, so a follow-up that arrives before the next report still finds its
prefix). Python hashes tuples of ints the same way in every process (no hash randomization for
them), so a replica can hash its own token ids and the router's tables agree.

Affinity never overrides load without bound: a replica is chosen for its prefix or its user only while
its load (running + waiting requests) is at most ``max_imbalance`` above the least loaded replica's.
Everything here is plain Python, called from the ingress's event loop only (no locks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from verispec.errors import VerispecError

Reason = Literal["prefix", "user", "load", "pinned"]  # "pinned": the request named its replica
REASONS: tuple[Reason, ...] = ("prefix", "user", "load")


def block_hashes(ids: Sequence[int], block_size: int = 16) -> list[int]:
    """The chained hashes of ``ids``' full blocks of ``block_size`` tokens (a trailing partial block has none)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, tuple(ids[start:start + block_size])))
        out.append(h)
    return out


@dataclass(frozen=True)
class RouterConfig:
    """How the prefix router decides.

    ``block_size`` tokens make a hashed block; a prefix counts once it matches ``min_match_blocks``
    blocks. ``max_imbalance`` bounds how much busier than the least loaded replica an affine one may
    be. ``max_sent_blocks`` caps the hashes remembered per replica from routing (least recently sent
    forgotten first) and ``max_users`` the users remembered.
    """

    block_size: int = 16
    min_match_blocks: int = 1
    max_imbalance: int = 4
    max_sent_blocks: int = 200_000
    max_users: int = 100_000

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise VerispecError(f"block_size must be at least 1 (got {self.block_size!r})")
        if self.min_match_blocks < 1:
            raise VerispecError(f"min_match_blocks must be at least 1 (got {self.min_match_blocks!r})")
        if self.max_imbalance < 0:
            raise VerispecError(f"max_imbalance must be >= 0 (got {self.max_imbalance!r})")
        if self.max_sent_blocks < 1 or self.max_users < 1:
            raise VerispecError("max_sent_blocks and max_users must be at least 1")


@dataclass(frozen=True)
class Choice:
    """A routing decision: the replica, why it was picked, and how many prompt blocks it holds."""

    replica: int
    reason: Reason
    matched_blocks: int = 0


@dataclass
class _Replica:
    healthy: bool = False  # reported ready; routed to only then
    reported_load: int = 0  # running + waiting at its last report
    in_flight: int = 0  # requests the router sent and has not seen finish
    reported: frozenset[int] = frozenset()  # block hashes its cache rows held at its last report
    sent: OrderedDict[int, None] = field(default_factory=OrderedDict)  # hashes sent since, LRU

    @property
    def load(self) -> int:
        return max(self.reported_load, self.in_flight)

    def holds(self, h: int) -> bool:
        return h in self.reported or h in self.sent


class PrefixRouter:
    """Routing state for ``n`` replicas (indices ``0..n-1``); see the module's docstring for the rule."""

    def __init__(self, n: int, config: RouterConfig | None = None) -> None:
        if n < 1:
            raise VerispecError(f"a router needs at least one replica (got {n})")
        self.config = config or RouterConfig()
        self._replicas = [_Replica() for _ in range(n)]
        self._users: OrderedDict[str, int] = OrderedDict()

    @property
    def size(self) -> int:
        return len(self._replicas)

    def healthy(self) -> list[int]:
        """The replicas requests may go to."""
        return [i for i, r in enumerate(self._replicas) if r.healthy]

    def load(self, replica: int) -> int:
        return self._replicas[replica].load

    def hashes(self, ids: Sequence[int]) -> list[int]:
        return block_hashes(ids, self.config.block_size)

    def matched(self, replica: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with ``hashes`` ``replica`` holds."""
        r = self._replicas[replica]
        for i in range(len(hashes) - 1, -1, -1):  # chained: the last block held names the whole prefix
            if r.holds(hashes[i]):
                return i + 1
        return 0

    def choose(self, hashes: Sequence[int], user: str | None = None, exclude: Iterable[int] = ()) -> Choice | None:
        """The replica for a prompt with block ``hashes`` from ``user``; None when no healthy replica is left."""
        skip = set(exclude)
        candidates = [i for i in self.healthy() if i not in skip]
        if not candidates:
            return None
        floor = min(self._replicas[i].load for i in candidates) + self.config.max_imbalance
        fair = [i for i in candidates if self._replicas[i].load <= floor]
        best, best_blocks = -1, 0
        for i in fair:
            n = self.matched(i, hashes)
            if n > best_blocks or (n == best_blocks and n and self._replicas[i].load < self._replicas[best].load):
                best, best_blocks = i, n
        if best_blocks >= self.config.min_match_blocks:
            return Choice(best, "prefix", best_blocks)
        if user is not None and (last := self._users.get(user)) is not None and last in fair:
            return Choice(last, "user")
        return Choice(min(candidates, key=lambda i: (self._replicas[i].load, i)), "load")

    def sent(self, replica: int, hashes: Sequence[int], user: str | None = None) -> None:
        """``replica`` takes a request: count it in flight, remember its blocks and its user."""
        r = self._replicas[replica]
        r.in_flight += 1
        for h in hashes:
            r.sent[h] = None
            r.sent.move_to_end(h)
        while len(r.sent) > self.config.max_sent_blocks:
            r.sent.popitem(last=False)
        if user is not None:
            self._users[user] = replica
            self._users.move_to_end(user)
            while len(self._users) > self.config.max_users:
                self._users.popitem(last=False)

    def finished(self, replica: int) -> None:
        """A request sent to ``replica`` ended (however it ended)."""
        r = self._replicas[replica]
        r.in_flight = max(0, r.in_flight - 1)

    def report(self, replica: int, load: int, held: Iterable[int], healthy: bool = True) -> None:
        """What ``replica`` says of itself: its load, the block hashes its cache rows hold, and whether it is ready.

        The reported blocks replace the earlier report's; the blocks sent since stay (the replica may
        not have admitted those requests yet).
        """
        r = self._replicas[replica]
        r.reported_load, r.reported, r.healthy = load, frozenset(held), healthy

    def mark_down(self, replica: int) -> None:
        """``replica`` failed: route nothing to it, and forget its cache (a replacement starts empty)."""
        r = self._replicas[replica]
        r.healthy, r.reported, r.reported_load = False, frozenset(), 0
        r.sent.clear()
        for user in [u for u, i in self._users.items() if i == replica]:
            del self._users[user]
