"""The ingress of a replicated server: one OpenAI-compatible front that routes each request to a replica.

The ingress owns no engine. It routes ``/v1/completions`` and ``/v1/chat/completions`` with the
:class:`~verispec.server.prefix_router.PrefixRouter` (the prompt's text is rendered here, through the
chat template, only to hash its blocks) and forwards every request to a replica's copy of the single-engine app (see
:mod:`verispec.server.replica_host`), so answers, errors and streams are that app's, byte for byte.
It answers ``/health``, ``/metrics``, ``/stats`` and ``/dashboard`` for the replicas together, and
sends ``/admin/*`` to every replica. It reaches replicas only through a :class:`Fleet`, so nothing
here depends on Ray.

Faults: a replica that dies or stops answering its reports is taken out of routing. A request that
has sent nothing to its client yet (a non-streamed one until its answer is complete, a stream until
its first event) is retried on another replica; a stream that already sent events ends with an error
event and ``[DONE]``. A client that leaves cancels its request on the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.errors import VerispecError
from verispec.log import logger
from verispec.server.aggregate import merge_metrics, merge_paths
from verispec.server.config import ServerConfig
from verispec.server.errors import error_body
from verispec.server.limits import HostCheck, RequestLimits
from verispec.server.metrics import percentile
from verispec.server.prefix_router import REASONS, Choice, PrefixRouter, RouterConfig
from verispec.server.replica_host import Forwarded
from verispec.server.streaming import sse, wait_for_disconnect

# The response header naming the replica that answered; on a request, it pins the request to that replica.
REPLICA_HEADER = "x-verispec-replica"
_DECISIONS = (*REASONS, "pinned")
_GENERATION = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
_INLINE_BODY = 256 * 1024  # request bodies rendered on the event loop; larger ones on a thread
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)

# (kind, request body) -> the prompt's text as the model reads it, or None when it cannot be rendered
PromptText = Callable[[str, dict[str, Any]], str | None]


class ReplicaGone(Exception):
    """The replica died or cannot be reached; what it had not answered may be retried elsewhere."""


class Fleet(Protocol):
    """How the ingress reaches its replicas (indices ``0..size-1``)."""

    size: int

    def forward(self, replica: int, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
        """The replica's ASGI response messages for ``request``; raises :class:`ReplicaGone`. Closing the
        iterator early cancels the request on the replica."""
        ...

    async def report(self, replica: int) -> dict[str, Any]:
        """The replica's :meth:`~verispec.server.replica_host.ReplicaHost.report`; raises :class:`ReplicaGone`."""
        ...

    async def metrics(self, replica: int) -> bytes:
        """The replica's Prometheus exposition; raises :class:`ReplicaGone`."""
        ...


@dataclass(frozen=True)
class IngressConfig:
    """How the ingress watches its replicas: a report every ``report_interval_s`` from each, given up
    after ``report_timeout_s`` (the replica is then taken out of routing until it reports again)."""

    router: RouterConfig = field(default_factory=RouterConfig)
    report_interval_s: float = 0.5
    report_timeout_s: float = 5.0
    overhead_window: int = 4096  # routing overheads kept for /stats' percentiles

    def __post_init__(self) -> None:
        if self.report_interval_s <= 0 or self.report_timeout_s <= 0:
            raise VerispecError("report_interval_s and report_timeout_s must be positive")
        if self.overhead_window < 1:
            raise VerispecError("overhead_window must be at least 1")


Outcome = Literal["done", "retry"]


class Ingress:
    """The ingress's ASGI application (:attr:`asgi`, with today's body limit and Host check in front)."""

    def __init__(self, fleet: Fleet, server: ServerConfig, prompt_text: PromptText | None = None,
                 config: IngressConfig | None = None) -> None:
        self.fleet, self.server, self.prompt_text = fleet, server, prompt_text
        self.config = config or IngressConfig()
        self.router = PrefixRouter(fleet.size, self.config.router)
        self.reports: list[dict[str, Any]] = [{"state": "loading"} for _ in range(fleet.size)]
        self.routed = [0] * fleet.size
        self.decisions: Tally[str] = Tally()
        self.retries = 0
        self.closing = False
        self._overheads: deque[float] = deque(maxlen=self.config.overhead_window)
        self._down = [asyncio.Event() for _ in range(fleet.size)]  # set while a replica is out of routing
        self._poller: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._m_decisions = Counter("verispec:router_decisions", "Requests routed, by reason (prefix: the longest "
                                    "cached prompt prefix; user: the replica that served the user before; load: "
                                    "the least loaded; pinned: the request named its replica).", ("reason",),
                                    registry=r)
        self._m_retries = Counter("verispec:router_retries", "Requests retried on another replica after theirs "
                                  "failed before answering.", registry=r)
        self._m_overhead = Histogram("verispec:router_overhead_seconds", "The ingress's routing time per request: "
                                     "parsing the body, rendering and hashing the prompt, choosing the replica.",
                                     buckets=_OVERHEAD_BUCKETS, registry=r)
        self._m_healthy = Gauge("verispec:replicas_ready", "Replicas taking requests.", registry=r)
        for reason in _DECISIONS:
            self._m_decisions.labels(reason)
        app: ASGIApp = self._dispatch
        app = RequestLimits(app, max_body_bytes=server.max_body_bytes, timeout_s=server.read_timeout_s)
        if server.checks_host:
            app = HostCheck(app, allowed=server.allowed_hosts or ())
        self.asgi = app
        self._dashboard = (files("verispec.server") / "dashboard.html").read_text(encoding="utf-8")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start polling the replicas' reports on the running loop (idempotent)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        self.closing = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    def ready_count(self) -> int:
        """How many replicas take requests."""
        return len(self.router.healthy())

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._refresh(i) for i in range(self.fleet.size)))
            self._m_healthy.set(self.ready_count())
            await asyncio.sleep(self.config.report_interval_s)

    async def _refresh(self, i: int) -> None:
        since = self.router.clock
        try:
            report = await asyncio.wait_for(self.fleet.report(i), self.config.report_timeout_s)
        except (ReplicaGone, TimeoutError) as e:
            if self.reports[i].get("state") not in ("unavailable", "loading"):
                logger.warning("replica %d is unavailable (%s); routing around it", i, e or type(e).__name__)
            self._take_out(i)
            self.reports[i] = {"state": "unavailable" if self.reports[i].get("pid") else "loading",
                               "error": str(e) or type(e).__name__}
            return
        except Exception as e:  # noqa: BLE001 (a report that fails for any other reason is no report)
            logger.warning("replica %d's report failed: %s", i, e)
            return
        self.reports[i] = report
        self.router.report(i, report["load"], report["blocks"], healthy=bool(report["ready"]), since=since)
        if report["ready"]:
            self._down[i].clear()
        else:
            self._down[i].set()

    def _take_out(self, i: int) -> None:
        self.router.mark_down(i)
        self._down[i].set()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.start()
        path, method = scope["path"], scope["method"]
        if path in _GENERATION and method == "POST":
            await self._generate(scope, receive, send, _GENERATION[path])
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/metrics" and method == "GET":
            await self._metrics(send)
        elif path == "/stats" and method == "GET":
            await _json(send, 200, await self.stats())
        elif path == "/dashboard" and method == "GET":
            await _respond(send, 200, self._dashboard.encode(), b"text/html; charset=utf-8")
        elif path.startswith("/admin/"):
            await self._broadcast(scope, receive, send)
        else:  # /v1/models, /openapi.json, unknown paths: any replica answers as the single server does
            await self._route(scope, receive, send, [], None)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- generation --------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        body = await _read_body(receive)
        t0 = time.perf_counter()  # the routing overhead: from the whole body to the choice of a replica
        hashes: list[int] = []
        user = None
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers the 400
        if isinstance(parsed, dict):
            user = parsed.get("user") if isinstance(parsed.get("user"), str) else None
            if self.prompt_text is not None:
                # Rendering takes well under a millisecond for prompts of thousands of tokens; only a huge
                # body goes to a thread, where it cannot hold up the event loop.
                if len(body) < _INLINE_BODY:
                    text = self._render(kind, parsed)
                else:
                    text = await asyncio.to_thread(self._render, kind, parsed)
                hashes = self.router.hashes(text) if text else []
        await self._route(scope, receive, send, hashes, user, body=body, t0=t0)

    def _render(self, kind: str, body: dict[str, Any]) -> str | None:
        assert self.prompt_text is not None
        try:
            return self.prompt_text(kind, body)
        except Exception:  # noqa: BLE001 (a prompt that cannot be rendered is the replica's 400; route by load)
            return None

    async def _route(self, scope: Scope, receive: Receive, send: Send, hashes: Sequence[int], user: str | None,
                     body: bytes | None = None, t0: float | None = None) -> None:
        """Forward to the replica the router picks (retrying elsewhere while nothing reached the client).
        ``t0`` (generation requests only) starts the routing overhead, which the decision counts go with."""
        generation = t0 is not None
        if body is None:
            body = await _read_body(receive)
        request = _forwarded(scope, body)
        pinned = _pinned(scope)
        if pinned is not None and not 0 <= pinned < self.fleet.size:
            await _json(send, 400, error_body(f"{REPLICA_HEADER} must name a replica from 0 to {self.fleet.size - 1}",
                                              400, param=REPLICA_HEADER))
            return
        tried: list[int] = []
        while True:
            if pinned is None:
                choice = self.router.choose(hashes, user, exclude=tried)
            elif pinned in self.router.healthy() and not tried:
                choice = Choice(pinned, "pinned")
            else:
                choice = None
            if t0 is not None:
                overhead, t0 = time.perf_counter() - t0, None
                self._overheads.append(overhead)
                self._m_overhead.observe(overhead)
            if choice is None:
                await self._unavailable(send, retried=bool(tried))
                return
            i = choice.replica
            if generation and not tried:
                self.decisions[choice.reason] += 1
                self._m_decisions.labels(choice.reason).inc()
            tried.append(i)
            self.router.sent(i, hashes, user)
            self.routed[i] += 1
            try:
                outcome = await self._relay(i, request, receive, send)
            finally:
                self.router.finished(i)
            if outcome == "done":
                return
            self.retries += 1
            self._m_retries.inc()
            logger.warning("replica %d failed before answering; retrying the request elsewhere", i)

    async def _relay(self, i: int, request: Forwarded, receive: Receive, send: Send) -> Outcome:
        """Pass replica ``i``'s answer on; "retry" when it failed before anything reached the client."""
        stream = self.fleet.forward(i, request)
        left = asyncio.ensure_future(wait_for_disconnect(receive))
        down = asyncio.ensure_future(self._down[i].wait())
        start: dict[str, Any] | None = None
        sent = False  # bytes reached the client: no retry from here on
        try:
            while True:
                nxt = asyncio.ensure_future(anext(stream))
                await asyncio.wait({nxt, left, down}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    if left.done():
                        return "done"  # the client left; closing the stream cancels the request
                    if not sent:  # taken out of routing before it answered: its report failed
                        return "retry"
                    down = asyncio.ensure_future(asyncio.Event().wait())  # a started stream waits for its end
                    continue
                try:
                    message = nxt.result()
                except StopAsyncIteration:  # ended before its last body message: the replica went away
                    if not sent:
                        return "retry"
                    await self._fail_started(send, start, "its stream ended early")
                    return "done"
                except ReplicaGone as e:
                    self._take_out(i)
                    if not sent:
                        return "retry"
                    await self._fail_started(send, start, str(e))
                    return "done"
                except Exception as e:  # noqa: BLE001 (the replica raised: this request fails, the replica serves on)
                    logger.warning("replica %d failed on a request: %s", i, e)
                    if sent:
                        await self._fail_started(send, start, str(e))
                    else:
                        await _json(send, 500, error_body("the replica failed on this request", 500,
                                                          code="replica_error"))
                    return "done"
                if message["type"] == "http.response.start":
                    start = message
                    continue
                if not sent:  # the head goes out with the first body bytes, so a failure before them retries
                    head = dict(start or {"type": "http.response.start", "status": 200, "headers": []})
                    head["headers"] = [*self._head_headers(request, head.get("headers", [])),
                                       (REPLICA_HEADER.encode(), str(i).encode())]
                    await send(head)
                    sent = True
                await send(message)
                if not message.get("more_body", False):
                    return "done"
        finally:
            left.cancel()
            down.cancel()
            with contextlib.suppress(BaseException):
                await stream.aclose()  # type: ignore[attr-defined]

    def _head_headers(self, request: Forwarded, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The replica's response headers; its X-Request-Id is dropped when the request came with one (the
        app echoes it, and a proxy in front that set it on the request, as Ray Serve's does, adds it again)."""
        if any(k.lower() == b"x-request-id" for k, _ in request.headers):
            return [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
        return list(headers)

    async def _fail_started(self, send: Send, start: dict[str, Any] | None, why: str) -> None:
        """End a response whose head went out: an event stream gets an error event and [DONE]."""
        headers = dict((k.lower(), v) for k, v in (start or {}).get("headers", []))
        body = b""
        if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            event = error_body("the replica serving this stream failed; retry the request", 502,
                               code="replica_failed")
            body = (sse(event) + sse("[DONE]")).encode()
        logger.warning("a response in flight lost its replica: %s", why)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _unavailable(self, send: Send, retried: bool) -> None:
        if self.closing:
            status, message, code = 503, "the server is shutting down", "shutting_down"
        elif retried:
            status, message, code = 503, "the replicas that took this request failed; retry shortly", "replica_failed"
        else:
            status, message, code = 503, "no replica is ready yet; retry shortly", "loading"
        await _json(send, status, error_body(message, status, code=code),
                    [(b"retry-after", str(self.server.retry_after_s).encode())])

    # -- health, figures, admin --------------------------------------------------------------

    async def _health(self, send: Send) -> None:
        if self.closing:
            await _json(send, 503, error_body("the server is shutting down", 503, code="shutting_down"))
        elif self.ready_count():
            await _json(send, 200, {"status": "ok"})
        elif any(r.get("state") == "failed" for r in self.reports):
            errors = "; ".join(str(r.get("error")) for r in self.reports if r.get("state") == "failed")
            await _json(send, 503, error_body(f"the replicas' warm-up failed ({errors}); see their logs", 503,
                                              code="warm_up_failed"))
        else:
            await _json(send, 503, error_body("no replica is ready yet (loading or profiling costs); retry shortly",
                                              503, code="loading"),
                        [(b"retry-after", str(self.server.retry_after_s).encode())])

    async def _metrics(self, send: Send) -> None:
        async def one(i: int) -> tuple[str, bytes] | None:
            try:
                return str(i), await asyncio.wait_for(self.fleet.metrics(i), self.config.report_timeout_s)
            except Exception as e:  # noqa: BLE001 (a replica that cannot answer is left out of this scrape)
                logger.warning("replica %d's metrics are unavailable: %s", i, e or type(e).__name__)
                return None

        texts = dict(t for t in await asyncio.gather(*(one(i) for i in self.router.healthy())) if t is not None)
        body = merge_metrics(dict(sorted(texts.items())), self.registry)
        await _respond(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")

    async def stats(self) -> dict[str, Any]:
        """The ``/stats`` document: the replicas' figures merged, each replica's, and the router's."""
        await asyncio.gather(*(self._refresh(i) for i in range(self.fleet.size)))
        reports = self.reports
        snapshots = [r["stats"] for r in reports if "stats" in r]
        first = snapshots[0] if snapshots else {}
        replicas = []
        for i, r in enumerate(reports):
            replicas.append({"replica": i, "ready": bool(r.get("ready")), "state": r.get("state"),
                             "requests": r.get("requests", 0), "routed": self.routed[i],
                             "slots": r.get("slots"), "running": r.get("running", 0), "waiting": r.get("waiting", 0),
                             "acceptance_rate": r.get("acceptance_rate"),
                             "prefix_reused_tokens": r.get("prefix_reused_tokens", 0),
                             "cached_blocks": len(r.get("blocks", ())), "pid": r.get("pid"), "host": r.get("host")})
        overheads = list(self._overheads)
        batch = [s.get("batch", {}) for s in snapshots]
        return {"window_s": first.get("window_s", self.server.stats_window_s), "paths": merge_paths(snapshots),
                "time": time.time(), "model": self.server.model_name,
                "spec_fraction": first.get("spec_fraction", self.server.spec_fraction),
                "default_method": self.server.spec.method if self.server.spec.enabled else None,
                "batch": {"max_batch": sum(b.get("max_batch", 0) for b in batch),
                          "running": sum(b.get("running", 0) for b in batch),
                          "waiting": sum(b.get("waiting", 0) for b in batch)},
                "replicas": replicas,
                "router": {"decisions": {reason: self.decisions[reason] for reason in _DECISIONS},
                           "retries": self.retries, "block_chars": self.config.router.block_chars,
                           "overhead_p50_s": percentile(overheads, 0.5),
                           "overhead_p99_s": percentile(overheads, 0.99), "overhead_samples": len(overheads)}}

    async def _broadcast(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send an admin request to every ready replica; the answer is the first one's (they share one token)."""
        request = _forwarded(scope, await _read_body(receive))
        targets = self.router.healthy()
        if not targets:
            await self._unavailable(send, retried=False)
            return

        async def collect(i: int) -> list[dict[str, Any]] | None:
            try:
                return [m async for m in self.fleet.forward(i, request)]
            except Exception as e:  # noqa: BLE001 (the others still answer)
                logger.warning("replica %d did not take an admin request: %s", i, e)
                return None

        answers = [a for a in await asyncio.gather(*(collect(i) for i in targets)) if a]
        if not answers:
            await self._unavailable(send, retried=True)
            return
        for message in answers[0]:
            await send(message)


def _pinned(scope: Scope) -> int | None:
    """The replica a request names in its X-Verispec-Replica header (-1 for a value that is no number)."""
    for key, value in scope.get("headers", []):
        if key.lower() == REPLICA_HEADER.encode():
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else -1
    return None


def _forwarded(scope: Scope, body: bytes) -> Forwarded:
    client = scope.get("client")
    return Forwarded(method=scope["method"], path=scope["path"], query_string=scope.get("query_string", b""),
                     headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])), body=body,
                     client=tuple(client) if client else None, scheme=scope.get("scheme", "http"))


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, content_type: bytes,
                   headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, obj: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await _respond(send, status, json.dumps(obj).encode(), b"application/json", headers)


def tokenizer_prompt_text(tokenizer: Any) -> PromptText:
    """A :data:`PromptText` for the replicas' model: the text their engines tokenize (chat through the
    template; a completion's prompt after the BOS token's text where the tokenizer adds one)."""
    from verispec.server.tools import template_messages

    bos = tokenizer.decode(tokenizer.encode("", add_special_tokens=True), skip_special_tokens=False)

    def text(kind: str, body: dict[str, Any]) -> str | None:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not tokenizer.chat_template:
                return None
            return tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                 tokenize=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return bos + prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return tokenizer.decode(prompt, skip_special_tokens=False)
        return None

    return text
