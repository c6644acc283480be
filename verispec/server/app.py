"""The FastAPI application: OpenAI-compatible endpoints, metrics, canary admin and the dashboard."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from verispec import __version__
from verispec.engine.costs import PROFILE_K
from verispec.engine.engine import Engine
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.server import completions
from verispec.server.canary import CanaryRouter
from verispec.server.config import ServerConfig
from verispec.server.errors import APIError, install_error_handlers
from verispec.server.limits import HostCheck, RequestLimits, prompt_byte_limit
from verispec.server.metrics import ServerMetrics
from verispec.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    FractionResponse,
    FractionUpdate,
    Health,
    ModelCard,
    ModelList,
)
from verispec.server.state import ServerState
from verispec.server.worker import PLAIN_PATH, SPECULATIVE, EngineWorker, Worker

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    429: {"model": ErrorResponse, "description": "too many requests waiting (see Retry-After)"},
    503: {"model": ErrorResponse, "description": "loading (see Retry-After) or shutting down"},
}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing bearer token"},
    403: {"model": ErrorResponse, "description": "wrong token, or admin endpoints disabled"},
}

# A constant (the scheme's description for the OpenAPI document), not state.
AdminCredentials = Annotated[HTTPAuthorizationCredentials | None,
                             Depends(HTTPBearer(auto_error=False, description="the admin token given at start-up"))]


def _strip_422(app: FastAPI) -> None:
    """Document 400 instead of FastAPI's default 422: validation errors are answered with 400, as OpenAI does."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(engine: Engine, config: ServerConfig, worker: Worker | None = None) -> FastAPI:
    """Build the app serving ``engine``; the worker thread starts and stops with the app's lifespan.

    The default worker is an :class:`EngineWorker` driving ``engine`` with ``config.max_batch``
    slots (continuous batching; 1 runs one request at a time). ``worker`` replaces it (it must
    report to the app's metrics itself).

    At start-up the worker's ``warm_up(k_max)`` (where it has one) profiles costs on a thread of
    its own, for k up to the larger of :data:`~verispec.engine.costs.PROFILE_K` and the server's
    k; until it has run, ``/health`` and the ``/v1`` endpoints answer 503 ``loading``.
    """
    if engine.tokenizer is None:
        raise VerispecError("the server needs a model with a tokenizer")
    label_sets = [(PLAIN_PATH, "none")]
    if config.spec.enabled:
        label_sets.append((SPECULATIVE, config.spec.method))
    metrics = ServerMetrics(config.stats_window_s, tuple(label_sets))
    if worker is None:
        worker = EngineWorker(engine, metrics, config.max_queue, config.spec, config.max_batch,
                              prefix_reuse=config.prefix_reuse)
    state = ServerState(engine, config, worker, metrics, CanaryRouter(config.spec_fraction), int(time.time()),
                        prompt_byte_limit(engine.tokenizer, worker.context_len))
    if state.prompt_byte_limit is not None:
        logger.debug("prompts over %d bytes cannot fit the context: refused before tokenizing",
                     state.prompt_byte_limit)
    # Sized by the server, never by a request: a request's larger k is priced by extending the curves.
    k_max = max(PROFILE_K, config.spec.k)

    def warm_up() -> None:
        run = getattr(state.worker, "warm_up", None)
        if run is not None:
            if config.spec.k_policy == "cost":
                logger.info("warming up: profiling draft and verification costs for k up to %d", k_max)
            run(k_max)

    dashboard = (files("verispec.server") / "dashboard.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        logger.info("serving %s (speculation: %s, fraction %.2f, batch %d)", config.model_name,
                    ", ".join(sorted(state.worker.available_methods)) or "none", state.router.fraction,
                    config.max_batch)
        state.readiness.start(warm_up)
        try:
            yield
        finally:
            state.closing = True
            state.worker.close()
            if not await asyncio.to_thread(state.worker.join, config.shutdown_timeout_s):
                logger.warning("the engine worker did not stop within %.0f s", config.shutdown_timeout_s)

    # No /docs or /redoc: those pages load their scripts from a CDN, which a closed network lacks.
    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible server for lossless speculative decoding.")
    app.state.verispec = state
    install_error_handlers(app)
    _strip_422(app)
    app.add_middleware(RequestLimits, max_body_bytes=config.max_body_bytes, timeout_s=config.read_timeout_s)
    if config.checks_host:  # added last, so it runs first: a refused Host never sends its body
        app.add_middleware(HostCheck, allowed=config.allowed_hosts or ())

    def require_ready() -> None:
        """Raise the 503 a request gets before the warm-up has run (or after it failed)."""
        readiness = state.readiness
        if readiness.state == "loading":
            raise APIError(503, "the server is loading (profiling costs); retry shortly", code="loading",
                           headers={"Retry-After": str(state.config.retry_after_s)})
        if readiness.state == "failed":
            raise APIError(503, f"the server's warm-up failed ({readiness.error}); see its log",
                           code="warm_up_failed")

    ready = [Depends(require_ready)]

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS, dependencies=ready,
              summary="Complete a prompt (stream: true for server-sent events)")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.handle(state, request, body, "completion")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS, dependencies=ready,
              summary="Answer a conversation through the model's chat template")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await completions.handle(state, request, body, "chat")

    @app.get("/v1/models", response_model=ModelList, dependencies=ready, summary="The served model",
             responses={503: {"model": ErrorResponse, "description": "loading (see Retry-After)"}})
    async def list_models() -> ModelList:
        card = ModelCard(id=config.model_name, created=state.started, max_model_len=state.worker.context_len,
                         speculative_methods=sorted(state.worker.available_methods))
        return ModelList(data=[card])

    @app.get("/health", response_model=Health, summary="Readiness: ok once the server takes requests",
             responses={503: {"model": ErrorResponse, "description": "loading, warm-up failed, or shutting down"}})
    async def health() -> Health:
        if state.closing:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        require_ready()
        return Health(status="ok")

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats", summary="Rolling per-path figures behind the dashboard")
    async def stats() -> JSONResponse:
        snap = metrics.snapshot()
        snap.update(time=time.time(), model=config.model_name, spec_fraction=state.router.fraction,
                    default_method=config.spec.method if config.spec.enabled else None, batch=state.worker.stats())
        return JSONResponse(snap)

    @app.get("/dashboard", response_class=HTMLResponse, summary="Live charts of both paths")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(dashboard)

    def require_admin(credentials: AdminCredentials) -> None:
        if config.admin_token is None:
            raise APIError(403, "admin endpoints are disabled: start the server with an admin token",
                           code="admin_disabled")
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise APIError(401, "missing admin token (Authorization: Bearer TOKEN)", code="missing_token",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(credentials.credentials.encode(), config.admin_token.encode()):
            raise APIError(403, "wrong admin token", code="invalid_token")

    @app.post("/admin/spec-fraction", response_model=FractionResponse, responses=_ADMIN_ERRORS,
              dependencies=[Depends(require_admin)], summary="Change the canary's speculative fraction live")
    async def set_spec_fraction(body: FractionUpdate) -> FractionResponse:
        previous = state.router.set_fraction(body.fraction)
        logger.info("speculative fraction %.3f -> %.3f", previous, body.fraction)
        return FractionResponse(fraction=body.fraction, previous=previous)

    return app
