"""Canary routing: which requests take the speculative path.

A request's key (its ``user`` field, else its request id) is hashed to a point in [0, 1);
keys below the fraction speculate. The hash is stable, so one user stays on one path for as
long as the fraction stays put, and raising the fraction only moves users onto speculation.
"""

from __future__ import annotations

import hashlib
import threading

from verispec.errors import VerispecError


def key_point(key: str) -> float:
    """The key's stable position in [0, 1) (the first 8 bytes of its SHA-256)."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def routes_to_speculation(key: str, fraction: float) -> bool:
    """True when ``key`` falls in the speculative share ``fraction`` of the key space."""
    return key_point(key) < fraction


class CanaryRouter:
    """Holds the live speculative fraction and decides each request's path."""

    def __init__(self, fraction: float) -> None:
        self._lock = threading.Lock()
        self._fraction = self._check(fraction)

    @staticmethod
    def _check(fraction: float) -> float:
        if not 0.0 <= fraction <= 1.0:
            raise VerispecError(f"the speculative fraction must be in [0, 1] (got {fraction!r})")
        return float(fraction)

    @property
    def fraction(self) -> float:
        return self._fraction

    def set_fraction(self, fraction: float) -> float:
        """Change the fraction; returns the previous one."""
        new = self._check(fraction)
        with self._lock:
            old, self._fraction = self._fraction, new
        return old

    def speculate(self, key: str, override: bool | None = None) -> bool:
        """The path for a request: its own choice when it made one, else the canary's."""
        if override is not None:
            return override
        return routes_to_speculation(key, self._fraction)
