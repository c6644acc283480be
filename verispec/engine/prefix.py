"""Prefix reuse: a finished request's KV stays in its cache row, and a later request that starts with
the same tokens skips prefilling them (llama-server's ``cache_prompt``, vLLM's automatic prefix
caching, here per cache row).

Why it is sound: a forward writes K/V only at the positions it is given, and every writer (prefill,
a step's scored and padded positions, the dummies of rows a batched forward covers but does not
step) writes at or past the row's length; attention masks by position. So positions
``[0, length)`` of a row keep the K/V of the tokens that were fed there until the length is lowered,
whatever runs in that row past it, and K/V at position p depend only on the tokens at positions
``0..p``. A new request whose first p tokens equal a row's first p held tokens can start from
length p; what the row holds beyond p is stale and never read, exactly like rejected drafts.

The target's row of a sequence holds ``seq[:-1]`` while it runs (the last token is the next step's
input), so a request reuses at most ``len(prompt) - 1`` positions and its first step scores the last
prompt token as always. :func:`common_prefix` is the one longest-common-prefix rule, used by the
engine's target rows and by the draft runner's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

# A match steers a request to a slot when it saves at least this many tokens of prefill, or at least
# as many as it overwrites; a shorter match in front of other cached tokens (a shared system prompt
# before another conversation) does not, so the conversation stays for its own follow-up.
MIN_MATCH = 64

_CHUNK = 64  # common_prefix compares slices of this many tokens (at C speed) before single tokens


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i + _CHUNK <= n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:
        i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable(held: Sequence[int], prompt: Sequence[int]) -> int:
    """Positions of a row holding ``held`` that a request for ``prompt`` can keep: the common prefix,
    less the prompt's last token, which the first step scores."""
    return max(0, min(common_prefix(held, prompt), len(prompt) - 1))


def held_tokens(seq: list[int], length: int) -> list[int]:
    """The tokens whose K/V a row of ``length`` valid positions holds when its sequence ended as ``seq``.

    A step cut short by a stop condition leaves K/V of accepted tokens that never joined ``seq``
    (an EOS, tokens after a stop string): ``seq``'s tokens are a prefix of those that were fed, so
    the row holds ``seq[:length]``.
    """
    return seq[:min(length, len(seq))]


class SlotPrefixes:
    """Per free cache row ("slot"): the tokens its K/V hold, and when it was last released.

    A record exists only for free slots: :meth:`record` when a request leaves, :meth:`claim` when the
    next one takes the slot. A slot freed any other way (a failed step) has no record and starts
    from an empty row, so a record can only be missing, never stale.
    """

    def __init__(self) -> None:
        self._held: dict[int, list[int]] = {}
        self._released: dict[int, int] = {}  # slot -> tick of its last release (LRU order)
        self._tick = 0

    def held(self, slot: int) -> list[int]:
        """The tokens ``slot``'s row holds (empty: nothing reusable)."""
        return self._held.get(slot, [])

    def record(self, slot: int, tokens: list[int]) -> None:
        """``slot`` is free again and its row holds the K/V of ``tokens`` (positions 0..len-1)."""
        self._tick += 1
        self._released[slot] = self._tick
        if tokens:
            self._held[slot] = list(tokens)
        else:
            self._held.pop(slot, None)

    def forget(self, slot: int) -> None:
        """Nothing in ``slot``'s row is reusable."""
        self._held.pop(slot, None)

    def claim(self, slot: int, prompt: Sequence[int]) -> int:
        """A request for ``prompt`` takes ``slot``: the positions it keeps (see :func:`reusable`)."""
        return reusable(self._held.pop(slot, []), prompt)

    def choose(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """The free slot for a request of ``prompt``.

        The slot whose match saves the most, counting a match only if it saves :data:`MIN_MATCH`
        tokens or at least as many as it overwrites; then an empty slot (lowest first, which keeps
        running rows packed); then the least recently released.
        """
        if not free:
            raise ValueError("no free slot to choose from")

        def key(slot: int) -> tuple[int, bool, int, int]:
            held = self._held.get(slot, [])
            saved = reusable(held, prompt)
            counts = saved >= MIN_MATCH or saved >= len(held) - saved
            lru = -self._released.get(slot, 0) if held else 0
            return (saved if counts else 0, not held, lru, -slot)

        return max(free, key=key)
