"""Readiness: the server answers 503 ``loading`` until its warm-up (cost profiling) has run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from verispec.log import logger

State = Literal["loading", "ready", "failed"]


class Readiness:
    """``loading`` until the warm-up has run on its own thread, then ``ready`` (or ``failed`` if it raised).

    The warm-up runs off the event loop, so ``/health`` answers while it runs. "ready on URL" is
    logged once the warm-up has ended and the server listens (:meth:`listening`), in either order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: State = "loading"
        self._url: str | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> State:
        return self._state

    def start(self, warm_up: Callable[[], None]) -> None:
        """Run ``warm_up`` on a daemon thread (once); the state turns ``ready`` when it returns."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(warm_up,), name="verispec-warm-up", daemon=True)
            self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up to end; True when it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self, warm_up: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            warm_up()
        except Exception as e:  # noqa: BLE001 (reported by /health; the server takes no requests)
            logger.exception("the warm-up failed; the server takes no requests")
            with self._lock:
                self._state, self.error = "failed", f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self._state, url = "ready", self._url
        logger.info("warm-up done in %.1f s", time.perf_counter() - t0)
        if url is not None:
            logger.info("ready on %s", url)

    def listening(self, url: str) -> None:
        """The server accepts connections at ``url``."""
        with self._lock:
            self._url, state = url, self._state
        if state == "ready":
            logger.info("ready on %s", url)
        elif state == "loading":
            logger.info("listening on %s; /health answers 503 (loading) until the warm-up ends", url)
