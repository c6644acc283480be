"""Which replica serves a request: the longest cached prompt prefix, else the same user, else the least loaded.

A prompt is matched as its text as the model reads it (the chat template rendered, a BOS token's text
in front where the tokenizer adds one), cut into blocks of ``block_chars`` characters; each full block
gets a chained hash (of the previous block's hash and this block), as the vLLM and SGLang routers do
with their blocks: block i's hash names the whole prefix up to block i, so "replica r holds block i's
hash" means r has seen that entire prefix, and the longest cached prefix is the last of the prompt's
hashes found in r's table. Text, not token ids, because tokenizing a prompt of a few thousand tokens
at the router costs several milliseconds (docs/replicas.md), more than the router's whole budget;
rendering the template and hashing text costs a fraction of one. A replica decodes the token ids its
cache rows hold back to text (lossless for byte-level tokenizers) and hashes them the same way; the
hash is BLAKE2b, the same in every process (Python's own string hash is salted per process).

A replica's table is what it last reported its cache rows hold (:meth:`PrefixRouter.report`, which
replaces the table: rows evicted since are forgotten) plus what the router sent it after that report
was asked for (:meth:`PrefixRouter.sent`, so a follow-up that arrives before the next report still
finds its prefix; what was sent earlier is in the report if the replica still holds it).

Affinity never overrides load without bound: a replica is chosen for its prefix or its user only while
its load (running + waiting requests) is at most ``max_imbalance`` above the least loaded replica's.
Everything here is plain Python, called from the ingress's event loop only (no locks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Literal

from verispec.errors import VerispecError

Reason = Literal["prefix", "user", "load", "pinned"]  # "pinned": the request named its replica
REASONS: tuple[Reason, ...] = ("prefix", "user", "load")


def block_hashes(text: str, block_chars: int = 64) -> list[int]:
    """The chained hashes of ``text``'s full blocks of ``block_chars`` characters (a partial last block has none)."""
    out: list[int] = []
    h = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = blake2b(h + text[start:start + block_chars].encode("utf-8", "surrogatepass"), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


@dataclass(frozen=True)
class RouterConfig:
    """How the prefix router decides.

    ``block_chars`` characters make a hashed block (64: about 16 tokens of English or code); a
    prefix counts once it matches ``min_match_blocks`` blocks. ``max_imbalance`` bounds how much
    busier than the least loaded replica an affine one may be. ``max_sent_blocks`` caps the hashes
    remembered per replica from routing (least recently sent forgotten first) and ``max_users`` the
    users remembered.
    """

    block_chars: int = 64
    min_match_blocks: int = 1
    max_imbalance: int = 4
    max_sent_blocks: int = 200_000
    max_users: int = 100_000

    def __post_init__(self) -> None:
        if self.block_chars < 1:
            raise VerispecError(f"block_chars must be at least 1 (got {self.block_chars!r})")
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
    sent: OrderedDict[int, int] = field(default_factory=OrderedDict)  # hash -> when last sent (oldest first)

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
        self._clock = 0  # requests sent so far: orders the sent records against reports

    @property
    def size(self) -> int:
        return len(self._replicas)

    def healthy(self) -> list[int]:
        """The replicas requests may go to."""
        return [i for i, r in enumerate(self._replicas) if r.healthy]

    def load(self, replica: int) -> int:
        return self._replicas[replica].load

    def hashes(self, text: str) -> list[int]:
        """The block hashes of a prompt's text."""
        return block_hashes(text, self.config.block_chars)

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
        self._clock += 1
        for h in hashes:
            r.sent[h] = self._clock
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

    @property
    def clock(self) -> int:
        """The router's count of requests sent: take it before asking a replica for its report."""
        return self._clock

    def report(self, replica: int, load: int, held: Iterable[int], healthy: bool = True, since: int = 0) -> None:
        """What ``replica`` says of itself: its load, the block hashes its cache rows hold, and whether it is ready.

        The reported blocks replace the earlier report's. Blocks sent at or before :attr:`clock` was
        ``since`` (when the report was asked for) are dropped from the sent record: the report holds
        them if the replica still does. Later ones stay (the replica had not seen those requests).
        """
        r = self._replicas[replica]
        r.reported_load, r.reported, r.healthy = load, frozenset(held), healthy
        while r.sent and next(iter(r.sent.values())) <= since:
            r.sent.popitem(last=False)

    def mark_down(self, replica: int) -> None:
        """``replica`` failed: route nothing to it, and forget its cache (a replacement starts empty)."""
        r = self._replicas[replica]
        r.healthy, r.reported, r.reported_load = False, frozenset(), 0
        r.sent.clear()
        for user in [u for u, i in self._users.items() if i == replica]:
            del self._users[user]
