"""One replica's side of a replicated server: today's app, driven in-process, and what the replica reports.

A replica runs the single-engine app of :func:`~verispec.server.app.create_app` unchanged (endpoints,
validation, errors, limits, streaming, metrics). The ingress forwards each HTTP request as a
:class:`Forwarded` value; :meth:`ReplicaHost.forward` feeds it to the app as one ASGI call and yields
the app's ASGI response messages as they are sent, so a stream stays a stream. Closing the iterator
early (the client left, the ingress cancelled) tells the app that the client disconnected, which
cancels the request in the worker exactly as a dropped connection does on a single server.

:meth:`ReplicaHost.report` is what the router and the aggregated ``/stats`` read: load, readiness, and
the block hashes of the text the engine's cache rows hold (see :mod:`verispec.server.prefix_router`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from verispec.log import logger
from verispec.server.prefix_router import block_hashes
from verispec.server.state import ServerState


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress received it (the body already read in full)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    scheme: str = "http"

    def scope(self) -> dict[str, Any]:
        """The ASGI HTTP scope the replica's app sees."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": self.scheme, "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
                "client": self.client, "server": ("replica", 0), "state": {}}


class ReplicaHost:
    """Today's app for one engine, started in-process (its lifespan entered) and called per request."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.state: ServerState = app.state.verispec
        self._lifespan: contextlib.AbstractAsyncContextManager[Any] | None = None
        self._hashed: dict[int, list[int]] = {}  # a cached sequence's hash -> its text's block hashes

    async def start(self) -> None:
        """Enter the app's lifespan: the worker thread starts and the warm-up begins."""
        if self._lifespan is None:
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()

    async def stop(self) -> None:
        """Leave the lifespan: running requests are cancelled and the worker stops."""
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            await lifespan.__aexit__(None, None, None)

    async def forward(self, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
        """Run ``request`` through the app; yield its ``http.response.start`` and ``http.response.body`` messages."""
        out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()  # set when the caller stops listening: the app sees a disconnect
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] in ("http.response.start", "http.response.body"):
                await out.put({k: v for k, v in message.items() if k in ("type", "status", "headers", "body",
                                                                          "more_body")})

        task = asyncio.create_task(self.app(request.scope(), receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(out.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the app returned: pass on what it sent last, then stop
                    getter.cancel()
                    while not out.empty():
                        yield out.get_nowait()
                    task.result()  # re-raise what the app raised (its error handlers answer most errors)
                    return
                message = getter.result()
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
        finally:
            gone.set()  # the app's disconnect watchers cancel the request; the task then ends on its own
            if not task.done():
                task.add_done_callback(_log_failure)

    def report(self, block_chars: int) -> dict[str, Any]:
        """Load, readiness, slots, the rolling figures and the block hashes of the text the cache rows hold
        (their token ids decoded, special tokens included: the text the router hashes)."""
        state = self.state
        worker = state.worker
        batch = worker.stats()
        held: set[int] = set()
        hashes = {}
        for tokens in cached_sequences(state):
            key = hash(tuple(tokens))
            hashes[key] = self._hashed.get(key) or block_hashes(self._text(tokens), block_chars)
            held.update(hashes[key])
        self._hashed = hashes  # rows unchanged since the last report are not decoded again
        snap = state.metrics.snapshot()
        totals = [p["total"] for p in snap["paths"].values()]
        drafted, accepted = sum(t["drafted"] for t in totals), sum(t["accepted"] for t in totals)
        return {
            "ready": state.readiness.state == "ready" and not state.closing,
            "state": "shutting_down" if state.closing else state.readiness.state,
            "error": state.readiness.error,
            "load": int(batch.get("running", 0)) + int(batch.get("waiting", 0)),
            "running": int(batch.get("running", 0)),
            "waiting": int(batch.get("waiting", 0)),
            "slots": int(batch.get("max_batch", 1)),
            "requests": sum(t["requests"] for t in totals),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "prefix_reused_tokens": sum(t["prefix_reused_tokens"] for t in totals),
            "blocks": sorted(held),
            "stats": {**snap, "batch": batch},
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def _text(self, tokens: list[int]) -> str:
        tokenizer = self.state.engine.tokenizer
        return tokenizer.decode(tokens, skip_special_tokens=False) if tokenizer is not None else ""

    def metrics_text(self) -> bytes:
        """This replica's Prometheus exposition."""
        return self.state.metrics.render()

    def alive(self) -> bool:
        """False once the replica cannot serve again (its warm-up failed, or its engine thread ended while
        the app runs); the host then replaces it."""
        if self.state.readiness.state == "failed":
            return False
        return self._lifespan is None or self.state.closing or not self.state.worker.join(0)


def cached_sequences(state: ServerState) -> list[list[int]]:
    """The token sequences whose K/V the engine's cache rows hold: free rows' recorded prefixes and
    running requests' prompts.

    Read from outside the worker thread without a lock: a copy torn by a concurrent step only
    misstates one row until the next report, which at worst routes one request to a colder replica.
    """
    engine = getattr(state.worker, "engine", None)
    if engine is None:
        return []
    out: list[list[int]] = []
    try:
        for slot in range(engine.slots):
            held = engine.rows.prefixes.held(slot)
            if held:
                out.append(list(held))
        for item, _ in list(engine.scheduler.running.values()):
            out.append(list(item.prompt))
    except (RuntimeError, AttributeError, KeyError):  # a dict resized mid-read: report what was read
        pass
    return out


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("a forwarded request failed after its caller left: %s", task.exception())
