"""The engine worker: the one thread that drives the engine, streaming each request's tokens to asyncio.

The engine is single-threaded and starts no threads, so every request goes through the worker's
thread: it takes new requests and cancellations between steps, runs a step, then reports
admissions, finished requests and KV usage to the observer. The asyncio side never touches the
engine, so it never waits for a step. The HTTP layer sees only the :class:`Worker` interface
(``submit`` returns an async stream of events, ``cancel`` stops a request).

``max_queue`` bounds the requests submitted but not yet admitted to a slot; :meth:`EngineWorker.submit`
raises :class:`QueueFullError` past it. A cancelled request leaves the batch before the next step
(mid-step, a running one is stopped by its token callback), so its slot and KV tokens are free at
once. A request the engine fails (its drafter raised, say) fails alone: the engine retries the
step without it, and the others go on (see :meth:`Engine.step`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from verispec.config import METHODS, SpecConfig
from verispec.constraints import Constraint
from verispec.engine.engine import GenerationResult, RequestHandle
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.sampling import SamplingParams, TokenLogprob

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
    prediction: list[int] | None = None  # a predicted output's token ids
    constraint: Constraint | None = None  # a grammar the output follows
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def path(self) -> str:
        return SPECULATIVE if self.spec.enabled else PLAIN_PATH

    @property
    def method(self) -> str:
        return self.spec.method if self.spec.enabled else "none"


@dataclass(frozen=True)
class TokensEvent:
    """Tokens a step added (a speculative step may add several), and their log-probabilities when asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


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


def cancelled_result(request: GenRequest) -> GenerationResult:
    """The result of a request cancelled before it ran."""
    return GenerationResult(list(request.prompt_ids), [], "", "cancelled",
                            Metrics(requests=1, prompt_tokens=len(request.prompt_ids)))


@dataclass(eq=False)
class _Job:
    request: GenRequest
    stream: TokenStream
    handle: RequestHandle | None = None  # set once handed to the engine
    started: bool = False  # admitted to a slot
    cancelled: bool = False
    last: float = 0.0  # when the previous tokens came (the ITL gap)
    generated: int = 0


class EngineWorker:
    """Runs requests ``max_batch`` at a time on the engine, admitted in arrival order.

    ``kv_budget_tokens`` caps the KV tokens running requests reserve (prompt + max_tokens each;
    default: every slot's full context). ``prefix_reuse`` lets a request reuse the KV an earlier
    one left in its slot (see :mod:`verispec.engine.prefix`). The worker's own thread steps the engine.
    """

    def __init__(self, engine: Engine, observer: Observer, max_queue: int, spec: SpecConfig, max_batch: int,
                 kv_budget_tokens: int | None = None, prefix_reuse: bool = True) -> None:
        self._observer = observer
        self._max_queue = max_queue
        self._spec = spec
        wanted = dict(max_batch=max_batch, kv_budget_tokens=kv_budget_tokens, prefix_reuse=prefix_reuse)
        if any(getattr(engine.config, name) != value for name, value in wanted.items()):
            engine = engine.with_config(**wanted)  # the same models, slots as the server wants them
        self.engine = engine
        self.context_len = engine.max_len
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}  # every request not reported finished yet
        self._inbox: list[_Job] = []  # submitted, not yet handed to the engine
        self._waiting = 0  # submitted, not yet admitted
        self._wake = False  # a cancellation or close the thread has not seen yet
        self._closing = False
        self._thread: threading.Thread | None = None
        self._labels: dict[tuple[str, str], GenRequest] = {}  # a request per (path, method) seen, for KV gauges
        self._stats: dict[str, Any] = self._snapshot()
        self.available_methods = probe_methods(self._spec, self.engine.check_spec)

    # -- lifecycle ---------------------------------------------------------------------------

    def warm_up(self, k_max: int) -> None:
        """Profile the cost policy's curves for k up to ``k_max`` before serving, if the default spec uses it, and
        build the tokenizer constraints use (so the first structured request does not wait for it)."""
        if self._spec.k_policy == "cost" and self.engine.costs is None:
            self.engine.profile(k_max)
        if self.engine.tokenizer is not None:
            try:
                self.engine.codec.grammar_tokenizer()
            except VerispecError as e:  # the server still serves; constrained requests get this error
                logger.warning("structured outputs are unavailable: %s", e)

    def start(self) -> None:
        """Start the stepping thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="verispec-batch-worker", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop accepting requests and cancel every waiting and running one (idempotent)."""
        with self._cond:
            self._closing = True
            for job in self._jobs.values():
                job.cancelled = True
            self._wake = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after :meth:`close`); True when it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- scheduling --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Slots, KV tokens and step figures as of the last step (a snapshot; safe from any thread)."""
        return {**self._stats, "waiting": self._waiting}

    def submit(self, request: GenRequest) -> TokenStream:
        """Queue ``request``; call from the asyncio loop that will consume the stream.

        Raises :class:`VerispecError` for a request that could never be admitted (more tokens
        than a slot or the KV budget holds).
        """
        self.engine.scheduler.check(len(request.prompt_ids) + request.params.max_tokens)  # reads constants only
        stream = TokenStream(request.request_id, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise ShuttingDownError("the server is shutting down")
            if self._waiting >= self._max_queue:
                raise QueueFullError(f"{self._waiting} requests are already waiting")
            job = _Job(request, stream, last=request.arrival)
            self._jobs[request.request_id] = job
            self._inbox.append(job)
            self._waiting += 1
            self._observer.queued(request)
            self._cond.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        """Cancel a waiting or running request; unknown or finished ids are ignored. Never blocks on a step."""
        with self._cond:
            job = self._jobs.get(request_id)
            if job is None or job.cancelled:
                return
            job.cancelled = True
            self._wake = True
            self._cond.notify()

    # -- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._wake or self.engine.has_work or self._closing):
                    self._cond.wait()
                if self._closing and not self._jobs:
                    return
                inbox, self._inbox, self._wake = self._inbox, [], False
                cancelled = [job for job in self._jobs.values() if job.cancelled and job.handle is not None]
            for job in inbox:
                self._hand_over(job)
            for job in cancelled:  # their slots are free before the next step
                self.engine.cancel(job.handle)
            if self.engine.has_work:
                # A request that fails fails alone (its handle carries the error); the engine, and what it
                # learned about costs, carries on with the others. step() raises only a BaseException,
                # after which every running request has the error and the engine is reset.
                self.engine.step()
            self._report()

    def _hand_over(self, job: _Job) -> None:
        req = job.request
        if job.cancelled:
            self._done(job, FinishedEvent(cancelled_result(req)), None)
            return
        try:
            job.handle = self.engine.submit(req.prompt_ids, req.params, req.spec, prediction=req.prediction,
                                            constraint=req.constraint,
                                            on_tokens=lambda tokens: self._on_tokens(job, tokens))
        except Exception as e:  # noqa: BLE001 (reported to the client, the worker carries on)
            if not isinstance(e, VerispecError):
                logger.exception("request %s failed", req.request_id)
            self._done(job, FailedEvent(e), None)

    def _on_tokens(self, job: _Job, tokens: list[int]) -> bool:
        # On this thread, inside a step: stream the tokens; False stops a cancelled request now.
        if not job.started:
            self._started(job)
        if tokens:
            req, now = job.request, time.perf_counter()
            first = job.generated == 0
            # Time per token of this step: a speculative step delivers several at once.
            self._observer.tokens(req, len(tokens), (now - job.last) / (1 if first else len(tokens)), first)
            job.last = now
            job.generated += len(tokens)
            job.stream.push(TokensEvent(list(tokens), getattr(tokens, "logprobs", None)))
        return not job.cancelled

    def _started(self, job: _Job) -> None:
        job.started = True
        self._labels.setdefault((job.request.path, job.request.method), job.request)
        with self._cond:
            self._waiting -= 1
        self._observer.started(job.request)

    def _report(self) -> None:
        """After a step: report admissions, finished requests, KV usage and the step figures."""
        for job in list(self._jobs.values()):
            handle = job.handle
            if handle is None:
                continue
            if not job.started and handle.admitted_at is not None:
                self._started(job)
            if handle.done:
                try:
                    result = handle.result()
                except Exception as e:  # noqa: BLE001 (the step failed; so does the request)
                    self._done(job, FailedEvent(e), None)
                else:
                    self._done(job, FinishedEvent(result), result)
        # KV usage per (path, method): the tokens the scheduler reserved for running requests.
        by_handle = {job.handle: job for job in self._jobs.values() if job.handle is not None}
        used = dict.fromkeys(self._labels, 0)
        for item, tokens in self.engine.scheduler.running.values():
            job = by_handle.get(item.handle)
            if job is not None:
                labels = job.request.path, job.request.method
                used[labels] = used.get(labels, 0) + tokens
        for labels, tokens in used.items():
            self._observer.kv_usage(self._labels[labels], tokens / self.engine.kv_budget_tokens)
        self._stats = self._snapshot()

    def _done(self, job: _Job, event: FinishedEvent | FailedEvent, result: Any) -> None:
        req = job.request
        self._labels.setdefault((req.path, req.method), req)
        with self._cond:
            self._jobs.pop(req.request_id, None)
            if not job.started:
                self._waiting -= 1
        self._observer.finished(req, result, ran=job.started)
        job.stream.push(event)

    def _snapshot(self) -> dict[str, Any]:
        b = self.engine
        st = b.stats
        rows = st.rows_steps
        return {"max_batch": b.slots, "running": b.num_running, "kv_used_tokens": b.kv_used_tokens,
                "kv_budget_tokens": b.kv_budget_tokens, "steps": st.steps,
                "rows_steps": {str(n): c for n, c in sorted(rows.items())},
                "mean_rows": st.mean_rows,
                "prefix_reuse": b.prefix_reuse, "prefill_tokens": st.prefill_tokens, "prefix_hits": st.prefix_hits,
                "prefix_reused_tokens": st.prefix_reused_tokens,
                "prefix_draft_reused_tokens": st.prefix_draft_reused_tokens}


def probe_methods(spec: SpecConfig, build: Any) -> frozenset[str]:
    """The speculation methods ``build(spec)`` accepts (it raises for the others).

    The server's own default method must be among them: a server that cannot serve its own
    default refuses to start.
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
        raise VerispecError(f"cannot speculate with '{spec.method}': {failures[spec.method]}")
    return frozenset(available)
