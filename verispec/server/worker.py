"""The engine worker: runs generation requests on one dedicated thread and streams their tokens to asyncio.

The engine is single-threaded, so every request goes through one thread fed by a bounded
queue. The HTTP layer sees only the :class:`Worker` interface (``submit`` returns an async
stream of events, ``cancel`` stops a request). :class:`EngineWorker` here runs one request at a
time (``--max-batch 1``); :class:`~verispec.server.batch_worker.BatchWorker` implements the same
interface on the continuous-batching engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from verispec.config import METHODS, SpecConfig
from verispec.engine.engine import GenerationResult
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.engine.engine import Engine

SPECULATIVE, PLAIN_PATH = "speculative", "plain"


@dataclass(frozen=True)
class GenRequest:
    """One generation: already-encoded prompt, sampling settings and the chosen path."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecConfig  # verispec.config.PLAIN on the plain path
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def path(self) -> str:
        return SPECULATIVE if self.spec.enabled else PLAIN_PATH

    @property
    def method(self) -> str:
        return self.spec.method if self.spec.enabled else "none"


@dataclass(frozen=True)
class TokensEvent:
    """Tokens a step added (a speculative step may add several)."""

    token_ids: list[int]


@dataclass(frozen=True)
class FinishedEvent:
    """The request ended; ``result.finish_reason`` is "stop", "length" or "cancelled"."""

    result: GenerationResult


@dataclass(frozen=True)
class FailedEvent:
    """The engine raised; the stream ends here."""

    error: BaseException


Event = TokensEvent | FinishedEvent | FailedEvent


class QueueFullError(Exception):
    """The waiting queue is full; the client should retry later."""


class ShuttingDownError(Exception):
    """The worker no longer accepts requests."""


class TokenStream:
    """The events of one request, delivered to the asyncio loop that submitted it.

    The worker thread pushes with ``loop.call_soon_threadsafe``; iterate with ``async for``.
    The stream ends after a :class:`FinishedEvent` or :class:`FailedEvent`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._done = False

    def push(self, event: Event) -> None:
        """Deliver ``event`` (callable from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if not isinstance(event, TokensEvent):
            self._done = True
        return event


class Observer(Protocol):
    """What the worker reports as requests move through it (the server's metrics implement it).

    Called from the worker thread and, for ``queued`` and for cancelling a waiting request,
    from the submitting thread.
    """

    def queued(self, request: GenRequest) -> None: ...
    def started(self, request: GenRequest) -> None: ...
    def tokens(self, request: GenRequest, n: int, gap_s: float, first: bool) -> None: ...
    def kv_usage(self, request: GenRequest, fraction: float) -> None: ...
    def finished(self, request: GenRequest, result: GenerationResult | None, ran: bool) -> None: ...


class Worker(Protocol):
    """The interface the HTTP layer schedules through."""

    available_methods: frozenset[str]
    context_len: int  # the longest prompt + max_tokens a request may have

    def start(self) -> None: ...
    def submit(self, request: GenRequest) -> TokenStream: ...
    def cancel(self, request_id: str) -> None: ...
    def close(self) -> None: ...
    def join(self, timeout: float | None = None) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


@dataclass
class _Job:
    request: GenRequest
    stream: TokenStream


def cancelled_result(request: GenRequest) -> GenerationResult:
    """The result of a request cancelled before it ran."""
    return GenerationResult(list(request.prompt_ids), [], "", "cancelled",
                            Metrics(requests=1, prompt_tokens=len(request.prompt_ids)))


class EngineWorker:
    """Runs requests one at a time on a dedicated thread, in arrival order.

    ``max_queue`` bounds the requests waiting behind the running one; :meth:`submit` raises
    :class:`QueueFullError` past it. Cancelling a waiting request drops it at once; a running
    one stops after its current step (the engine's ``on_tokens`` callback returns False).
    """

    def __init__(self, engine: Engine, observer: Observer, max_queue: int, spec: SpecConfig) -> None:
        self.engine = engine
        self._observer = observer
        self._max_queue = max_queue
        self._spec = spec
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._running: _Job | None = None
        self._cancel_running = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self.context_len = engine.config.max_len
        self.available_methods = self._probe_methods()

    # -- lifecycle ---------------------------------------------------------------------------

    def _probe_methods(self) -> frozenset[str]:
        """Build the drafter of every method that can be built; the others are unavailable.

        Runs before the thread exists (the engine is not thread-safe), so a request naming an
        unavailable method gets a clean 400 instead of failing mid-stream.
        """
        return probe_methods(self._spec, self.engine.drafter)

    def warm_up(self, k_max: int) -> None:
        """Profile every available drafter's costs for k up to ``k_max`` before serving (k policy "cost")."""
        if self._spec.k_policy == "cost":
            for method in sorted(self.available_methods):
                spec = replace(self._spec, method=method, k=max(1, self._spec.k))
                self.engine.cost_model(spec, self.engine.drafter(spec), k_max)

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop accepting requests and cancel every waiting and running one (idempotent)."""
        with self._cond:
            self._closing = True
            dropped = list(self._waiting)
            self._waiting.clear()
            if self._running is not None:
                self._cancel_running = True
            self._cond.notify_all()
        for job in dropped:
            self._finish_unrun(job)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after :meth:`close`); True when it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- scheduling --------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return int(self._running is not None)

    def stats(self) -> dict[str, Any]:
        """The scheduling figures /stats shows (one slot)."""
        return {"max_batch": 1, "running": self.num_running, "waiting": self.num_waiting}

    def submit(self, request: GenRequest) -> TokenStream:
        """Queue ``request``; call from the asyncio loop that will consume the stream."""
        stream = TokenStream(request.request_id, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise ShuttingDownError("the server is shutting down")
            if len(self._waiting) >= self._max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(_Job(request, stream))
            self._observer.queued(request)
            self._cond.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        """Cancel a waiting or running request; unknown or finished ids are ignored."""
        dropped = None
        with self._cond:
            if self._running is not None and self._running.request.request_id == request_id:
                self._cancel_running = True
                return
            for job in self._waiting:
                if job.request.request_id == request_id:
                    dropped = job
                    self._waiting.remove(job)
                    break
        if dropped is not None:
            self._finish_unrun(dropped)

    def _finish_unrun(self, job: _Job) -> None:
        result = cancelled_result(job.request)
        self._observer.finished(job.request, result, ran=False)
        job.stream.push(FinishedEvent(result))

    # -- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:  # closing, and nothing left
                    return
                job = self._waiting.popleft()
                self._running, self._cancel_running = job, False
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: _Job) -> None:
        req, stream, observer = job.request, job.stream, self._observer
        max_len = self.engine.config.max_len
        observer.started(req)
        last = req.arrival
        used = len(req.prompt_ids)
        observer.kv_usage(req, min(1.0, used / max_len))

        def on_tokens(_: int, tokens: list[int]) -> bool:
            nonlocal last, used
            if tokens:
                now = time.perf_counter()
                first = used == len(req.prompt_ids)
                # Time per token of this step: a speculative step delivers several at once.
                observer.tokens(req, len(tokens), (now - last) / (1 if first else len(tokens)), first)
                last = now
                used += len(tokens)
                observer.kv_usage(req, min(1.0, used / max_len))
                stream.push(TokensEvent(list(tokens)))
            return not self._cancel_running

        try:
            result = self.engine.generate(req.prompt_ids, req.params, req.spec, on_tokens=on_tokens)[0]
        except Exception as e:  # noqa: BLE001 (reported to the client, the worker carries on)
            if not isinstance(e, VerispecError):
                logger.exception("request %s failed", req.request_id)
            observer.finished(req, None, ran=True)
            stream.push(FailedEvent(e))
            return
        observer.finished(req, result, ran=True)
        stream.push(FinishedEvent(result))



def probe_methods(spec: SpecConfig, build: Any, hint: str = "") -> frozenset[str]:
    """The speculation methods ``build(spec)`` accepts (it raises for the others).

    The server's own default method must be among them: a server that cannot serve its own
    default refuses to start, with ``hint`` appended to the error.
    """
    available, failures = [], {}
    for method in METHODS:
        if method == "none":
            continue
        try:
            build(replace(spec, method=method, k=max(1, spec.k)))
        except Exception as e:  # noqa: BLE001 (any failure only means the method is unavailable)
            failures[method] = e
            logger.debug("speculation method %s unavailable: %s", method, e)
        else:
            available.append(method)
    if spec.enabled and spec.method in failures:
        raise VerispecError(f"cannot speculate with '{spec.method}': {failures[spec.method]}{hint}")
    return frozenset(available)
