"""Server-sent events that stop when the client goes away, and disconnect watching for plain responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: ...`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """An event stream that is cancelled as soon as the client disconnects.

    Starlette only listens for disconnects on older ASGI servers; here we always do, so a
    client that leaves mid-stream (or while its request waits in the queue) cancels the
    generator at once, and ``on_close`` runs however the stream ends.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run_then_cancel(func: Callable[[], Awaitable[None]]) -> None:
                    await func()
                    tg.cancel_scope.cancel()

                tg.start_soon(run_then_cancel, partial(self.stream_response, send))
                await run_then_cancel(partial(wait_for_disconnect, receive))
        except OSError:  # the connection broke while sending
            pass
        finally:
            self._on_close()


async def race_disconnect(work: Awaitable[Any], receive: Receive) -> tuple[bool, Any]:
    """Await ``work`` unless the client disconnects first: ``(True, result)`` or ``(False, None)``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        task.cancel()
        return False, None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
