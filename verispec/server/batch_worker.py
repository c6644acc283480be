"""The batching worker: serves requests on a :class:`~verispec.engine.batch.BatchEngine` (continuous batching).

Same interface as :class:`~verispec.server.worker.EngineWorker` (``submit`` returns an async
stream of events, ``cancel`` stops a request), but up to ``max_batch`` requests share each target
forward. One thread owns the batch engine: it takes new requests and cancellations between steps,
runs a step, then reports admissions, finished requests and KV usage to the observer. The asyncio
side never touches the batch engine, so it never waits for a step.

``max_queue`` bounds the requests submitted but not yet admitted to a slot; :meth:`submit`
raises :class:`QueueFullError` past it. A cancelled request leaves the batch before the next step
(mid-step, a running one is stopped by its token callback), so its slot and KV tokens are free at
once. A request the engine fails (its drafter raised, say) fails alone: the batch engine retries
the step without it, and the others go on (see :meth:`BatchEngine.step`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verispec.config import SpecConfig
from verispec.engine.batch import BatchEngine, RequestHandle
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.server.worker import (
    FailedEvent,
    FinishedEvent,
    GenRequest,
    Observer,
    QueueFullError,
    ShuttingDownError,
    TokensEvent,
    TokenStream,
    cancelled_result,
    probe_methods,
)

if TYPE_CHECKING:
    from verispec.engine.engine import Engine


@dataclass(eq=False)
class _Job:
    request: GenRequest
    stream: TokenStream
    handle: RequestHandle | None = None  # set once handed to the batch engine
    started: bool = False  # admitted to a slot
    cancelled: bool = False
    last: float = 0.0  # when the previous tokens came (the ITL gap)
    generated: int = 0


class BatchWorker:
    """Runs requests ``max_batch`` at a time on a :class:`BatchEngine`, admitted in arrival order.

    ``kv_budget_tokens`` caps the KV tokens running requests reserve (prompt + max_tokens each;
    default: every slot's full context). ``prefix_reuse`` lets a request reuse the KV an earlier
    one left in its slot (see :mod:`verispec.engine.prefix`). The worker's own thread steps the engine.
    """

    def __init__(self, engine: Engine, observer: Observer, max_queue: int, spec: SpecConfig, max_batch: int,
                 kv_budget_tokens: int | None = None, prefix_reuse: bool = True) -> None:
        self.engine = engine
        self._observer = observer
        self._max_queue = max_queue
        self._spec = spec
        self._batch_args = dict(max_batch=max_batch, kv_budget_tokens=kv_budget_tokens, prefix_reuse=prefix_reuse)
        try:
            self._batch = BatchEngine(engine, **self._batch_args)
        except VerispecError as e:
            raise VerispecError(f"cannot batch requests: {e} (--max-batch 1 serves one request at a time)") from None
        self.context_len = self._batch.max_len
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}  # every request not reported finished yet
        self._inbox: list[_Job] = []  # submitted, not yet handed to the batch engine
        self._waiting = 0  # submitted, not yet admitted
        self._wake = False  # a cancellation or close the thread has not seen yet
        self._closing = False
        self._thread: threading.Thread | None = None
        self._labels: dict[tuple[str, str], GenRequest] = {}  # a request per (path, method) seen, for KV gauges
        self._stats: dict[str, Any] = self._snapshot()
        self.available_methods = self._probe_methods()

    # -- lifecycle ---------------------------------------------------------------------------

    def _probe_methods(self) -> frozenset[str]:
        """The methods the batch engine can serve (it builds and so validates each one's drafter)."""
        return probe_methods(self._spec, self._batch._check_spec, " (--max-batch 1 serves every method)")

    def warm_up(self, k_max: int) -> None:
        """Profile the batch cost curves for k up to ``k_max`` before serving (k policy "cost")."""
        if self._spec.k_policy == "cost":
            self._batch.profile(k_max)

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

    @property
    def num_waiting(self) -> int:
        return self._waiting

    @property
    def num_running(self) -> int:
        return self._stats["running"]

    def stats(self) -> dict[str, Any]:
        """Slots, KV tokens and step figures as of the last step (a snapshot; safe from any thread)."""
        return {**self._stats, "waiting": self._waiting}

    def submit(self, request: GenRequest) -> TokenStream:
        """Queue ``request``; call from the asyncio loop that will consume the stream.

        Raises :class:`VerispecError` for a request that could never be admitted (more tokens
        than a slot or the KV budget holds).
        """
        self._batch.scheduler.check(len(request.prompt_ids) + request.params.max_tokens)  # reads constants only
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
                while not (self._inbox or self._wake or self._batch.has_work or self._closing):
                    self._cond.wait()
                if self._closing and not self._jobs:
                    return
                inbox, self._inbox, self._wake = self._inbox, [], False
                cancelled = [job for job in self._jobs.values() if job.cancelled and job.handle is not None]
            for job in inbox:
                self._hand_over(job)
            for job in cancelled:  # their slots are free before the next step
                self._batch.cancel(job.handle)
            if self._batch.has_work:
                # A request that fails fails alone (its handle carries the error); the engine, and what it
                # learned about costs and acceptance, carries on with the others. step() itself raises only
                # once the engine has stopped (every handle then has the error): a fresh one takes over,
                # keeping the cost model.
                try:
                    self._batch.step()
                except Exception:  # noqa: BLE001
                    logger.exception("the batch engine stopped; continuing on a fresh one")
                    self._report()
                    self._batch = BatchEngine(self.engine, **self._batch_args, costs=self._batch.costs)
            self._report()

    def _hand_over(self, job: _Job) -> None:
        req = job.request
        if job.cancelled:
            self._done(job, FinishedEvent(cancelled_result(req)), None)
            return
        try:
            job.handle = self._batch.submit(req.prompt_ids, req.params, req.spec,
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
            job.stream.push(TokensEvent(list(tokens)))
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
                    if handle.admitted_at is not None:  # engine time, as the one-request worker reports it
                        result.metrics.total_s = time.perf_counter() - handle.admitted_at
                    self._done(job, FinishedEvent(result), result)
        # KV usage per (path, method): the tokens the scheduler reserved for running requests.
        by_handle = {job.handle: job for job in self._jobs.values() if job.handle is not None}
        used = dict.fromkeys(self._labels, 0)
        for item, tokens in self._batch.scheduler.running.values():
            job = by_handle.get(item.handle)
            if job is not None:
                labels = job.request.path, job.request.method
                used[labels] = used.get(labels, 0) + tokens
        for labels, tokens in used.items():
            self._observer.kv_usage(self._labels[labels], tokens / self._batch.kv_budget_tokens)
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
        b = self._batch
        st = b.stats
        rows = st.rows_steps
        return {"max_batch": b.slots, "running": b.num_running, "kv_used_tokens": b.kv_used_tokens,
                "kv_budget_tokens": b.kv_budget_tokens, "steps": st.steps,
                "rows_steps": {str(n): c for n, c in sorted(rows.items())},
                "mean_rows": sum(n * c for n, c in rows.items()) / st.steps if st.steps else 0.0,
                "prefix_reuse": b.prefix_reuse, "prefill_tokens": st.prefill_tokens, "prefix_hits": st.prefix_hits,
                "prefix_reused_tokens": st.prefix_reused_tokens,
                "prefix_draft_reused_tokens": st.prefix_draft_reused_tokens}
